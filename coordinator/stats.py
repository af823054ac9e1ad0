"""An engine's counters and timings, and the one place that records them (and feeds the
process's Prometheus metrics through Telemetry)."""
import contextlib
import dataclasses
import time

from coordinator.clients import Timing
from coordinator.telemetry import Telemetry


@dataclasses.dataclass
class EngineStats:
    num_steps: int = 0
    num_grouped_steps: int = 0  # steps whose rows were all of one length (no realignment)
    num_realigned_steps: int = 0
    num_draft_fallback_steps: int = 0  # no draft service: target alone
    num_plain_steps: int = 0  # the policy chose K = 0 for every row: no draft call
    num_overlapped_steps: int = 0  # verifies during which the next cohort was drafted
    draft_seconds: float = 0.0  # coordinator-side round trips
    verify_seconds: float = 0.0
    draft_compute_seconds: float = 0.0  # the services' own accounts
    verify_compute_seconds: float = 0.0
    realign_seconds: float = 0.0  # both services, mixed steps only
    prefill_seconds: float = 0.0  # coordinator-side round trips, both services
    num_sampled_rows: int = 0  # (sequence, step) pairs that sent draft distributions
    num_draft_probs_bytes: int = 0  # their wire size, summed

    def __add__(self, other: "EngineStats") -> "EngineStats":
        return EngineStats(*(getattr(self, f.name) + getattr(other, f.name)
                             for f in dataclasses.fields(self)))


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one verified step did, as the engine counts it."""

    mixed: bool  # rows of different lengths: the services realigned them
    fallback: bool  # no draft service was reachable
    plain: bool  # no row verified a draft
    draft_timing: Timing | None  # the draft services' account, summed; None: no draft call
    verify_timing: Timing
    draft_s: float  # coordinator-side round trips
    verify_s: float


class Recorder:
    """Records an engine's work into its EngineStats and the shared Telemetry."""

    def __init__(self, telemetry: Telemetry | None = None):
        self.stats = EngineStats()
        self.telemetry = telemetry or Telemetry()

    @contextlib.contextmanager
    def prefill(self):
        """Time a prefill command (any service), whatever its outcome."""
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.stats.prefill_seconds += seconds
            self.telemetry.prefilled(seconds)

    def sampled_row(self, num_probs_bytes: int) -> None:
        self.stats.num_sampled_rows += 1
        self.stats.num_draft_probs_bytes += num_probs_bytes

    def step(self, record: StepRecord) -> None:
        stats, draft = self.stats, record.draft_timing
        stats.num_steps += 1
        stats.num_plain_steps += record.plain and not record.fallback
        stats.num_realigned_steps += record.mixed
        stats.num_grouped_steps += not record.mixed
        stats.num_draft_fallback_steps += record.fallback
        realign_s = record.verify_timing.realign_seconds + (draft.realign_seconds if draft else 0)
        stats.draft_seconds += record.draft_s
        stats.verify_seconds += record.verify_s
        stats.verify_compute_seconds += record.verify_timing.compute_seconds
        stats.draft_compute_seconds += draft.compute_seconds if draft else 0.0
        stats.realign_seconds += realign_s
        self.telemetry.step(record.mixed, record.fallback, record.draft_s if draft else None,
                            record.verify_s, realign_s)
