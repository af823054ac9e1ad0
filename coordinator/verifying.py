"""Running a cohort's verify: one command to the target, on a worker thread where the step
overlaps it with drafting the next cohort (`--overlap`; "auto": only where no service runs on
the CPU, since services that share the host's cores slow each other down). A cohort that
decodes plainly (no draft up, none planned, or stepped aside) decodes several tokens a row in
that one command (`plain_steps`); a cohort whose drafts the target's hosted draft proposes,
or a lookup's line gives, runs several rounds of drafting and verifying in one (`rounds`)."""
import concurrent.futures
import dataclasses
import logging
import time

from coordinator.clients import Hosted, Timing, VerifyOutcome, VerifySpec
from coordinator.drafting import DraftedCohort
from coordinator.peers import Peers
from coordinator.pool import RequestPool
from coordinator.requests import RequestHandle

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Verified:
    """The target's answer to a cohort's verify command."""

    outcomes: list[VerifyOutcome]  # one per row, in row order
    timing: Timing
    seconds: float  # coordinator-side round trip
    hosted: Hosted | None = None  # the hosted draft's answer to a deferred propose
    plain_steps: int = 1  # the plain steps the command decoded (VerifyCommand.plain_steps)
    rounds: int = 1  # the rounds of the hosted draft's proposals it ran (VerifyCommand.rounds)

    @property
    def forwards(self) -> int:
        """The target's forwards a row the command ran: its plain steps or its rounds."""
        return max(self.plain_steps, self.rounds)


def ran(outcomes: list[VerifyOutcome]) -> int:
    """The rounds a verify ran (every row ran the same; one where it ran no rounds)."""
    return max([1] + [len(o.rounds) for o in outcomes])


def cohort_timeout(handles: list[RequestHandle]) -> float | None:
    """How long a cohort's commands may wait in a service: until the last row's deadline
    (None when a row has none). A row whose deadline passes mid-step is ended after the
    step, so one request's short deadline never costs its cohort mates a step."""
    deadlines = [h.deadline for h in handles]
    if not deadlines or None in deadlines:
        return None
    return max(0.001, max(deadlines) - time.monotonic())


class Verifier:
    def __init__(self, peers: Peers, pool: RequestPool, overlap: str, plain_steps: int = 1,
                 rounds: int = 1):
        """overlap: "on", "off" or "auto" (decided by `configure`); plain_steps: the most
        tokens a row a plain cohort decodes in one command (see `plain_steps`); rounds: the
        most rounds of the hosted draft a command runs (see `rounds`)."""
        self.peers = peers
        self.pool = pool
        self.overlap = overlap
        self.max_plain_steps = plain_steps
        self.max_rounds = rounds
        self._overlapping: bool | None = None  # `overlap`, resolved by configure()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify")

    @property
    def configured(self) -> bool:
        return self._overlapping is not None

    def configure(self, target, infos) -> None:
        """Resolve "auto" from the devices the services (their ModelInfo, None where not
        known) report: on unless every service runs on the CPU."""
        self._overlapping = self.overlap == "on"
        if self.overlap == "auto" and self.peers.kinds:
            devices = {info.device.split(":")[0] or None if info else None
                       for info in [target] + infos}
            self._overlapping = devices != {"cpu"} and None not in devices
            log.info("drafting the next cohort while the target verifies: %s (devices %s)",
                     "on" if self._overlapping else "off", sorted(map(str, devices)))

    def overlapping(self) -> bool:
        """Whether this step drafts the next cohort while the target verifies."""
        return bool(self._overlapping) and self.peers.draft_up

    def submit(self, cohort: DraftedCohort) -> concurrent.futures.Future:
        """Verify on the worker thread; the future's result is what `verify` returns."""
        return self._thread.submit(self.verify, cohort)

    def verify(self, cohort: DraftedCohort) -> Verified:
        """The cohort's verify; with deferred rows, the hosted draft's propose runs first in
        the same command and they verify what it proposed (Verified.hosted)."""
        specs = [VerifySpec(row.seq.seq_id, row.seq.target.cache_len,
                            row.seq.token_ids[row.seq.target.cache_len:], row.draft_token_ids,
                            row.seq.sampling, row.seq.logprobs, row.token_masks,
                            row.num_drafts if row.deferred else 0, row.seq.output_counts(),
                            row.continuation, not row.seq.stop_token_ids)
                 for row in cohort.rows]
        timeout = cohort_timeout(self.pool.handles_of(cohort.seqs))
        started = time.perf_counter()
        rounds = self.rounds(cohort)
        if cohort.deferred is None:  # (plain steps need no drafts, rounds some: one is 1)
            steps = self.plain_steps(cohort)
            outcomes, timing = self.peers.target.verify(cohort.mixed, specs, timeout=timeout,
                                                        plain_steps=steps, rounds=rounds)
            return Verified(outcomes, timing, time.perf_counter() - started, plain_steps=steps,
                            rounds=ran(outcomes))
        outcomes, timing, hosted = self.peers.target.verify(
            cohort.mixed, specs, timeout=timeout, propose=cohort.deferred.command(),
            rounds=rounds)
        # the draft's part of the command is booked as drafting (Drafter.resolve)
        inside = hosted.timing.compute_seconds
        timing = dataclasses.replace(timing, compute_seconds=max(0.0, timing.compute_seconds
                                                                 - inside))
        return Verified(outcomes, timing, time.perf_counter() - started - inside, hosted,
                        rounds=ran(outcomes))

    def plain_steps(self, cohort: DraftedCohort) -> int:
        """How many tokens a row the cohort's verify decodes: up to --plain-steps where the
        step verifies no draft and awaits none (no draft is up; the drafts asked proposed
        nothing, or nothing the plan took; the plan drafts for no row; or the evidence
        stepped the cohort aside: then no more than it lets before its next probe,
        DraftedCohort.room), no row is under a grammar and no request waits or is part-fed
        (none waits on these steps to be admitted or fed), never more than a row has left;
        else one. The evidence weighs a step that asked drafts and decoded several on neither
        side (DraftingPolicy.observe_step)."""
        if self.max_plain_steps <= 1 or not cohort.verifies_no_draft \
                or not self._may_run_long(cohort):
            return 1
        room = cohort.room if cohort.room is not None and self.peers.draft_up \
            else self.max_plain_steps
        return max(1, min(self.max_plain_steps, room,
                          min(row.seq.draft_room + 1 for row in cohort.rows)))

    def rounds(self, cohort: DraftedCohort) -> int:
        """How many rounds of drafting and verifying a cohort's verify runs: up to
        --draft-rounds where some row drafts and every row that drafts does so with the
        hosted draft or a lookup's line (a drafted row of another kind verifies one round's
        drafts), no row is under a grammar and no request waits or is part-fed (as for plain
        steps), each round committing at most K + 1 tokens a row of what every row has left;
        else one."""
        k = max(row.num_drafts if row.deferred else len(row.draft_token_ids)
                for row in cohort.rows)
        if self.max_rounds <= 1 or not k or not self._may_run_long(cohort) or any(
                row.draft_token_ids and not row.deferred and not row.continuation
                for row in cohort.rows):
            return 1
        return max(1, min(self.max_rounds,
                          min((row.seq.draft_room + 1) // (k + 1) for row in cohort.rows)))

    def _may_run_long(self, cohort: DraftedCohort) -> bool:
        """Whether the cohort's command may decode several tokens a row: no row is under a
        grammar, and `quiet`."""
        return all(row.seq.constraint is None for row in cohort.rows) and self.quiet()

    def quiet(self) -> bool:
        """No request waits or is part-fed: none waits on a command that runs long."""
        return not self.pool.num_waiting() and self.pool.prefilling() is None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
