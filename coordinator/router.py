"""Several target replicas: one engine per target replica, new requests balanced by load.

A sequence stays on the engine (and so the target replica and draft replica) that holds its
caches. When a target replica is lost, its engine hands its requests to the live ones, which
re-prefill them from the committed record; when it comes back it takes new work again.
"""
import dataclasses
import threading

from batchspec import errors
from coordinator.engine import Engine, EngineStats, RequestHandle


class Router:
    def __init__(self, engines: list[Engine], max_queue: int, on_health=None):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = engines
        self.max_queue = max_queue
        self._lock = threading.Lock()
        # on_health(bool): SERVING while some target is reachable. A lost draft only slows
        # decoding (the engine decodes with the target alone, output unchanged), so a load
        # balancer must keep sending work; the engine logs it and reconnects.
        self.on_health = on_health or (lambda serving: None)
        for engine in engines:
            engine.handoff = self._handoff
            engine.on_health = lambda _serving: self.on_health(self.healthy())

    def healthy(self) -> bool:
        return any(e.target_up for e in self.engines)

    def submit(self, *args, **kwargs) -> RequestHandle:
        with self._lock:
            if sum(e.num_waiting() for e in self.engines) >= self.max_queue:
                raise errors.ResourceExhausted("too many requests wait already; retry later")
            live = [e for e in self.engines if e.target_up] or self.engines
            engine = min(live, key=lambda e: e.load())
        return engine.submit(*args, **kwargs)

    def cancel(self, handle: RequestHandle) -> None:
        for engine in self.engines:
            engine.cancel(handle)

    def _handoff(self, source: Engine, handles: list[RequestHandle]) -> bool:
        live = [e for e in self.engines if e is not source and e.target_up]
        if not live:
            return False
        for handle in handles:  # adopt() raises the adopter's load at once: this balances
            min(live, key=lambda e: e.load()).adopt([handle])
        return True

    def start(self) -> None:
        for engine in self.engines:
            engine.start()

    def stop(self, grace_s: float = 0.0) -> None:
        threads = [threading.Thread(target=e.stop, args=(grace_s,)) for e in self.engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    @property
    def stopping(self) -> bool:
        return any(e.stopping for e in self.engines)

    def num_running(self) -> int:
        return sum(e.num_running() for e in self.engines)

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.engines)

    @property
    def stats(self) -> EngineStats:
        """Every engine's counters, added up."""
        total = EngineStats()
        for engine in self.engines:
            for field in dataclasses.fields(EngineStats):
                setattr(total, field.name,
                        getattr(total, field.name) + getattr(engine.stats, field.name))
        return total
