"""An engine's counters and timings, and the one place that records them (and feeds the
process's Prometheus metrics through Telemetry)."""
import contextlib
import dataclasses
import json
import threading
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
    num_sampled_rows: int = 0  # (sequence, step) pairs of sampled requests given drafts
    num_capacity_waits: int = 0  # admissions the target refused for capacity (then waited)

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
    plain_steps: int = 1  # tokens a row the verify decoded plainly (VerifyCommand.plain_steps)
    rounds: int = 1  # rounds of the hosted draft's proposals it ran (VerifyCommand.rounds)
    width: int = 0  # the most drafts a row verified in one forward (one round)


class StepLog:
    """Appends one JSON line per verified step to a file (the coordinator's --step-log): what
    each row drafted and committed, and where the step's time went. Engines of one process
    share it."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, entry: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")


class Recorder:
    """Records an engine's work into its EngineStats, the shared Telemetry and, when one is
    given, the step log."""

    def __init__(self, telemetry: Telemetry | None = None, step_log: StepLog | None = None):
        self.stats = EngineStats()
        self.telemetry = telemetry or Telemetry()
        self.step_log = step_log
        self._prefill_s = {"target": 0.0, "draft": 0.0}  # since the last logged step

    @contextlib.contextmanager
    def prefill(self, service: str):
        """Time a prefill command ("target" or "draft"), whatever its outcome."""
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.stats.prefill_seconds += seconds
            self._prefill_s[service] += seconds
            self.telemetry.prefilled(seconds)

    def log_step(self, record: "StepRecord", rows: list[tuple], step_s: float) -> None:
        """rows: per row (draft kind index or None, drafts verified over every round,
        accepted, committed)."""
        if self.step_log is None:
            return
        draft = record.draft_timing
        self.step_log.write({
            "t": round(time.time(), 4), "step": self.stats.num_steps, "rows": len(rows),
            "mixed": record.mixed, "width": record.width,
            "kinds": [r[0] for r in rows], "drafts": [r[1] for r in rows],
            "accepted": [r[2] for r in rows], "committed": sum(r[3] for r in rows),
            "step_s": round(step_s, 5), "draft_s": round(record.draft_s, 5),
            "verify_s": round(record.verify_s, 5), "plain_steps": record.plain_steps,
            "rounds": record.rounds,
            "draft_compute_s": round(draft.compute_seconds, 5) if draft else 0.0,
            "verify_compute_s": round(record.verify_timing.compute_seconds, 5),
            "draft_forward_s": round(draft.forward_seconds, 5) if draft else 0.0,
            "verify_forward_s": round(record.verify_timing.forward_seconds, 5),
            "realign_s": round(record.verify_timing.realign_seconds
                               + (draft.realign_seconds if draft else 0.0), 5),
            "prefill_target_s": round(self._prefill_s["target"], 5),
            "prefill_draft_s": round(self._prefill_s["draft"], 5)})
        self._prefill_s = {"target": 0.0, "draft": 0.0}

    def sampled_row(self) -> None:
        self.stats.num_sampled_rows += 1

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
