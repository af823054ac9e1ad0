"""When an engine probes its lost services again, and the probes in flight.

A retry is due after a backoff that starts at reconnect_backoff_s[0] and doubles up to
reconnect_backoff_s[1] while something stays lost, and starts over once everything answers
(or a service left on purpose: another may answer soon). A probe is a Describe carried by
gRPC's own threads, one per service address at a time, so a hung service stalls nothing.
"""
import time

from coordinator.clients import ModelInfo, Probe


class Reconnect:
    def __init__(self, backoff_s: tuple[float, float]):
        self.backoff_s = backoff_s
        self._delay = backoff_s[0]
        self._next = 0.0  # time.monotonic() from which a retry is due
        self._probes: dict[str, Probe] = {}  # service address -> its probe in flight

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def schedule(self, soon: bool = False) -> None:
        """The next retry after the current delay, which then doubles; soon: from the first
        delay again."""
        if soon:
            self._delay = self.backoff_s[0]
        self._next = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, self.backoff_s[1])

    def now(self) -> None:
        """The next retry is due at once."""
        self._next = 0.0

    def settled(self) -> None:
        """Everything answers: the next loss starts from the first delay."""
        self._delay = self.backoff_s[0]

    def pause(self) -> float:
        """How long to wait before asking again whether a retry is due."""
        return min(0.05, self._delay)

    def answer(self, client) -> ModelInfo | None:
        """The service's ModelInfo once a probe found it taking commands again; else None,
        with a probe in flight (a new one when the last went unanswered)."""
        probe = self._probes.get(client.address)
        if probe is not None and not probe.done():
            return None
        info = self._probes.pop(client.address).info() if probe is not None else None
        if info is None:
            self._probes[client.address] = client.probe()
        return info

    @property
    def next_retry(self) -> float:
        """time.monotonic() from which a retry is due."""
        return self._next
