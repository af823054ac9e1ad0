"""How engines pass requests to one another: all an engine knows of the others.

The router keeps one Handover over its engines and gives it to each engine it adds; no engine
holds the router or the fleet. So calls run one way: membership calls the fleet, the fleet
builds engines and calls the router, the router calls the engines (submit, cancel, start,
stop); an engine calls its handover when it must give its requests away (its target lost,
draining, full or removed), when it ends, and when whether it serves changed; the handover
calls the other engines (`adopt`) and the server's health listener.
"""
import functools
import operator
import threading

from coordinator.stats import EngineStats


class Handover:
    def __init__(self):
        self.engines: list = []  # coordinator.engine.Engine, in the order they were added
        self._lock = threading.Lock()
        self._ended = EngineStats()  # the counters of engines that left the membership
        self._on_health = None  # on_health(serving: bool), see listen

    def listen(self, on_health) -> None:
        """on_health(serving) is told whenever an engine's health changed."""
        self._on_health = on_health

    def accepting(self, source=None) -> list:
        """The engines that take new requests, but the one whose peers are `source`."""
        return [e for e in list(self.engines) if e.peers is not source and e.accepting]

    def others_accepting(self, source) -> bool:
        return bool(self.accepting(source))

    def healthy(self) -> bool:
        """Some engine takes new requests (its target is reachable)."""
        return bool(self.accepting())

    def move(self, source, handles) -> bool:
        """Move `handles` from the engine whose peers are `source` (out of its pool) to the
        others that take new work, the least loaded first; False, nothing moved, when there
        are none."""
        live = self.accepting(source)
        if not live:
            return False
        source.pool.take_all(handles)
        for handle in handles:  # adopt() raises the adopter's load at once: this balances
            min(live, key=lambda e: e.pool.load()).adopt([handle])
        return True

    def ended(self, engine) -> None:
        """An engine that left the membership ended (its requests moved): it is no longer
        one of the engines, and its counters are kept."""
        with self._lock:
            if engine in self.engines:
                self.engines.remove(engine)
                self._ended = self._ended + engine.stats
        self.health_changed()

    def health_changed(self) -> None:
        """An engine lost or regained a peer."""
        if self._on_health is not None:
            self._on_health(self.healthy())

    def stats(self) -> EngineStats:
        """Every engine's counters, those that ended included, added up."""
        return functools.reduce(operator.add, (e.stats for e in list(self.engines)),
                                self._ended)
