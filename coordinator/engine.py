"""The step loop of one target replica: admit -> prepare (draft) -> verify -> finish (commit).

One engine thread owns every Sequence; request threads talk to it only through the pool
(`submit`, `cancel`) and each request's event queue. The loop is all this module holds; its
parts live beside it: the request pool (`pool`), the model services and their losses
(`peers`; their retries: `reconnect`), the drafting policy's plan (`policy`) and the
proposals (`drafting`), the verify command (`verifying`), and the commit of a row's
verification (`commit`). The engine keeps every committed token, so a lost service is
re-prefilled from this record: a draft outage leaves the other draft kinds, then target-only
decoding; a target outage makes requests wait (bounded by their deadlines) or moves them to
another replica.
"""
import contextlib
import logging
import threading
import time

from batchspec import errors
from coordinator import commit, scheduler
from coordinator.config import EngineConfig
from coordinator.drafting import DraftedCohort, Drafter
from coordinator.drafts import DraftKind
from coordinator.evidence import Evidence
from coordinator.peers import Peers, PeersConfig
from coordinator.policy import DraftingConfig, DraftingPolicy
from coordinator.pool import RequestPool
from coordinator.requests import RequestHandle
from coordinator.sequence import EVERY_KIND, Sequence, forget_caches
from coordinator.stats import EngineStats, Recorder, StepRecord
from coordinator.turnover import Turnover
from coordinator.verifying import Verified, Verifier, cohort_timeout

log = logging.getLogger(__name__)


def default_evidence(config: EngineConfig, planner) -> Evidence | None:
    """Step-aside evidence for the goodput policy the engine calibrates itself; none for
    "fixed" drafting, a policy given as it is, or --step-aside off."""
    if config.step_aside and config.draft_policy == "goodput" and planner is None:
        return Evidence()
    return None


def prompt_chunk(config: EngineConfig, pool: RequestPool) -> int:
    """The most prompt tokens the target is fed between two steps: a chunk while other
    sequences decode (they wait for it), else no limit (0: a prompt is fed whole)."""
    return config.prefill_chunk_tokens if pool.decoding() else 0


def step_record(cohort: DraftedCohort, verified: Verified, fallback: bool) -> StepRecord:
    """The stats' and step log's record of a verified cohort (fallback: no draft was up)."""
    return StepRecord(cohort.mixed, fallback, cohort.plain, cohort.timing, verified.timing,
                      cohort.round_trip_s, verified.seconds, verified.plain_steps,
                      verified.rounds,
                      max((len(row.draft_token_ids) for row in cohort.rows), default=0))


def commit_rows(drafter, pool: RequestPool, cohort: DraftedCohort, verified: Verified,
                step: int, telemetry) -> tuple[list[Sequence], list[tuple]]:
    """Commit each row's verified tokens (the drafter observing what its drafts got right
    first): (the sequences that finished, each row's trace for the step log)."""
    finished, trace = [], []
    for row, outcome in zip(cohort.rows, verified.outcomes):
        commit.check(row.seq, outcome)
        drafter.observe(row, outcome)
        before = row.seq.committed_len
        if commit.commit(pool.active[row.seq.seq_id], outcome, row.drafts_verified(outcome),
                         step, telemetry):
            finished.append(row.seq)
        trace.append(row.traced(outcome, row.seq.committed_len - before))
    return finished, trace


def drafting_config(config: EngineConfig) -> DraftingConfig:
    """The drafting policy's part of the engine's configuration."""
    return DraftingConfig(config.num_draft_tokens, config.draft_policy,
                          config.min_draft_confidence, config.plain_steps,
                          config.draft_rounds)


class Engine:
    def __init__(self, target, drafts: list[list], config: EngineConfig,
                 eos_token_ids: list[int], *, telemetry=None, handover=None, seq_ids=None,
                 planner=None, evidence=None, step_log=None):
        """drafts: per draft kind, its replicas (clients), used one at a time; handover: the
        coordinator.handover.Handover of the engines this one is one of (None: alone);
        seq_ids: an id counter shared by those engines; planner: a goodput policy to use as
        it is (else one is calibrated); evidence: an evidence.Evidence to consult (default: a
        new one under the goodput policy, none for a given policy or "fixed"); step_log: a
        stats.StepLog."""
        self.config = config
        self.recorder = Recorder(telemetry, step_log)
        self.pool = RequestPool(config.max_num_seqs, config.max_queue, eos_token_ids, seq_ids)
        self.peers = Peers(target, [DraftKind(i, replicas) for i, replicas in enumerate(drafts)],
                           self.pool, PeersConfig(config.reconnect_backoff_s,
                                                  config.max_prefill_tokens),
                           self.recorder, handover)
        self.policy = DraftingPolicy(
            drafting_config(config), len(drafts), planner=planner,
            evidence=evidence if evidence is not None else default_evidence(config, planner))
        self.verifier = Verifier(self.peers, self.pool, config.overlap, config.plain_steps,
                                 config.draft_rounds)
        self.drafter = Drafter(self.peers, self.policy, self.recorder, self.verifier.quiet)
        self._thread: threading.Thread | None = None
        self._thread_exit = False
        self.turnover = Turnover(self.peers, self.pool, config.max_num_seqs)
        self._prepared: DraftedCohort | None = None  # drafted while the last cohort verified

    # ---- request side (any thread) --------------------------------------------------------------
    def submit(self, *args, **kwargs) -> RequestHandle:
        """See RequestPool.submit."""
        return self.pool.submit(*args, **kwargs)

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancelled.set()
        self.pool.wake()

    def adopt(self, handles: list[RequestHandle]) -> None:
        """Take over requests from another engine; they are prefilled here from their
        committed tokens at the next admission, ahead of new arrivals."""
        forget_caches([h.seq for h in handles], target=True, drafts=EVERY_KIND)
        self.pool.requeue(handles)

    @property
    def stats(self) -> EngineStats:
        return self.recorder.stats

    @property
    def target_up(self) -> bool:
        return self.peers.target_up

    @property
    def accepting(self) -> bool:
        """It takes new requests: its target is up, not draining, and still a member."""
        return self.peers.target_up and not self.peers.target_draining \
            and not self.turnover.removed

    @property
    def stopping(self) -> bool:
        """stop() has begun: new requests are refused."""
        return self.pool.stopping

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.configure()  # now, not on the first request's path
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop admitting; finish in-flight work for up to grace_s seconds; fail the rest."""
        self.pool.refuse_new()
        end = time.monotonic() + grace_s
        while not self.pool.idle() and time.monotonic() < end:
            time.sleep(0.05)
        self._thread_exit = True
        self.pool.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.verifier.shutdown()
        for handle in self.pool.handles():
            handle.fail(errors.Unavailable("the coordinator stopped"))

    def configure(self) -> None:
        """Ask each service once what its forwards cost and what device it runs on: the
        drafter calibrates from the costs, the verifier decides whether to overlap."""
        target, infos = self.peers.describe()
        self.drafter.calibrate(target, infos)
        self.verifier.configure(target, infos)

    def _run(self) -> None:
        while True:
            # a lost service is retried even with nothing to do, so it can take work again
            self.pool.wait_for_work(lambda: not self._thread_exit and self.peers.target_up
                                    and self.turnover.idle())
            if self._thread_exit:
                return
            try:
                self.turnover.run_posted()
                if self.turnover.removed and self._leave():
                    return
                self.step()
            except Exception:  # outside any request's part of the step (reaping, reconnection)
                log.exception("engine step failed")
                time.sleep(0.05)

    def _leave(self) -> bool:
        """A removed engine hands its requests to the others and ends (True); until another
        engine takes them it keeps serving them here."""
        if not self.turnover.moved_away():
            return False
        self._prepared = None
        self.verifier.shutdown()
        self.turnover.end(self)
        return True

    # ---- one step (engine thread) ---------------------------------------------------------------
    def step(self) -> None:
        """Drop cancelled/expired requests, admit, then verify one cohort, and (overlapping)
        draft for the next cohort while the target verifies this one. A failure fails only
        the requests of the part that failed (see _isolated)."""
        if not self.verifier.configured:
            self.configure()
        self._reap()
        if not self.peers.ensure():
            time.sleep(self.peers.reconnect.pause())
            return
        self.turnover.watch()
        if self.peers.target_draining and self.turnover.target_leaving():
            self._prepared = None
            return
        # between two steps of the sequences decoding: one chunk of a prompt, or an admission
        extended = self._extend_prefill()
        if self.turnover.may_admit() and not (extended and self.pool.decoding()):
            self._admit()
        started = time.perf_counter()
        current = self._prepared.still_open(self.pool.active) if self._prepared else None
        self._prepared = None
        current = current or self._prepare(exclude=set())
        if current is None:
            return
        constrained = None
        with self._isolated("grammar", self.pool.handles_of(current.seqs)):
            # at the rows' committed tokens
            constrained = current.constrained(self.config.num_draft_tokens)
        if constrained is None:  # its rows were ended
            return
        current = constrained
        in_flight = None
        if self.verifier.overlapping():
            in_flight = self.verifier.submit(current)
            # the next cohort's draft runs while the target verifies (disjoint rows)
            self._prepared = self._prepare(exclude={s.seq_id for s in current.seqs})
            self.stats.num_overlapped_steps += self._prepared is not None
        with self._isolated("step", self.pool.handles_of(current.seqs)):
            try:
                verified = in_flight.result() if in_flight else self.verifier.verify(current)
            except errors.Unavailable as error:
                self._target_lost(error)
                return
            except errors.DeadlineExceeded:
                return  # the rows' deadlines passed while queued: _reap ends them next step
            self._finish(current, verified, started)

    def _reap(self) -> None:
        now = time.monotonic()
        for handle in self.pool.handles():
            if handle.cancelled.is_set():
                self._end(handle, errors.Cancelled("the client cancelled"))
            elif handle.deadline is not None and now > handle.deadline:
                self._end(handle, errors.DeadlineExceeded(
                    f"deadline passed after {handle.seq.num_generated} tokens"))

    def _extend_prefill(self) -> bool:
        """Feed the target the next chunk of the oldest prompt it holds in part (the rest of
        it where no other sequence decodes); False where none is."""
        seq = self.pool.prefilling()
        if seq is None:
            return False
        handles = self.pool.handles_of([seq])
        chunk = prompt_chunk(self.config, self.pool) or seq.committed_len
        with self._isolated("prefill", handles):
            try:
                self.peers.extend_target(seq, chunk, cohort_timeout(handles))
            except errors.Unavailable as error:
                self._target_lost(error)
            except errors.DeadlineExceeded:
                pass  # its deadline passed: _reap ends it next step
        return True

    def _admit(self) -> None:
        """Move the next run of waiting requests that fits the pool into it (prefilled); while
        other sequences decode, no more prompt tokens than a chunk (a longer prompt alone, its
        first chunk only)."""
        chunk, budget = prompt_chunk(self.config, self.pool), self.config.max_prefill_tokens
        if chunk:
            budget = min(budget, chunk)
        new = self.pool.next_admission(budget, self.turnover.admit_cap)
        if not new:
            return
        with self._isolated("admission", new):
            try:
                self.peers.prefill_target([h.seq for h in new], chunk)
            except errors.Draining:  # found before a draining check did
                self.pool.requeue(new)
                self.peers.target_draining = True
                return
            except errors.ResourceExhausted as error:  # the target is full (other clients)
                self.pool.requeue(new)
                self.turnover.target_full(error, len(new))
                return
            except errors.Unavailable as error:
                self.pool.requeue(new)
                self._target_lost(error)
                return
            except errors.BatchspecError as error:
                for handle in new:
                    handle.fail(error)
                return
            self.turnover.admitted()
            for handle in new:
                handle.seq.last_step = self.stats.num_steps
                self.pool.activate(handle)
                self.recorder.telemetry.admitted(handle.seq.committed_len)

    def _prepare(self, exclude: set[int]) -> DraftedCohort | None:
        """Pick the next cohort (of rows not in `exclude`) and draft for it."""
        active = [s for s in self.pool.active_sequences()
                  if s.seq_id not in exclude and not s.prefilling]
        cohort = scheduler.pick_cohort(active, self.config.cohort_policy, self.stats.num_steps)
        if cohort is None:
            return None
        handles = self.pool.handles_of(cohort.sequences)
        with self._isolated("draft", handles):
            return self.drafter.draft(cohort.sequences, cohort_timeout(handles))
        return None

    def _finish(self, cohort: DraftedCohort, verified: Verified, started: float) -> None:
        """Commit a verified cohort (on the engine thread); `started`: when its step began.
        The evidence weighs the step without its finished requests' releases: the server
        pays those whether it drafts or not (as admissions), and the step that ends a
        request, often a short plain one after drafted ones, would carry them all."""
        cohort = self.drafter.resolve(cohort, verified.hosted, verified.rounds)
        self.drafter.observe_verify(cohort, verified.timing, verified.seconds, verified.forwards)
        record = step_record(cohort, verified, fallback=not self.peers.draft_up)
        self.recorder.step(record)
        finished, trace = commit_rows(self.drafter, self.pool, cohort, verified,
                                      self.stats.num_steps, self.recorder.telemetry)
        committed_s = time.perf_counter() - started
        self._release(finished)
        self.drafter.observe_step(cohort, sum(t[3] for t in trace), committed_s,
                                  verified.timing, verified.plain_steps)
        self.recorder.log_step(record, trace, time.perf_counter() - started)

    # ---- endings --------------------------------------------------------------------------------
    def _target_lost(self, error: errors.Unavailable) -> None:
        self._prepared = None  # drafted against caches the target no longer holds
        self.peers.target_lost(error)

    def _release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.pool.deactivate(seq)
        self.policy.forget([seq.seq_id for seq in seqs])
        self.peers.release(seqs)

    @contextlib.contextmanager
    def _isolated(self, what: str, handles: list[RequestHandle]):
        """Run one part of a step; if it fails unexpectedly, end only `handles` (those it
        worked on that are still open) and release their caches, and keep serving the rest.
        A lost service is not a failure (it raises Unavailable, handled where it happens)."""
        try:
            yield
        except Exception as error:
            log.exception("engine %s failed; ending the %d requests it touched", what,
                          len(handles))
            typed = error if isinstance(error, errors.BatchspecError) else \
                errors.BatchspecError(f"internal error: {error}")
            for handle in handles:
                self._end(handle, typed)

    def _end(self, handle: RequestHandle, error: errors.BatchspecError) -> None:
        """End a request (unless it finished already) and release it, whatever state its
        caches are in: a release the service refuses (it never held the sequence, or no
        longer does) does not matter here."""
        seq = handle.seq
        self.pool.unqueue(handle)
        try:
            if seq.seq_id in self.pool.active:
                self._release([seq])
        except errors.BatchspecError as release_error:
            log.warning("releasing seq %d after a failure: %s", seq.seq_id, release_error)
            self.pool.deactivate(seq)
            self.policy.forget([seq.seq_id])
        if seq.finish is None:
            self.recorder.telemetry.failed()
            handle.fail(error)
