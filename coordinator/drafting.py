"""The drafting part of a step: the drafting policy's plan for a cohort (coordinator/policy.py),
carried out by calling the draft services, as a typed `DraftedCohort` for the step loop to
verify.

The policy asks the lookups due (drafts that cost next to nothing) for every row before it
plans, through `_ask`; what they offer costs nothing more to verify. The other kinds are
called for the rows planned with them, cheapest first; a row a kind proposes nothing for
drafts with its fallback (StepPlan.fallback) or else decodes plainly this step, and that miss
counts as a draft rejected at once (unless a confidence cut made it). After the verify,
`observe` moves each draft's record of its valid cache and feeds each row's outcome back to the
policy.

A draft the target hosts (its replica is the target's instance) is not called: its propose
rides in the verify command (`Deferred`), runs there first, and its rows verify what it
proposed. Its answer arrives with the verify's and `resolve` books it as a call's would be
booked; its rows have no fallback within the step, and rows under a grammar are called as
before (their drafts are cut to the grammar before the verify).
"""
import dataclasses
import functools
import logging
import operator
import time
from collections.abc import Callable

from batchspec import errors
from coordinator import clients, features, goodput, scheduler
from coordinator.clients import Proposal, ProposeSpec, Timing, VerifyOutcome
from coordinator.drafts import DraftKind
from coordinator.peers import Peers
from coordinator.policy import CohortRow, DraftingPolicy, StepPlan
from coordinator.sequence import Sequence, mixed
from coordinator.stats import Recorder

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowDraft:
    """One row of a drafted cohort: what it verifies this step."""

    seq: Sequence
    num_drafts: int = 0  # drafts it verifies (0: plain decoding)
    # the kind it drafts with, or whose miss it records (None: no kind was asked for it)
    kind_index: int | None = None
    proposal: Proposal | None = None  # what that kind answered (None: nothing arrived)
    # structured output: the masks of the positions it outputs from, and the grammar's
    # forced tokens it verifies after its own drafts (see DraftedCohort.constrained)
    token_masks: tuple[bytes, ...] = ()
    forced: tuple[int, ...] = ()
    aside: bool = False  # its cohort stepped aside: no plan was made for it, or lookups' only
    # it verifies what the target's hosted draft proposes first, up to num_drafts (proposal:
    # None until resolved)
    deferred: bool = False
    # its drafts are a lookup's line, asked long enough for the rounds of a command: what
    # follows them is its `continuation`
    lined: bool = False

    @property
    def draft_token_ids(self) -> list[int]:
        own = self.proposal.draft_token_ids[:self.num_drafts] if self.proposal else []
        return own + list(self.forced)

    @property
    def continuation(self) -> list[int]:
        """What a lined row's lookup goes on with after its drafts (VerifySpec.continuation);
        [] for other rows."""
        if not self.lined or not self.num_drafts or self.forced or self.proposal is None:
            return []
        return self.proposal.draft_token_ids[self.num_drafts:]

    def drafts_verified(self, outcome: VerifyOutcome) -> int:
        """The drafts its verify weighed: every round's, for a verify of rounds."""
        return sum(d for d, _ in outcome.rounds) if outcome.rounds \
            else len(self.draft_token_ids)

    def traced(self, outcome: VerifyOutcome, committed: int) -> tuple:
        """The step log's account: (kind or None, drafts verified, accepted, committed), a
        verify of rounds' drafts those of every round. A confidence cut may leave a row fewer
        drafts than planned, or none."""
        verified = self.drafts_verified(outcome)
        return self.kind_index if verified else None, verified, outcome.num_accepted, committed


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A kind's propose that runs in the target, by the draft it hosts, before the verify."""

    kind: DraftKind
    seqs: list[Sequence]  # the rows it proposes for, in command order
    specs: list[ProposeSpec]
    num_drafts: int
    cut: float  # its min_draft_confidence

    def command(self):
        return clients.propose_command(self.num_drafts, mixed(self.seqs), self.specs, self.cut)


@dataclasses.dataclass(frozen=True)
class DraftedCohort:
    """A cohort whose drafts are ready to verify (or, for its deferred rows, to propose in the
    verify)."""

    rows: list[RowDraft]
    timing: Timing | None = None  # the draft services' own account, summed; None: no call
    round_trip_s: float = 0.0  # coordinator-side, every draft call of the step
    deferred: Deferred | None = None
    # stepped aside: tokens a row its command may decode before the evidence's next probe
    # (StepPlan.room); None: no such bound
    room: int | None = None
    aside_lookups: bool = False  # stepped aside, its rows draft lookups' offers only

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def mixed(self) -> bool:
        return mixed(self.seqs)

    @property
    def plain(self) -> bool:
        """No row has a proposal or awaits one: no draft answered for any row (the step
        record's `plain`). Whether the step verifies a draft: verifies_no_draft."""
        return all(row.proposal is None and not row.deferred for row in self.rows)

    @property
    def verifies_no_draft(self) -> bool:
        """No row verifies a draft or awaits one, though drafts may have been asked (and
        proposed nothing, or what the plan did not take)."""
        return all(not row.draft_token_ids and not row.deferred for row in self.rows)

    def constrained(self, k: int) -> "DraftedCohort":
        """The cohort with each constrained row's output masks, taken at its committed
        tokens. A row's draft is cut before the first token its grammar forbids (the target
        never chooses it) and filled up to k drafts with the grammar's forced tokens (a JSON
        schema's keys and punctuation: the only token the target can choose there, greedy
        or sampled)."""
        if all(row.seq.constraint is None for row in self.rows):
            return self
        rows = []
        for row in self.rows:
            constraint = row.seq.constraint
            if constraint is not None:
                room = min(k, row.seq.draft_room)  # forced tokens past its end: for nothing
                masks, allowed, forced = constraint.cut(row.draft_token_ids,
                                                        max(0, room - row.num_drafts))
                row = dataclasses.replace(row, num_drafts=min(row.num_drafts, allowed),
                                          forced=tuple(forced), token_masks=tuple(masks))
            rows.append(row)
        return dataclasses.replace(self, rows=rows)

    def kept_aside(self, room: int | None) -> "DraftedCohort":
        """The cohort drafted while stepped aside (StepPlan.aside_lookups): the evidence, not
        the plan, kept its rows from every other kind."""
        return dataclasses.replace(self, aside_lookups=True, room=room, rows=[
            dataclasses.replace(row, aside=True) for row in self.rows])

    def still_open(self, active) -> "DraftedCohort | None":
        """The cohort less the rows that ended since (not in `active`); None if none is left."""
        rows = [row for row in self.rows if row.seq.seq_id in active]
        if not rows:
            return None
        deferred = self.deferred
        if deferred is not None:  # the propose keeps only rows still verified
            kept = [(s, spec) for s, spec in zip(deferred.seqs, deferred.specs)
                    if s.seq_id in active]
            deferred = dataclasses.replace(deferred, seqs=[s for s, _ in kept],
                                           specs=[spec for _, spec in kept]) if kept else None
            rows = [row if deferred is not None or not row.deferred
                    else dataclasses.replace(row, num_drafts=0, deferred=False) for row in rows]
        return dataclasses.replace(self, rows=rows, deferred=deferred)


@dataclasses.dataclass
class _Step:
    """One step's drafting in progress, every map keyed by row index."""

    seqs: list[Sequence]
    # kind index -> row -> what the kind, asked before planning, offered (non-empty only)
    offers: dict[int, dict[int, Proposal]] = dataclasses.field(default_factory=dict)
    # row -> (kind index, drafts it verifies), for rows that have their drafts
    drafted: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    missed: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> kind: nothing
    # (row, kind index) of those misses that a confidence cut made: not rejections
    declined: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # row -> the latest answer a call planned for it gave (empty ones too)
    answers: dict[int, Proposal] = dataclasses.field(default_factory=dict)
    # (the service's own timing, round-trip seconds) of each draft call
    spent: list[tuple[Timing, float]] = dataclasses.field(default_factory=list)
    deferred: Deferred | None = None  # the propose the target's hosted draft runs
    later: dict[int, int] = dataclasses.field(default_factory=dict)  # its rows -> drafts
    lined: set[int] = dataclasses.field(default_factory=set)  # rows drafting a lookup's line
    # kinds asked before planning for lines (lookups: DraftKind.lookup), by index
    line_kinds: set[int] = dataclasses.field(default_factory=set)

    def result(self) -> DraftedCohort:
        asked = dict(self.missed)  # each row's kind to observe: its drafts' or its miss's
        asked.update((i, index) for i, (index, _) in self.drafted.items())
        if self.deferred is not None:
            asked.update((i, self.deferred.kind.index) for i in self.later)
        rows = [RowDraft(seq, self.drafted[i][1] if i in self.drafted
                         else self.later.get(i, 0), asked.get(i), self.answers.get(i),
                         deferred=i in self.later, lined=i in self.lined)
                for i, seq in enumerate(self.seqs)]
        timing = functools.reduce(operator.add, (t for t, _ in self.spent)) \
            if self.spent else None
        return DraftedCohort(rows, timing, sum(s for _, s in self.spent), self.deferred)


def sampled(seqs: list[Sequence]) -> bool:
    """Whether a cohort has a sampled row: its evidence is kept apart from greedy cohorts'."""
    return not all(s.sampling.greedy for s in seqs)


# the draft kinds (by model) that refused rows: each logged once
_REFUSALS: set[str] = set()


def refuse(kind: DraftKind, seqs: list[Sequence], error) -> None:
    """Draft `kind` refused these rows' tokens (token ids outside its vocabulary, a context
    longer than its own): they decode without it from now on, and whatever a failed command
    left of them there is released. Logged once per kind."""
    if kind.name not in _REFUSALS:
        _REFUSALS.add(kind.name)
        log.warning("draft %s (%s) refused a command (%s): rows it cannot take decode without "
                    "it; a draft must share the target's vocabulary and context",
                    kind.client.address, kind.name, error)
    for s in seqs:
        s.drafts[kind.index].refused = True
    try:
        kind.client.release([s.seq_id for s in seqs])
    except errors.BatchspecError:
        pass  # none of them was cached there


def propose_specs(kind: DraftKind, seqs: list[Sequence], width: int) -> list[ProposeSpec]:
    """Each row's propose entry: it appends its last `width` committed tokens."""
    return [ProposeSpec(s.seq_id, s.drafts[kind.index].cache_len, s.committed_len - width,
                        s.token_ids[s.committed_len - width:], s.sampling,
                        s.features.fed_with(s.committed_len - width, s.committed_len)
                        if kind.reads_features else None) for s in seqs]


def take_offer(step: _Step, i: int, index: int | None, k: int) -> None:
    """Row i drafts with what kind `index`, asked before planning, offered it (if it did): a
    lookup's, a line (see Drafter._ask)."""
    if index in step.offers and i in step.offers[index]:
        step.drafted[i] = (index, k)
        step.answers[i] = step.offers[index][i]
        if index in step.line_kinds:
            step.lined.add(i)


class Drafter:
    def __init__(self, peers: Peers, policy: DraftingPolicy, recorder: Recorder,
                 quiet: Callable[[], bool] = lambda: True):
        """quiet: whether no request waits or is part-fed, so a command may run rounds (a
        lookup is then asked for lines: _line)."""
        self.peers = peers
        self.policy = policy
        self.recorder = recorder
        self.quiet = quiet

    @property
    def kinds(self) -> list[DraftKind]:
        return self.peers.kinds

    def calibrate(self, target, infos) -> None:
        """The policy starts from what each service measured of its forwards at start-up."""
        self.policy.calibrate(target, infos,
                              frozenset(kind.index for kind in self.kinds if self.hosted(kind)),
                              frozenset(kind.index for kind in self.kinds if kind.lookup))

    # ---- a step's drafts ------------------------------------------------------------------------
    def draft(self, seqs: list[Sequence], timeout: float | None) -> DraftedCohort:
        """The policy's plan for the cohort, carried out: the lookups it asked first give
        what they offered, the other kinds are called for their rows, cheapest first. A
        cohort stepped aside decodes plainly and no draft is asked."""
        step = _Step(seqs)
        plan = self.policy.plan(self.cohort_rows(seqs),
                                lambda index: self._ask(step, index, timeout))
        if plan.aside:
            return DraftedCohort([RowDraft(seq, aside=True) for seq in seqs], room=plan.room)
        for i in range(len(seqs)):
            take_offer(step, i, plan.kind(i), plan.k[i])
        for kind in sorted(self.kinds, key=lambda kind: self.policy.kinds[kind.index].unit_cost):
            rows = [i for i in range(len(seqs)) if i not in step.drafted and kind.index == (
                plan.fallback[i] if i in step.missed else plan.kind(i))]
            if rows and step.deferred is None and self.hosted(kind):
                later = [i for i in rows if seqs[i].constraint is None]
                self._defer(kind, step, later, plan, timeout)
                rows = [i for i in rows if i not in later]
            if rows:
                self._call(kind, step, rows, plan, timeout)
            for i in [i for i in step.missed if i not in step.drafted]:
                take_offer(step, i, plan.fallback[i], plan.k[i])
        for i in step.missed:
            if i in step.drafted:  # it drafted with its fallback: its miss is evidence too
                self._observe_miss(step, i)
        return step.result().kept_aside(plan.room) if plan.aside_lookups else step.result()

    def cohort_rows(self, seqs: list[Sequence]) -> list[CohortRow]:
        """The cohort as the policy sees it."""
        return [CohortRow(
            s.seq_id, goodput.sampling_band(s.sampling),
            tuple(s.draft_append_need(kind.index)
                  if kind.up and not s.drafts[kind.index].refused else None
                  for kind in self.kinds),
            tuple(s.drafts[kind.index].cache_len is None for kind in self.kinds),
            s.committed_len - 1, s.draft_room) for s in seqs]

    def _ask(self, step: _Step, index: int, timeout: float | None) -> dict[int, int]:
        """Ask kind `index` for every row before planning: {row: tokens it offers} (at most
        K). A lookup, with rounds (--draft-rounds), for a line of as many tokens as a
        command's rounds can verify: the K a row drafts, then its continuation
        (RowDraft.continuation). A model's drafts carry the distributions they were drawn
        from, a line none, so a model asked first drafts K."""
        k, kind = self.policy.config.num_draft_tokens, self.kinds[index]
        if kind.lookup:
            step.line_kinds.add(index)
        got = self._propose(kind, step, range(len(step.seqs)),
                            self._line(k) if kind.lookup else k, timeout)
        step.offers[index] = {i: p for i, p in got.items() if p.draft_token_ids}
        return {i: min(k, len(p.draft_token_ids)) for i, p in step.offers[index].items()}

    def _line(self, k: int) -> int:
        """How many tokens a lookup is asked for where its rows draft k a round: what a
        command's rounds verify at most (--draft-rounds of k drafts and one more token); k
        where the command cannot run rounds (a request waits), since a lookup indexes what it
        proposes until the next step rolls it back."""
        rounds = self.policy.config.draft_rounds if self.quiet() else 1
        return k + (rounds - 1) * (k + 1)

    def _call(self, kind: DraftKind, step: _Step, rows: list[int], plan: StepPlan,
              timeout: float | None) -> None:
        """Call `kind` for the rows planned with it (the n-gram lookup for lines: _line)."""
        lookup = kind.lookup
        k = max(plan.k[i] for i in rows)
        got = self._propose(kind, step, rows, self._line(k) if lookup else k, timeout)
        step.answers.update(got)
        for i in rows:
            if i in got and got[i].draft_token_ids:
                step.drafted[i] = (kind.index, plan.k[i])
                if lookup:
                    step.lined.add(i)
                continue
            self._observe_miss(step, i)  # an earlier one: the row's last is observed later
            step.missed[i] = kind.index
            if i in got and got[i].cut:
                step.declined.add((i, kind.index))

    def hosted(self, kind: DraftKind) -> bool:
        """Whether `kind`'s replica is the target's own instance: a draft the target hosts."""
        instance = getattr(kind.client, "instance", None)
        return kind.up and bool(instance) and \
            instance == getattr(self.peers.target, "instance", None)

    def _defer(self, kind: DraftKind, step: _Step, rows: list[int], plan: StepPlan,
               timeout: float | None) -> None:
        """Rows planned with the target's hosted draft: their propose goes in the verify
        (step.deferred); a row that cannot draft with it this step misses at once."""
        num_drafts = max((plan.k[i] for i in rows), default=0)
        ready = self._ready(kind, step, rows, num_drafts, timeout)
        if ready:
            seqs, width = ready
            row_of = {step.seqs[i].seq_id: i for i in rows}
            step.later = {row_of[s.seq_id]: plan.k[row_of[s.seq_id]] for s in seqs}
            step.deferred = Deferred(kind, seqs, propose_specs(kind, seqs, width), num_drafts,
                                     self.policy.cut_at(kind.index, len(step.seqs), len(seqs),
                                                        num_drafts))
        for i in rows:
            if i not in step.later:
                self._observe_miss(step, i)
                step.missed[i] = kind.index

    def resolve(self, cohort: DraftedCohort, hosted, rounds: int = 1) -> DraftedCohort:
        """The cohort as drafted, once the verify brought the hosted draft's answer
        (clients.Hosted; None: the verify carried no propose): each deferred row's proposal
        booked as a call's would be (the draft's record of its cache, the cost model, a miss
        as evidence). A refused propose is handled as a refused call: its rows verified no
        drafts. rounds: the rounds the verify ran (the proposal is the last round's; the cost
        model is given one round's time)."""
        deferred = cohort.deferred
        if deferred is None or hosted is None:
            return cohort
        kind, seqs = deferred.kind, deferred.seqs
        error = hosted.error
        if isinstance(error, errors.Unavailable):
            self.peers.draft_lost(kind, error)
        elif error is not None and not isinstance(error, errors.DeadlineExceeded):
            refuse(kind, seqs, error)  # its rows decode without it from now on
        got = {p.seq_id: p for p in hosted.proposals}
        for seq in seqs:
            if seq.seq_id in got:
                seq.drafts[kind.index].cache_len = got[seq.seq_id].cache_len
        if got:
            one = Timing(*(t / rounds for t in dataclasses.astuple(hosted.timing)))
            self._observe_call(kind, seqs, list(got.values()), deferred.specs, one,
                               one.compute_seconds)
        rows = []
        for row in cohort.rows:
            if row.deferred:
                proposal = got.get(row.seq.seq_id)
                drafted = proposal is not None and bool(proposal.draft_token_ids)
                if drafted and not row.seq.sampling.greedy:
                    self.recorder.sampled_row()
                if not drafted and not (proposal is not None and proposal.cut):
                    self.policy.observe_miss(row.seq.seq_id,
                                             goodput.sampling_band(row.seq.sampling),
                                             kind.index)
                row = dataclasses.replace(row, proposal=proposal,
                                          num_drafts=row.num_drafts if drafted else 0)
            rows.append(row)
        timing = hosted.timing if cohort.timing is None else cohort.timing + hosted.timing
        # its time is the draft's compute in the target: no round trip of its own
        return dataclasses.replace(cohort, rows=rows, timing=timing, deferred=None,
                                   round_trip_s=cohort.round_trip_s
                                   + hosted.timing.compute_seconds)

    def _observe_miss(self, step: _Step, i: int) -> None:
        """Row i's miss, if it has one, as evidence: a draft rejected at once, unless a
        confidence cut made it (a draft that declined is no rejection)."""
        index = step.missed.get(i)
        if index is not None and (i, index) not in step.declined:
            seq = step.seqs[i]
            self.policy.observe_miss(seq.seq_id, goodput.sampling_band(seq.sampling), index)

    def _propose(self, kind: DraftKind, step: _Step, rows, num_drafts: int,
                 timeout: float | None) -> dict[int, Proposal]:
        """{row: Proposal} from `kind` for those of `rows` that can draft together (a row
        the draft holds nothing of is prefilled first); {} when none can or the service is
        lost. A proposal's tokens are what the service drafted (and cached, but the last),
        which may be more than the row verifies (or fewer: a lookup proposes what it finds)."""
        ready = self._ready(kind, step, rows, num_drafts, timeout)
        if not ready:
            return {}
        ready, width = ready
        try:
            proposals, timing, round_trip = self._send(
                kind, ready, width, num_drafts, timeout,
                self.policy.cut_at(kind.index, len(step.seqs), len(ready), num_drafts))
        except errors.Unavailable as error:
            self.peers.draft_lost(kind, error)
            return {}
        except errors.DeadlineExceeded:
            return {}
        except errors.InvalidArgument as error:
            refuse(kind, ready, error)
            return {}
        step.spent.append((timing, round_trip))
        for seq, proposal in zip(ready, proposals):
            seq.drafts[kind.index].cache_len = proposal.cache_len
            if proposal.draft_token_ids and not seq.sampling.greedy:
                self.recorder.sampled_row()
        row_of = {step.seqs[i].seq_id: i for i in rows}
        return {row_of[p.seq_id]: p for p in proposals}

    def _ready(self, kind: DraftKind, step: _Step, rows, num_drafts: int,
               timeout: float | None) -> tuple[list[Sequence], int] | None:
        """(the rows of `rows` that can draft with `kind` together, the committed tokens each
        appends) once the draft holds them all (cold rows prefilled, with the target's
        features for a head that reads them); None when none can or the draft is lost."""
        seqs = [step.seqs[i] for i in rows if not step.seqs[i].drafts[kind.index].refused]
        try:
            if not seqs or not self.peers.warm(kind, seqs) or not num_drafts:
                return None
            ready, width = scheduler.draft_plan(seqs, kind.index)
            if not ready or (kind.reads_features
                             and not features.ensure(self.peers.target, ready)):
                return None
        except errors.Unavailable as error:
            self.peers.draft_lost(kind, error)
            return None
        except errors.DeadlineExceeded:
            return None
        except errors.InvalidArgument as error:
            refuse(kind, seqs, error)
            return None
        return ready, width

    def _send(self, kind: DraftKind, seqs: list[Sequence], width: int, num_drafts: int,
              timeout: float | None, cut: float = 0.0) -> tuple[list[Proposal], Timing, float]:
        """One propose command; every row appends `width` committed tokens first, and each
        row's draft is cut where the draft's confidence falls below `cut`."""
        specs = propose_specs(kind, seqs, width)
        started = time.perf_counter()
        proposals, timing = kind.client.propose(
            num_drafts, mixed(seqs), specs, timeout=timeout, min_confidence=cut)
        round_trip = time.perf_counter() - started
        self._observe_call(kind, seqs, proposals, specs, timing, round_trip)
        return proposals, timing, round_trip

    def _observe_call(self, kind: DraftKind, seqs: list[Sequence], proposals: list[Proposal],
                      specs: list[ProposeSpec], timing: Timing, round_trip: float) -> None:
        """A propose's measured cost, for the policy's cost model of `kind`."""
        drafted = max((len(p.draft_token_ids) for p in proposals), default=0)
        if any(p.cut for p in proposals):  # a cut returns fewer drafts than it ran forwards
            drafted = max(p.cache_len - s.committed_len + 1 for s, p in zip(seqs, proposals))
        width = len(specs[0].append_token_ids) if specs else 0
        self.policy.observe_call(kind.index, len(seqs), width, drafted, timing.forward_seconds,
                                 round_trip)

    # ---- after the verify -----------------------------------------------------------------------
    def observe_verify(self, cohort: DraftedCohort, timing: Timing, seconds: float,
                       plain_steps: int = 1) -> None:
        """The target's measured cost of verifying the cohort. The cost model prices one
        forward a command: a command of several plain steps counts as one of its forwards
        (the mean of them) with the whole command's overhead beside it. (Left out, its plain
        forwards went unmeasured during a stretch of them, and the planner spent the step the
        evidence gave drafting on measuring a plain one.)"""
        forward = timing.forward_seconds / max(1, plain_steps)
        self.policy.observe_verify([len(row.draft_token_ids) for row in cohort.rows], forward,
                                   seconds - timing.forward_seconds + forward)

    def observe_step(self, cohort: DraftedCohort, num_committed: int, seconds: float,
                     verify_timing: Timing | None = None, plain_steps: int = 1) -> None:
        """A verified cohort's measured delivery, for the evidence of its class. A step that
        asked any draft counts as drafted even where nothing was verified (a lookup that found
        nothing, a plan that kept every row plain after asking), so the plain side is only
        steps that cost what decoding without drafts does. A cohort aside that drafted
        lookups' offers: on neither side, its tokens a row counted as plain steps."""
        self.policy.observe_step(
            tuple(row.seq.seq_id for row in cohort.rows),
            cohort.timing is not None or any(row.num_drafts for row in cohort.rows),
            any(row.draft_token_ids for row in cohort.rows), sampled(cohort.seqs),
            num_committed, seconds,
            verify_timing.realign_seconds if verify_timing is not None else 0.0,
            max(1, round(num_committed / len(cohort.rows))) if cohort.aside_lookups
            else plain_steps, cohort.aside_lookups)

    def observe(self, row: RowDraft, outcome: VerifyOutcome) -> None:
        """Before the row's tokens are committed: how much of the draft's cache now holds
        committed tokens, and what its draft got right, for the policy."""
        seq, index = row.seq, row.kind_index
        if outcome.rounds:  # a verify of rounds: the last round's proposal, after the others'
            observe_rounds(self.policy, row, outcome)
        answered = index is not None and row.proposal is not None
        verified = min(row.num_drafts, len(row.proposal.draft_token_ids)) if answered else 0
        if answered and row.proposal.cache_len == seq.drafts[index].cache_len:
            # (a draft lost or re-prefilled since holds none of it: its cache_len moved on)
            seq.drafts[index].valid_len = seq.committed_len + committed_in_draft(
                row, outcome, self.kinds[index].reads_features)
        if row.aside and not answered:
            # The evidence, not the plan, kept the row plain: it was not idle in the plan's
            # sense. Counted idle, every row of a cohort aside for a while would be planned
            # at the optimistic acceptance, so that the step trying drafting again drafted
            # K for every row: an exploration, far dearer than drafting as planned, which
            # would measure slower and keep the cohort aside. (One that drafted a lookup's
            # offer: that kind's evidence alone.)
            return
        self.policy.observe_row(seq.seq_id, goodput.sampling_band(seq.sampling), index,
                                evidence(row, outcome, verified) if answered else None,
                                fade_others=not row.aside)


def evidence(row: RowDraft, outcome: VerifyOutcome, verified: int) -> tuple[int, int] | None:
    """What an answered row's verify says of its kind's acceptance: (drafts weighed, of them
    accepted), or None (no evidence); `verified`: its own drafts the target weighed."""
    if outcome.rounds:
        drafts, accepted = outcome.rounds[-1]
        return (drafts, accepted) if drafts else None
    if row.proposal.cut:
        # The draft declined what it was unsure of: the tokens it kept are the evidence (a
        # rejection only if one of them was rejected), and a draft cut to nothing is none.
        # The acceptance planned with is that of the drafts a row verifies, while the cut
        # keeps their number to what pays.
        return verified, min(outcome.num_accepted, verified)
    # a kind that found nothing to propose is as good as one rejected at once
    return max(row.num_drafts, 1), min(outcome.num_accepted, row.num_drafts)


def committed_in_draft(row: RowDraft, outcome: VerifyOutcome, reads_features: bool) -> int:
    """How many of the positions an answered row's draft cached past the row's committed
    tokens (before this verify) the verify committed. The draft cached the tokens the rounds
    before its proposal committed (a hosted draft's last proposal) and at least its drafts
    1..D-1 (D drafted, maybe 0: a confidence cut returns a prefix of what it fed); those up to
    the first rejection are now committed. A lookup's line over rounds: the line's tokens the
    rounds' outputs matched, in order. A feature head computed its drafts' positions from its
    own features, not the target's: it keeps none of them."""
    drafted = len(row.proposal.draft_token_ids)
    if outcome.rounds and not row.deferred:  # a line: the draft holds its one proposal
        own, before = min(common_prefix(row.proposal.draft_token_ids,
                                        outcome.output_token_ids), max(drafted - 1, 0)), 0
    else:
        accepted, before = last_round(outcome)
        own = min(accepted, row.num_drafts, max(drafted - 1, 0))  # not forced ones
    return before + (0 if reads_features else own)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def last_round(outcome: VerifyOutcome) -> tuple[int, int]:
    """(drafts accepted by the verify's last round, tokens committed by the rounds before
    it): a verify of one round is its own last."""
    if not outcome.rounds:
        return outcome.num_accepted, 0
    return outcome.rounds[-1][1], sum(a + 1 for _, a in outcome.rounds[:-1])


def observe_rounds(policy: DraftingPolicy, row: RowDraft, outcome: VerifyOutcome) -> None:
    """The evidence of a verify of rounds' rounds but the last (Drafter.observe weighs that
    one): each the drafts it verified and those accepted."""
    if row.kind_index is None:
        return
    band = goodput.sampling_band(row.seq.sampling)
    for drafts, accepted in outcome.rounds[:-1]:
        policy.observe_row(row.seq.seq_id, band, row.kind_index,
                           (drafts, accepted) if drafts else None, fade_others=not row.aside)
