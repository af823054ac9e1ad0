"""The step loop: admit -> pick a group -> draft -> verify -> commit -> stream out.

One engine thread owns every Sequence; request threads talk to it only through `submit`,
`cancel` and each request's event queue. The engine keeps every committed token, so a lost
service is re-prefilled from this record: a draft outage leaves the other draft kinds, then
target-only decoding; a target outage makes requests wait (bounded by their deadlines). A
draft is prefilled with a row only when a step first gives it that row.
Several draft kinds (a model, the n-gram lookup) may serve one engine: each step chooses,
per row, the kind and the number of tokens to draft.
"""
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import operator
import queue
import threading
import time

from batchspec import errors
from batchspec.params import SamplingParams
from coordinator import goodput, scheduler
from coordinator.clients import DraftClient, ModelInfo, Probe, ProposeSpec, TargetClient, VerifySpec
from coordinator.drafts import DraftKind
from coordinator.sequence import DraftState, Finish, Sequence
from coordinator.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # K, the most tokens a step drafts. With the goodput policy each greedy row drafts what
    # pays (0 to K); sampled rows always draft K, so a seeded request's tokens never depend on
    # timings or batch mates.
    num_draft_tokens: int = 4
    # "goodput": per row and step, the K with the most expected tokens per second (0: plain
    # decoding), from the services' measured costs and each row's acceptance;
    # "fixed": every row drafts num_draft_tokens.
    draft_policy: str = "goodput"
    # Greedy groups stop drafting early once every row's draft is less sure than this (0: off).
    min_draft_confidence: float = 0.0
    # Draft for the next cohort while the target verifies this one, so both services work at
    # once: "on", "off", or "auto": on unless both services run on CPU (then they share the
    # host's cores, and on a small CPU running both at once made each much slower).
    overlap: str = "auto"
    policy: scheduler.GroupPolicy = scheduler.GroupPolicy()
    max_num_seqs: int = 64  # sequences stepped concurrently (the pool)
    max_queue: int = 1024  # requests waiting for a pool slot; beyond it RESOURCE_EXHAUSTED
    reconnect_backoff_s: tuple[float, float] = (0.2, 5.0)  # first and longest retry delay
    # Prompt tokens per prefill command (a longer prompt goes alone): bounds how long one
    # command runs, so a slow prefill is not taken for a hung service, and lets decoding steps
    # interleave with a large admission.
    max_prefill_tokens: int = 16384

    def __post_init__(self):
        if not 1 <= self.num_draft_tokens <= 32:
            raise ValueError("num_draft_tokens must be in [1, 32]")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError("overlap must be 'auto', 'on' or 'off'")
        if self.draft_policy not in ("goodput", "fixed"):
            raise ValueError("draft_policy must be 'goodput' or 'fixed'")
        if not 0.0 <= self.min_draft_confidence <= 1.0:
            raise ValueError("min_draft_confidence must be in [0, 1]")
        if self.max_num_seqs < 1 or self.max_queue < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_queue >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's stream receives: new tokens, and at the end a finish or an error."""

    token_ids: list[int]
    finish: Finish | None = None
    error: errors.BatchspecError | None = None
    text: str = ""  # their text, when the request has a TextStream
    num_drafted: int = 0  # drafts verified in the step that committed these tokens
    num_accepted: int = 0  # the first this many of token_ids were accepted draft tokens
    draft_text: str = ""  # the part of `text` they gave (a prefix of it)


@dataclasses.dataclass
class EngineStats:
    num_steps: int = 0
    num_grouped_steps: int = 0
    num_realigned_steps: int = 0
    num_draft_fallback_steps: int = 0  # no draft service: target alone
    num_plain_steps: int = 0  # the policy chose K = 0 for every row: no draft call
    num_overlapped_steps: int = 0  # verifies during which the next group was drafted
    draft_seconds: float = 0.0  # coordinator-side round trips
    verify_seconds: float = 0.0
    draft_compute_seconds: float = 0.0  # the services' own accounts
    verify_compute_seconds: float = 0.0
    realign_seconds: float = 0.0  # both services, mixed steps only
    prefill_seconds: float = 0.0  # coordinator-side round trips, both services
    num_sampled_rows: int = 0  # (sequence, step) pairs that sent draft distributions
    num_draft_probs_bytes: int = 0  # their wire size, summed


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A group whose drafts are ready: each row's K and the draft's proposals."""

    seqs: list[Sequence]
    plan: dict[int, int]  # seq_id -> drafts it verifies (0: none)
    kinds: dict[int, int | None]  # seq_id -> the draft kind it drafts with (None: none)
    proposals: dict  # seq_id -> (draft_token_ids, draft_probs, drafted, draft cache_len)
    draft_timing: object  # the draft services' Timing, added up; None without a draft call
    draft_s: float

    @property
    def mixed(self) -> bool:
        """Rows of different lengths: the services must realign."""
        return len({s.committed_len for s in self.seqs}) > 1


NO_PROPOSAL = ([], [], 0, None)  # a row the draft did not propose for this step
# A draft whose cheapest command costs at most this share of the target's (a lookup, not a
# model) is asked for every row before the step is planned.
ASK_FIRST_SHARE = 0.05


class RequestHandle:
    def __init__(self, seq: Sequence, deadline: float | None, events=None):
        self.seq = seq
        self.deadline = deadline  # time.monotonic() value, or None
        # where the engine thread puts this request's events: anything with put(Event)
        # (a queue.Queue by default; the public server passes one that wakes its event loop)
        self.events = events if events is not None else queue.Queue()
        self.cancelled = threading.Event()
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None


class Engine:
    def __init__(self, target: TargetClient, drafts: list[list[DraftClient]],
                 config: EngineConfig, eos_token_ids: list[int],
                 telemetry: Telemetry | None = None, on_health=None, seq_ids=None):
        self.target = target
        # Draft kinds, each a list of replicas used one at a time (failing over in order).
        self.kinds = [DraftKind(i, replicas) for i, replicas in enumerate(drafts)]
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stats = EngineStats()
        self.telemetry = telemetry or Telemetry()
        # on_health(bool): told, whenever a peer is lost or back, whether the target is
        # reachable (without a draft this engine still decodes, with the target alone)
        self.on_health = on_health or (lambda serving: None)
        # handoff(engine, handles) -> bool: another engine adopts our requests when our
        # target is lost (set by the Router when there are several target replicas)
        self.handoff = None
        # sequence ids are unique across every engine of a router (they share the counter)
        self._ids = seq_ids if seq_ids is not None else itertools.count(1)
        self._lock = threading.Condition()
        self._waiting: list[RequestHandle] = []
        self._active: dict[int, RequestHandle] = {}
        self._stopping = False
        self._thread_exit = False
        self._thread: threading.Thread | None = None
        self._target_up = True
        # service address -> ids of sequences that may still hold caches there although we
        # lost the stream (a release that failed, or a loss while they were cached); released
        # when the service answers again, unless it restarted empty
        self._stale: dict[str, set[int]] = {}
        self._probes: dict[str, Probe] = {}  # service address -> its probe in flight
        self._next_retry = 0.0
        self._retry_delay = config.reconnect_backoff_s[0]
        self._policy: goodput.GoodputPolicy | None = None  # built at the first step
        self._prepared: Prepared | None = None  # a group drafted while the last one verified
        self._overlapping: bool | None = None  # config.overlap, resolved at the first step
        self._target_unit_cost: float | None = None  # seconds of its cheapest measured command
        # runs verify commands, so that the engine thread can draft meanwhile
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify")

    # ---- request side (any thread) ------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), *, ignore_eos: bool = False,
               deadline: float | None = None, text=None, events=None) -> RequestHandle:
        """Queue a request. text: a coordinator.text.TextStream that turns its tokens into
        text and finds its stop strings, on the engine thread; events: see RequestHandle."""
        seq = Sequence(next(self._ids), list(prompt_token_ids), max_new_tokens,
                       frozenset() if ignore_eos else self.eos_token_ids, sampling, text=text)
        handle = RequestHandle(seq, deadline, events)
        with self._lock:
            if self._stopping:
                raise errors.Unavailable("the coordinator is shutting down")
            if len(self._waiting) >= self.config.max_queue:
                raise errors.ResourceExhausted(
                    f"{len(self._waiting)} requests already wait; retry later")
            self._waiting.append(handle)
            self._lock.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancelled.set()
        with self._lock:
            self._lock.notify_all()

    @property
    def target_up(self) -> bool:
        return self._target_up

    @property
    def stopping(self) -> bool:
        """stop() has begun: new requests are refused."""
        return self._stopping

    @property
    def draft_up(self) -> bool:
        """Some draft kind is reachable."""
        return any(kind.up for kind in self.kinds)

    def num_running(self) -> int:
        return len(self._active)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def load(self) -> int:
        return len(self._active) + len(self._waiting)

    def adopt(self, handles: list[RequestHandle]) -> None:
        """Take over requests from another engine; they are prefilled here from their
        committed tokens at the next admission, ahead of new arrivals."""
        for handle in handles:
            handle.seq.target.forget()
            for state in handle.seq.drafts:
                state.forget()
        with self._lock:
            self._waiting = list(handles) + self._waiting
            self._lock.notify_all()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._configure()  # now, not on the first request's path
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop admitting; finish in-flight work for up to grace_s seconds; fail the rest."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        end = time.monotonic() + grace_s
        while (self._active or self._waiting) and time.monotonic() < end:
            time.sleep(0.05)
        with self._lock:
            self._thread_exit = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._verifier.shutdown(wait=False)
        for handle in list(self._active.values()) + self._waiting:
            handle.events.put(Event([], error=errors.Unavailable("the coordinator stopped")))

    # ---- the loop (engine thread) -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                # a lost service is retried even with nothing to do, so it can take work again
                while not (self._waiting or self._active or self._thread_exit
                           or not self._target_up):
                    self._lock.wait(timeout=1.0)
                if self._thread_exit:
                    return
            try:
                self.step()
            except Exception:  # outside any request's part of the step (reaping, reconnection)
                log.exception("engine step failed")
                time.sleep(0.05)

    def step(self) -> None:
        """One iteration: drop cancelled/expired requests, admit, then verify one group, and
        (with overlap) draft for the next group while the target verifies this one.
        A failure fails only the requests of the part that failed (see _isolated)."""
        self._reap()
        if not self._ensure_services():
            time.sleep(min(0.05, self._retry_delay))
            return
        self._admit()
        self.telemetry.queue(len(self._active), len(self._waiting))
        current, self._prepared = self._still_open(self._prepared), None
        current = current or self._prepare(exclude=set())
        if current is None:
            return
        if self._overlap():
            in_flight = self._verifier.submit(self._verify, current)
            # the next cohort's draft runs while the target verifies (disjoint rows)
            self._prepared = self._prepare(exclude={s.seq_id for s in current.seqs})
            verified = in_flight.result()
            if self._prepared is not None:
                self.stats.num_overlapped_steps += 1
        else:
            verified = self._verify(current)
        with self._isolated("step", self._handles(current.seqs)):
            self._finish(current, verified)

    def _overlap(self) -> bool:
        if self._overlapping is None:
            self._configure()
        return self._overlapping and self.draft_up

    def _configure(self) -> None:
        """Ask each service once what its forwards cost and what device it runs on: the
        goodput policy starts from the costs (without them every row drafts K), and overlap
        "auto" is on unless every service runs on CPU."""
        target = self._describe(self.target)
        infos = [self._describe(kind.client) for kind in self.kinds]
        fixed = self.config.draft_policy == "fixed"

        def cost(info):
            return None if fixed or info is None else \
                goodput.ServiceCost(goodput.ForwardCosts(info.step_costs))

        self._target_unit_cost = min((s for _, _, s in target.step_costs), default=None) \
            if target is not None else None
        for kind, info in zip(self.kinds, infos):
            kind.name = info.model if info is not None else kind.name
            kind.cost = cost(info)
            if info is not None and info.step_costs:
                kind.unit_cost = min(seconds for _, _, seconds in info.step_costs)
        if self._policy is None:  # one set already (a test's scripted policy) is kept
            self._policy = goodput.GoodputPolicy(
                goodput.GoodputConfig(max_k=self.config.num_draft_tokens),
                [kind.cost for kind in self.kinds], cost(target))
        self._overlapping = self.config.overlap == "on"
        if self.config.overlap == "auto" and self.kinds:
            devices = {info.device.split(":")[0] or None if info else None
                       for info in [target] + infos}
            self._overlapping = devices != {"cpu"} and None not in devices
            log.info("drafting the next group while the target verifies: %s (devices %s)",
                     "on" if self._overlapping else "off", sorted(map(str, devices)))

    @staticmethod
    def _describe(client):
        """The service's ModelInfo, or None (logged) when it does not answer."""
        try:
            return client.describe()
        except errors.BatchspecError as error:
            log.warning("%s did not describe itself (%s): drafting K every step, no overlap",
                        client.address, error)
            return None

    def _handles(self, seqs: list[Sequence]) -> list[RequestHandle]:
        return [self._active[s.seq_id] for s in seqs if s.seq_id in self._active]

    def _still_open(self, prepared: "Prepared | None") -> "Prepared | None":
        """A group drafted last step, less the rows that ended since (None if none is left)."""
        if prepared is None:
            return None
        seqs = [s for s in prepared.seqs if s.seq_id in self._active]
        return dataclasses.replace(prepared, seqs=seqs) if seqs else None

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
        with self._lock:
            if handle in self._waiting:
                self._waiting.remove(handle)
        try:
            if seq.seq_id in self._active:
                self._release([seq])
        except errors.BatchspecError as release_error:
            log.warning("releasing seq %d after a failure: %s", seq.seq_id, release_error)
            self._active.pop(seq.seq_id, None)
        if seq.finish is None:
            self.telemetry.failed()
            handle.events.put(Event([], error=error))

    def _reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            handles = list(self._active.values()) + self._waiting
        for handle in handles:
            if handle.cancelled.is_set():
                self._end(handle, errors.Cancelled("the client cancelled"))
            elif handle.deadline is not None and now > handle.deadline:
                self._end(handle, errors.DeadlineExceeded(
                    f"deadline passed after {handle.seq.num_generated} tokens"))

    def _admit(self) -> None:
        """Move the next run of waiting requests that fits the pool into it (prefilled)."""
        with self._lock:
            room = self.config.max_num_seqs - len(self._active)
            runs = scheduler.split_by_tokens([h.seq for h in self._waiting[:room]],
                                             self.config.max_prefill_tokens)
            count = len(runs[0]) if runs else 0
            new, self._waiting = self._waiting[:count], self._waiting[count:]
        if new:
            with self._isolated("admission", new):
                self._prefill_new(new)

    def _prefill_new(self, new: list[RequestHandle]) -> None:
        entries = [h.seq.prefill_entry() for h in new]
        try:
            with self._timed_prefill():
                self.target.prefill(entries)
        except errors.BatchspecError as error:
            if isinstance(error, errors.Unavailable):
                with self._lock:
                    self._waiting = new + self._waiting
                self._target_lost(error)
                return
            for h in new:
                h.events.put(Event([], error=error))
            return
        for h in new:
            h.seq.target.cache_len = h.seq.committed_len - 1
            h.seq.drafts = [DraftState() for _ in self.kinds]
            h.seq.last_step = self.stats.num_steps
            self._active[h.seq.seq_id] = h
            self.telemetry.admitted(h.seq.committed_len)

    @contextlib.contextmanager
    def _timed_prefill(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.stats.prefill_seconds += seconds
            self.telemetry.prefilled(seconds)

    def _warm(self, kind: DraftKind, seqs: list[Sequence]) -> None:
        """Prefill, from the committed record, the rows draft `kind` holds nothing of.

        Drafts are prefilled on first use, not at admission: a row the plan never gives to a
        draft (plain decoding at large batches, a row the lookup serves) never costs that
        draft a prefill, and a draft back after an outage is refilled only as rows need it."""
        cold = [s for s in seqs if s.drafts[kind.index].cache_len is None]
        if not kind.up or not cold:
            return
        try:
            with self._timed_prefill():
                self._prefill_in_runs(kind.client, cold)
        except errors.Unavailable as error:
            self._draft_lost(kind, error)
            return
        for s in cold:
            s.drafts[kind.index] = DraftState(s.committed_len - 1, s.committed_len - 1,
                                              s.drafts[kind.index].spec)

    def _prepare(self, exclude: set[int]) -> "Prepared | None":
        """Pick the next group (of rows not in `exclude`), choose each row's K and draft."""
        active = [h.seq for h in self._active.values() if h.seq.seq_id not in exclude]
        group = scheduler.pick_group(active, self.config.policy, self.stats.num_steps)
        if group is None:
            return None
        seqs = group.sequences
        with self._isolated("draft", self._handles(seqs)):
            return self._draft(seqs, self._group_timeout(self._handles(seqs)))
        return None

    def _draft(self, seqs: list[Sequence], timeout: float | None) -> Prepared:
        """Plan the group and call the drafts, the cheapest first.

        Drafts that cost next to nothing (a lookup: the n-gram draft) are asked for every
        row before planning, so the plan knows which rows they have something for and
        how much; what they offer costs nothing more to verify. While plans seldom draft
        with what one offers, it is asked only every few steps. Rows another draft proposed
        nothing for are planned again, among the drafts not called yet, before those are
        called; such a miss counts as a draft rejected at once."""
        first = self._asked_first()
        # one not due this step (DraftKind.ask_due: plans seldom use its offers) sits it out,
        # as if asked and offering nothing; never where a row samples (a seeded request's
        # proposals must not depend on its group mates)
        greedy = all(s.sampling.greedy for s in seqs)
        called = {kind.index for kind in first if greedy and not kind.ask_due()}
        early, spent = {}, []  # spent: (Timing, round-trip seconds) of each draft call
        for kind in (kind for kind in first if kind.index not in called):
            # sampled rows too: a lookup's proposal depends on the sequence's tokens alone, so
            # a seeded request still repeats
            self._warm(kind, seqs)
            got, timing, seconds = self._propose(kind, seqs, self.config.num_draft_tokens,
                                                 timeout)
            called.add(kind.index)
            early[kind.index] = {seq_id: p for seq_id, p in got.items() if p[0]}
            spent += [(timing, seconds)] if timing is not None else []
        offered = {i: {d: len(got[s.seq_id][0]) for d, got in early.items() if s.seq_id in got}
                   for i, s in enumerate(seqs)}
        plan = self._plan(seqs, {}, called, offered)
        drafted: dict[int, tuple[int, int]] = {}  # row -> (kind, k) it verifies
        misses: dict[int, list[int]] = {}  # row -> the kinds that proposed nothing for it
        proposals, missed = {}, False
        for kind in sorted(self.kinds, key=lambda kind: kind.unit_cost):
            if missed:  # what was proposed is kept; the rows that missed may go elsewhere
                plan, missed = self._plan(seqs, drafted, called, offered), False
            rows = [i for i in range(len(seqs)) if i not in drafted and plan.kind(i) == kind.index]
            if not rows:
                continue
            if kind.index in early:  # asked already: take what it offered
                for i in rows:
                    drafted[i] = (kind.index, plan.k[i])
                    proposals[seqs[i].seq_id] = early[kind.index][seqs[i].seq_id]
                continue
            called.add(kind.index)
            self._warm(kind, [seqs[i] for i in rows])
            got, timing, seconds = self._propose(
                kind, [seqs[i] for i in rows], max(plan.k[i] for i in rows), timeout)
            proposals.update(got)
            for i in rows:
                if got.get(seqs[i].seq_id, NO_PROPOSAL)[0]:
                    drafted[i] = (kind.index, plan.k[i])
                else:
                    misses.setdefault(i, []).append(kind.index)
                    missed = True
            spent += [(timing, seconds)] if timing is not None else []
        for d in early:
            self.kinds[d].asked(any(kind == d for kind, _ in drafted.values()))
        # _commit observes the kind a row ends with (its drafts, or its last miss); any
        # earlier miss is observed here
        asked = {i: drafted[i][0] if i in drafted else kinds[-1] for i, kinds in misses.items()}
        asked.update((i, kind) for i, (kind, _) in drafted.items())
        for i, kinds in misses.items():
            for d in kinds:
                if d != asked[i]:
                    self._policy.observe(seqs[i].drafts[d].spec, 1, 0, d)
        ids = [s.seq_id for s in seqs]
        draft_timing = functools.reduce(operator.add, (t for t, _ in spent)) if spent else None
        return Prepared(seqs, {ids[i]: drafted[i][1] if i in drafted else 0
                               for i in range(len(seqs))},
                        {ids[i]: asked.get(i) for i in range(len(seqs))}, proposals,
                        draft_timing, sum(s for _, s in spent))

    def _asked_first(self) -> list[DraftKind]:
        """The reachable drafts asked for every row before planning: with the goodput policy,
        those whose cheapest command costs at most ASK_FIRST_SHARE of the target's."""
        if self._policy is None:
            self._configure()
        if not self._policy.calibrated or self._target_unit_cost is None:
            return []
        return [kind for kind in self.kinds if kind.up
                and kind.unit_cost <= ASK_FIRST_SHARE * self._target_unit_cost]

    def _verify(self, prepared: "Prepared"):
        """Verify a drafted group (possibly on the verifier thread): (specs, outcomes, timing,
        seconds), or the exception it raised."""
        seqs = prepared.seqs
        specs = []
        for seq in seqs:
            k = prepared.plan[seq.seq_id]
            drafts, probs, _, _ = prepared.proposals.get(seq.seq_id, NO_PROPOSAL)
            specs.append(VerifySpec(seq.seq_id, seq.target.cache_len,
                                    seq.token_ids[seq.target.cache_len:], drafts[:k], probs[:k],
                                    seq.sampling))
        started = time.perf_counter()
        try:
            outcomes, timing = self.target.verify(
                prepared.mixed, specs, timeout=self._group_timeout(self._handles(seqs)))
        except Exception as error:  # answered on the engine thread, by _finish
            return error
        return specs, outcomes, timing, time.perf_counter() - started

    def _finish(self, prepared: "Prepared", verified) -> None:
        """Commit a verified group (on the engine thread)."""
        if isinstance(verified, errors.Unavailable):
            self._target_lost(verified)
            return
        if isinstance(verified, errors.DeadlineExceeded):
            return  # the rows' deadlines passed while queued: _reap ends them next step
        if isinstance(verified, Exception):
            raise verified  # _isolated ends this group's requests
        specs, outcomes, timing, verify_s = verified
        width = max(len(spec.draft_token_ids) for spec in specs)
        if self._policy.calibrated:
            self._policy.target.observe([(len(specs), 1 + width)], timing.forward_seconds,
                                        verify_s)
        self._count_step(prepared.mixed, not self.draft_up, not prepared.proposals,
                         prepared.draft_timing, timing, prepared.draft_s, verify_s)
        finished = []
        for seq, spec, outcome in zip(prepared.seqs, specs, outcomes):
            kind = prepared.kinds[seq.seq_id]
            proposal = prepared.proposals.get(seq.seq_id, NO_PROPOSAL)
            if self._commit(seq, outcome, len(spec.draft_token_ids), kind, proposal):
                finished.append(seq)
        self._release(finished)

    def _plan(self, seqs: list[Sequence], drafted=None, called=(),
              offered=None) -> goodput.Plan:
        """Each row's draft kind and tokens to draft this step (0: none), by the policy.
        A sampled row always drafts K with the first reachable kind, so a seeded request's
        tokens depend on nothing but the request (while its draft stays up).
        drafted: {row: (kind, k)} already proposed this step (kept as they are); called: the
        kinds already asked this step (not asked again); offered: {row: {kind: tokens}} that
        kinds asked before planning proposed (a choice whose cost is paid)."""
        if self._policy is None:
            self._configure()
        max_k = self.config.num_draft_tokens
        up = [kind for kind in self.kinds if kind.up]
        if not up:
            return goodput.Plan([0] * len(seqs), 0.0, [None] * len(seqs))
        drafted, offered = drafted or {}, offered or {}
        rows = []
        for i, s in enumerate(seqs):
            choices = [None] * len(self.kinds)
            for kind in up:
                state = s.drafts[kind.index]
                tokens = offered.get(i, {}).get(kind.index)
                if not (i in drafted or kind.index not in called or tokens):
                    continue
                # a cold row (the draft holds nothing of it) is prefilled there if picked
                choice = self._policy.choice(state.spec, s.draft_append_need(kind.index),
                                             kind.index, cold=state.cache_len is None,
                                             prefill=s.committed_len - 1)
                choices[kind.index] = dataclasses.replace(choice, offered=tokens) \
                    if tokens else choice
            forced_k, forced_kind = (None if s.sampling.greedy else max_k), up[0].index
            if i in drafted:
                forced_kind, forced_k = drafted[i]
            rows.append(goodput.Row(choices=tuple(choices), forced_k=forced_k,
                                    forced_kind=forced_kind))
        plan = self._policy.plan(rows)
        kinds = [plan.kind(i) for i in range(len(seqs))]
        # a kind not offered for the row (not reachable, asked already) cannot draft for it
        kinds = [d if d is not None and rows[i].choices[d] is not None else None
                 for i, d in enumerate(kinds)]
        return goodput.Plan([n if d is not None else 0 for n, d in zip(plan.k, kinds)],
                            plan.tokens_per_s, kinds)

    def _group_timeout(self, handles) -> float | None:
        """How long a group's commands may wait in a service: until the last row's deadline
        (None when a row has none). A row whose deadline passes mid-step is ended after the
        step, so one request's short deadline never costs its group mates a step."""
        deadlines = [h.deadline for h in handles]
        if not deadlines or None in deadlines:
            return None
        return max(0.001, max(deadlines) - time.monotonic())

    def _propose(self, kind: DraftKind, seqs: list[Sequence], num_drafts: int,
                 timeout: float | None):
        """({seq_id: (draft_token_ids, draft_probs, drafted, cache_len)}, timing, round-trip
        seconds) for the rows that can draft together with `kind`; ({}, None, 0) when none
        can or its service is down. `drafted` is what the service drafted (and cached, but
        the last) for the row, which may be more than the row verifies (or fewer: the n-gram
        draft proposes only what it finds); cache_len its draft cache length after."""
        if not kind.up or not num_drafts:
            return {}, None, 0.0
        ready = [s for s in seqs if s.drafts[kind.index].cache_len is not None]
        rows, width = scheduler.draft_plan(ready, kind.index) if ready else ([], 0)
        if not rows:
            return {}, None, 0.0
        specs = [ProposeSpec(s.seq_id, s.drafts[kind.index].cache_len, s.committed_len - width,
                             s.token_ids[s.committed_len - width:], s.sampling) for s in rows]
        mixed = len({s.committed_len for s in rows}) > 1
        started = time.perf_counter()
        try:
            proposals, timing = kind.client.propose(
                num_drafts, mixed, specs, timeout=timeout,
                min_confidence=self.config.min_draft_confidence)
        except errors.Unavailable as error:
            self._draft_lost(kind, error)
            return {}, None, 0.0
        except errors.DeadlineExceeded:
            return {}, None, 0.0
        round_trip = time.perf_counter() - started
        for seq, proposal in zip(rows, proposals):
            seq.drafts[kind.index].cache_len = proposal.cache_len
            if proposal.probs_bytes:
                self.stats.num_sampled_rows += 1
                self.stats.num_draft_probs_bytes += proposal.probs_bytes
        if kind.cost is not None and self._policy.calibrated:
            drafted = max(len(p.draft_token_ids) for p in proposals)
            kind.cost.observe(goodput.draft_calls(len(rows), width, drafted),
                              timing.forward_seconds, round_trip)
        return ({p.seq_id: (p.draft_token_ids, p.draft_probs, len(p.draft_token_ids),
                            p.cache_len) for p in proposals}, timing, round_trip)

    def _commit(self, seq: Sequence, outcome, num_drafts: int, kind: int | None,
                proposal) -> bool:
        """Apply one verification to its sequence; True when the sequence finished.
        num_drafts: drafts the row verified; kind: the draft kind planned for it (None: none);
        proposal: what that kind answered (NO_PROPOSAL: nothing arrived)."""
        before = seq.committed_len
        if outcome.seq_id != seq.seq_id or outcome.cache_len != before + outcome.num_accepted:
            raise errors.FailedPrecondition(
                f"target answered seq {outcome.seq_id} with cache {outcome.cache_len}; expected "
                f"seq {seq.seq_id} with {before + outcome.num_accepted}")
        seq.target.cache_len = outcome.cache_len
        _, _, drafted, cache_len = proposal
        answered = kind is not None and cache_len is not None
        if answered and cache_len == seq.drafts[kind].cache_len and drafted:
            # The draft cached committed[:before] and drafts 1..D-1 (D = drafted); those up to
            # the first rejection are now committed (a row verifies at most D of them). A
            # draft lost or re-prefilled since holds none of them (its cache_len moved on).
            seq.drafts[kind].valid_len = before + min(outcome.num_accepted, drafted - 1)
        for d, state in enumerate(seq.drafts):
            if d != kind:
                self._policy.observe(state.spec, 0, 0, d)  # not asked: its evidence fades
            elif answered:
                # a kind that found nothing to propose is as good as one rejected at once
                self._policy.observe(state.spec, max(num_drafts, 1), outcome.num_accepted, d)
        seq.stats.num_drafted_tokens += num_drafts
        seq.stats.num_accepted_tokens += outcome.num_accepted
        seq.stats.num_target_forward_passes += 1
        seq.last_step = self.stats.num_steps
        committed = seq.commit(outcome.output_token_ids)
        accepted = min(outcome.num_accepted, len(committed))
        draft_text = self._text(seq, committed[:accepted], last=False) if accepted else ""
        text = draft_text + self._text(seq, committed[accepted:])
        handle = self._active[seq.seq_id]
        self.telemetry.committed(handle, len(committed), num_drafts, outcome.num_accepted)
        handle.events.put(Event(committed, finish=seq.finish, text=text, num_drafted=num_drafts,
                                num_accepted=accepted, draft_text=draft_text))
        if seq.finish is not None:
            self.telemetry.finished(handle)
        return seq.finish is not None

    @staticmethod
    def _text(seq: Sequence, committed: list[int], last: bool = True) -> str:
        """The text of newly committed tokens (O(new tokens)); a stop string ends the
        sequence, and the end of a sequence sends the text held back until then (on the
        step's last call: `last`)."""
        if seq.text is None:
            return ""
        text = seq.text.feed(committed)
        if seq.text.stopped:
            seq.finish = seq.finish or Finish.STOP_STRING
        elif seq.finish is not None and last:
            text += seq.text.flush()
        return text

    def _count_step(self, mixed: bool, fallback: bool, plain: bool, draft_timing,
                    timing, draft_s: float, verify_s: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        if plain and not fallback:
            stats.num_plain_steps += 1
        if mixed:
            stats.num_realigned_steps += 1
        else:
            stats.num_grouped_steps += 1
        if fallback:
            stats.num_draft_fallback_steps += 1
        realign_s = timing.realign_seconds + (draft_timing.realign_seconds if draft_timing else 0)
        stats.draft_seconds += draft_s
        stats.verify_seconds += verify_s
        stats.verify_compute_seconds += timing.compute_seconds
        stats.draft_compute_seconds += draft_timing.compute_seconds if draft_timing else 0.0
        stats.realign_seconds += realign_s
        self.telemetry.step(mixed, fallback, draft_s if draft_timing else None, verify_s,
                            realign_s)

    # ---- endings and releases -----------------------------------------------------------------
    def _release(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        for seq in seqs:
            self._active.pop(seq.seq_id, None)
        if self._target_up:
            self._release_in(self.target, [s for s in seqs if s.target.cache_len is not None])
        self._release_drafts(seqs)

    def _release_drafts(self, seqs: list[Sequence]) -> None:
        for kind in self.kinds:
            if kind.up:
                self._release_in(kind.client, [s for s in seqs
                                               if s.drafts[kind.index].cache_len is not None])

    def _release_in(self, client, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        try:
            client.release([s.seq_id for s in seqs])
        except errors.Unavailable as error:
            log.warning("release on %s failed (%s); retried when it answers again",
                        client.address, error)
            self._mark_stale(client, seqs)

    def _mark_stale(self, client, seqs: list[Sequence]) -> None:
        self._stale.setdefault(client.address, set()).update(s.seq_id for s in seqs)

    # ---- lost services ------------------------------------------------------------------------
    def _draft_lost(self, kind: DraftKind, error) -> None:
        log.warning("draft %s (%s) lost (%s): decoding %s", kind.client.address, kind.name,
                    error, "with the other drafts" if self.draft_up else "with the target alone")
        kind.up = False
        self.on_health(self._target_up)
        self._lost(kind.client, lambda seq: seq.drafts[kind.index])

    def _target_lost(self, error) -> None:
        self._prepared = None
        self._target_up = False
        self.on_health(False)
        self._lost(self.target, lambda seq: seq.target)
        if self._hand_off():
            log.warning("target %s lost (%s): its requests moved to other replicas",
                        self.target.address, error)
        else:
            log.warning("target %s lost (%s): requests wait for it", self.target.address, error)

    def _lost(self, client, cache_of) -> None:
        """What losing any service means. Its stream is dropped; what it may still hold of
        ours is stale (released when it is back); every sequence must be prefilled there again
        (cache_of(seq) is the sequence's record of that service's cache); a retry is due."""
        client.reset()
        seqs = [h.seq for h in self._active.values()]
        self._mark_stale(client, [s for s in seqs if cache_of(s).cache_len is not None])
        for seq in seqs:
            cache_of(seq).forget()
        self._schedule_retry()

    def _hand_off(self) -> bool:
        """Give every request to other engines, if there are any to take them."""
        with self._lock:
            handles = list(self._active.values()) + self._waiting
        if not handles or self.handoff is None:
            return False
        # Drafts may be shared with the adopting engines (one n-gram draft for every target
        # replica): release ours before another engine can prefill the same ids there.
        active = [h.seq for h in self._active.values()]
        self._release_drafts(active)
        for seq in active:
            for state in seq.drafts:
                state.forget()
        if not self.handoff(self, handles):
            return False  # nobody took them: they wait here (drafts refilled on first use)
        with self._lock:
            self._active.clear()
            self._waiting = [h for h in self._waiting if h not in handles]
        return True

    def _schedule_retry(self) -> None:
        self._next_retry = time.monotonic() + self._retry_delay
        self._retry_delay = min(self._retry_delay * 2, self.config.reconnect_backoff_s[1])

    def _all_up(self) -> bool:
        return self._target_up and all(kind.up for kind in self.kinds)

    def _ensure_services(self) -> bool:
        """Reconnect lost services when their retry is due; True when the target is usable."""
        if self._all_up() or time.monotonic() < self._next_retry:
            return self._target_up
        if not self._target_up:
            self._target_up = self._reconnect(self.target, self._resync_target)
            if self._target_up:
                self.on_health(True)
        for kind in self.kinds:
            if not kind.up:
                kind.up = self._reconnect_draft(kind)
        if self._all_up():
            self._retry_delay = self.config.reconnect_backoff_s[0]
        else:
            self._schedule_retry()
        return self._target_up

    def _reconnect_draft(self, kind: DraftKind) -> bool:
        """Try the kind's replicas in turn, starting with the current one."""
        for _ in range(len(kind.replicas)):
            # nothing to refill now: every row is cold there and prefilled when next picked
            if self._reconnect(kind.client, lambda: None):
                return True
            kind.next_replica()
        return False

    def _reconnect(self, client, resync) -> bool:
        info = self._probe_answer(client)
        if info is None:
            return False
        try:
            client.reset()
            if info.num_sequences:
                self._forget_stale(client, self._stale.get(client.address, set())
                                   | set(self._active))
            self._stale.pop(client.address, None)
            resync()
        except errors.Unavailable as error:
            log.info("%s still unavailable: %s", client.address, error)
            client.reset()
            return False
        log.info("%s is back: caches refilled from the coordinator's record", client.address)
        return True

    def _probe_answer(self, client) -> ModelInfo | None:
        """The service's ModelInfo once a probe found it taking commands again; else None,
        with a probe in flight (a new one when the last went unanswered). gRPC carries the
        probes, so a hung service cannot stall decoding while we wait."""
        probe = self._probes.get(client.address)
        if probe is not None and not probe.done():
            return None
        info = self._probes.pop(client.address).info() if probe is not None else None
        if info is None:
            self._probes[client.address] = client.probe()
        return info

    def _forget_stale(self, client, seq_ids: set[int]) -> None:
        """The service kept running while its stream broke: drop what it still holds of
        ours (finished, cancelled or active sequences), since the record here is the truth.
        One command for all of them; a release is all-or-nothing, so if some are gone
        already, the rest go one by one."""
        if not seq_ids:
            return
        try:
            client.release(sorted(seq_ids))
            return
        except errors.NotFound:
            pass
        for seq_id in sorted(seq_ids):
            try:
                client.release([seq_id])
            except errors.NotFound:
                pass

    def _resync_target(self) -> None:
        seqs = [h.seq for h in self._active.values()]
        self._prefill_in_runs(self.target, seqs)
        for s in seqs:
            s.target.cache_len = s.committed_len - 1

    def _prefill_in_runs(self, client, seqs: list[Sequence]) -> None:
        """Re-prefill from the committed record, one bounded command per run. If a run fails,
        those before it stay cached there: the next reconnection releases them first."""
        for run in scheduler.split_by_tokens(seqs, self.config.max_prefill_tokens):
            client.prefill([s.prefill_entry() for s in run])
