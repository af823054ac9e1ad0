"""Several target replicas: one engine per target replica, new requests balanced by load.

A sequence stays on the engine (and so the target replica and draft replica) that holds its
caches. When a target replica is lost, its engine hands its requests to the live ones through
the router's `handover` (coordinator.handover), which re-prefill them from the committed
record; when it comes back it takes new work again. The router calls the engines; an engine
never calls the router (it is given the handover when built; `add` registers it).
"""
import threading
import time

from batchspec import errors
from coordinator.engine import Engine
from coordinator.handover import Handover
from coordinator.requests import RequestHandle
from coordinator.stats import EngineStats
from coordinator.telemetry import Telemetry


class Router:
    def __init__(self, max_queue: int, telemetry: Telemetry | None = None,
                 revive_s: float = 2.0):
        """revive_s: how long a request that finds no engine accepting waits while every lost
        target is probed at once (see _revive)."""
        self.handover = Handover()
        self.max_queue = max_queue
        self.revive_s = revive_s
        self._lock = threading.Lock()
        if telemetry is not None:
            telemetry.watch_queue(self.num_running, self.num_waiting)

    @property
    def engines(self) -> list[Engine]:
        return self.handover.engines

    def add(self, engine: Engine) -> Engine:
        self.handover.engines.append(engine)
        return engine

    def healthy(self) -> bool:
        return self.handover.healthy()

    def accepting(self) -> list[Engine]:
        return self.handover.accepting()

    def health_changed(self) -> None:
        """An engine's peers changed from outside its thread (a replica joined or left)."""
        self.handover.health_changed()

    def submit(self, *args, together=None, **kwargs) -> RequestHandle:
        """See RequestPool.submit; refused while too many wait over all engines. Requests
        submitted with the same `together` (n choices of one prompt) go to the same engine
        while the live engines stay the same, so its target caches their prompt once;
        others go to the least loaded."""
        if not self.accepting():
            self._revive()
        with self._lock:
            if self.num_waiting() >= self.max_queue:
                raise errors.ResourceExhausted("too many requests wait already; retry later")
            # requests already taken wait for a lost target to come back; new ones are
            # refused while none is reachable, as the health check says NOT_SERVING
            live = self.accepting()
            if not live:
                raise errors.Unavailable("no target service is reachable; retry later")
            engine = (min(live, key=lambda e: e.pool.load()) if together is None
                      else live[hash(together) % len(live)])
        return engine.submit(*args, **kwargs)

    def _revive(self) -> None:
        """No engine accepts: have every engine whose target is down probe it now, and wait
        up to revive_s for one to answer. A lost target's retries back off (to seconds), so a
        target back from a restart may not be probed again for a while; in a rolling restart
        the next target drains meanwhile, and requests would be refused although one is up.
        Where no target is lost (every one drains, or none is configured) it returns at once."""
        deadline = time.monotonic() + self.revive_s
        while time.monotonic() < deadline:
            lost = [engine for engine in list(self.engines) if not engine.target_up]
            if not lost:
                return
            for engine in lost:
                engine.peers.retry_now()
            time.sleep(0.02)
            if self.accepting():
                return

    def cancel(self, handle: RequestHandle) -> None:
        for engine in list(self.engines):
            engine.cancel(handle)

    def start(self, on_health=None) -> None:
        """Start every engine; on_health(serving: bool) is told whenever that changes. It is
        told SERVING while some target is reachable: a lost draft only slows decoding (the
        engine decodes with the target alone, output unchanged), so a load balancer must
        keep sending work; the engine logs it and reconnects."""
        self.handover.listen(on_health)
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
        return sum(e.pool.num_running() for e in self.engines)

    def num_waiting(self) -> int:
        return sum(e.pool.num_waiting() for e in self.engines)

    @property
    def stats(self) -> EngineStats:
        """Every engine's counters, those that ended included, added up."""
        return self.handover.stats()
