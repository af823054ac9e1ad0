"""The drafting part: which draft kind each row of a cohort drafts with, how many tokens, and
the proposals, as a typed `DraftedCohort` for the step loop to verify.

Drafts that cost next to nothing (a lookup: the n-gram draft) are asked for every row before
planning, so the plan knows which rows they have something for and how much; what they offer
costs nothing more to verify. While plans seldom draft with what one offers, it is asked only
every few steps. The other kinds are called cheapest first; rows a kind proposed nothing for
are planned again, among the kinds not called yet, before those are called; such a miss counts
as a draft rejected at once. After the verify, `observe` feeds each row's outcome back to the
policy and moves the draft's record of its valid cache.
"""
import dataclasses
import functools
import logging
import operator
import time

from batchspec import errors
from coordinator import features, goodput, scheduler
from coordinator.clients import ModelInfo, Proposal, ProposeSpec, Timing, VerifyOutcome
from coordinator.drafts import DraftKind
from coordinator.evidence import Decision, Evidence
from coordinator.peers import Peers
from coordinator.sequence import Sequence, mixed
from coordinator.stats import Recorder

log = logging.getLogger(__name__)

# A draft whose cheapest command costs at most this share of the target's (a lookup, not a
# model) is asked for every row before the step is planned.
ASK_FIRST_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class DraftingConfig:
    num_draft_tokens: int  # K, the most a row drafts in a step
    draft_policy: str  # "goodput" or "fixed" (see EngineConfig)
    min_draft_confidence: float | None  # None: calibrated drafts cut at break-even


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
    aside: bool = False  # its cohort stepped aside: no plan was made for it

    @property
    def draft_token_ids(self) -> list[int]:
        own = self.proposal.draft_token_ids[:self.num_drafts] if self.proposal else []
        return own + list(self.forced)

    def traced(self, accepted: int, committed: int) -> tuple:
        """The step log's account: (kind or None, drafts verified, accepted, committed). A
        confidence cut may leave a row fewer drafts than planned, or none."""
        verified = len(self.draft_token_ids)
        return self.kind_index if verified else None, verified, accepted, committed


@dataclasses.dataclass(frozen=True)
class DraftedCohort:
    """A cohort whose drafts are ready to verify."""

    rows: list[RowDraft]
    timing: Timing | None = None  # the draft services' own account, summed; None: no call
    round_trip_s: float = 0.0  # coordinator-side, every draft call of the step

    @property
    def seqs(self) -> list[Sequence]:
        return [row.seq for row in self.rows]

    @property
    def mixed(self) -> bool:
        return mixed(self.seqs)

    @property
    def plain(self) -> bool:
        """No row has a proposal: the step decodes plainly."""
        return all(row.proposal is None for row in self.rows)

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

    def still_open(self, active) -> "DraftedCohort | None":
        """The cohort less the rows that ended since (not in `active`); None if none is left."""
        rows = [row for row in self.rows if row.seq.seq_id in active]
        return dataclasses.replace(self, rows=rows) if rows else None


@dataclasses.dataclass
class _Step:
    """One step's drafting in progress, every map keyed by row index."""

    seqs: list[Sequence]
    called: set[int] = dataclasses.field(default_factory=set)  # kinds asked this step
    # kind index -> row -> what the kind, asked before planning, offered (non-empty only)
    offers: dict[int, dict[int, Proposal]] = dataclasses.field(default_factory=dict)
    # row -> (kind index, drafts it verifies), for rows that have their drafts
    drafted: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # row -> the kind indices that proposed nothing for it, in call order
    misses: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # (row, kind index) of those misses that a confidence cut made: not rejections
    declined: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    # row -> the latest answer a call planned for it gave (empty ones too)
    answers: dict[int, Proposal] = dataclasses.field(default_factory=dict)
    # (the service's own timing, round-trip seconds) of each draft call
    spent: list[tuple[Timing, float]] = dataclasses.field(default_factory=list)

    def offered(self) -> dict[int, dict[int, int]]:
        """{row: {kind: tokens}} the kinds asked before planning offered."""
        return {i: {index: len(got[i].draft_token_ids)
                    for index, got in self.offers.items() if i in got}
                for i in range(len(self.seqs))}

    def asked(self) -> dict[int, int]:
        """Each row's kind to observe: the one it drafts with, else its last miss."""
        asked = {i: indices[-1] for i, indices in self.misses.items()}
        asked.update((i, index) for i, (index, _) in self.drafted.items())
        return asked

    def result(self) -> DraftedCohort:
        asked = self.asked()
        rows = [RowDraft(seq, self.drafted[i][1] if i in self.drafted else 0, asked.get(i),
                         self.answers.get(i)) for i, seq in enumerate(self.seqs)]
        timing = functools.reduce(operator.add, (t for t, _ in self.spent)) \
            if self.spent else None
        return DraftedCohort(rows, timing, sum(s for _, s in self.spent))


def sampled(seqs: list[Sequence]) -> bool:
    """Whether a cohort has a sampled row: its evidence is kept apart from greedy cohorts'."""
    return not all(s.sampling.greedy for s in seqs)


def realign_shares(cohort: DraftedCohort, verify_timing: Timing | None) -> tuple[float, float]:
    """The target's seconds of re-stacking a verified cohort's rows, as the evidence weighs
    them: (turnover, carried). Turnover: the rows are not the batch they last ran in, in its
    order (requests joined or left), a copy that comes once per arrival and departure
    whether or not the server drafts, so it says nothing about drafting (one such copy of a
    newly formed batch took 241 ms, four plain steps' time, and made a yardstick of plain
    steps measure a third too slow). Carried: the same batch after a step that verified
    drafts, compacting the holes its rejected drafts left: drafting's cost, charged to that
    step (a plain step after a drafted one paid 23 ms of a 114 ms step for it). Records what
    each row ran with."""
    ids = tuple(row.seq.seq_id for row in cohort.rows)
    changed = any(row.seq.ran_with != ids for row in cohort.rows)
    after_drafts = not changed and any(row.seq.ran_drafted for row in cohort.rows)
    drafted = any(row.draft_token_ids for row in cohort.rows)
    for row in cohort.rows:
        row.seq.ran_with, row.seq.ran_drafted = ids, drafted
    realign = verify_timing.realign_seconds if verify_timing is not None else 0.0
    return (realign, 0.0) if changed else (0.0, realign if after_drafts else 0.0)


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


class Drafter:
    def __init__(self, peers: Peers, config: DraftingConfig, recorder: Recorder,
                 policy: goodput.GoodputPolicy | None = None,
                 evidence: Evidence | None = None):
        """policy: one to use as it is (a test's scripted one); else one is built from the
        services' measured costs at `calibrate`. evidence: what drafted and plain steps
        measured, consulted before planning a cohort (None: the policy alone)."""
        self.peers = peers
        self.config = config
        self.recorder = recorder
        self.policy = policy
        self.evidence = evidence
        self._target_unit_cost: float | None = None  # seconds of its cheapest measured command

    @property
    def kinds(self) -> list[DraftKind]:
        return self.peers.kinds

    def calibrate(self, target: ModelInfo | None, infos: list[ModelInfo | None]) -> None:
        """Start from what each service measured of its forwards at start-up: the goodput
        policy's costs (without them every row drafts K) and the order kinds are asked in."""
        fixed = self.config.draft_policy == "fixed"

        def cost(info):
            return None if fixed or info is None else \
                goodput.ServiceCost(goodput.ForwardCosts(info.step_costs),
                                    packs_positions=info.packs_positions)

        self._target_unit_cost = min((s for _, _, s in target.step_costs), default=None) \
            if target is not None else None
        for kind, info in zip(self.kinds, infos):
            kind.cost = cost(info)
            kind.calibrated = info is not None and info.calibrated
            if info is not None and info.step_costs:
                kind.unit_cost = min(seconds for _, _, seconds in info.step_costs)
        if self.policy is None:
            self.policy = goodput.GoodputPolicy(
                goodput.GoodputConfig(max_k=self.config.num_draft_tokens),
                [kind.cost for kind in self.kinds], cost(target))

    # ---- a step's drafts ------------------------------------------------------------------------
    def draft(self, seqs: list[Sequence], timeout: float | None) -> DraftedCohort:
        """Plan the cohort and call the drafts, the cheapest first; or, where drafted steps
        have measured slower than plain ones for cohorts of this size and class, step aside:
        the cohort then decodes plainly and no draft is asked."""
        if self._aside(seqs):
            return DraftedCohort([RowDraft(seq, aside=True) for seq in seqs])
        step = _Step(seqs)
        early = self._ask_first(step, timeout)
        plan, missed = self.plan(step), False
        for kind in sorted(self.kinds, key=lambda kind: kind.unit_cost):
            if missed:  # what was proposed is kept; the rows that missed may go elsewhere
                plan, missed = self.plan(step), False
            rows = [i for i in range(len(seqs))
                    if i not in step.drafted and plan.kind(i) == kind.index]
            if not rows:
                continue
            if kind.index in early:  # asked already: take what it offered
                for i in rows:
                    step.drafted[i] = (kind.index, plan.k[i])
                    step.answers[i] = step.offers[kind.index][i]
                continue
            missed = self._call(kind, step, rows, plan, timeout)
        for index in early:
            self.kinds[index].asked(any(d == index for d, _ in step.drafted.values()))
        self._observe_earlier_misses(step)
        return step.result()

    def _aside(self, seqs: list[Sequence]) -> bool:
        """Whether the evidence says to decode this cohort plainly. Sampled cohorts too: a
        seeded request's tokens do not depend on whether its steps drafted."""
        return self.evidence is not None and \
            self.evidence.choose(len(seqs), sampled(seqs)) is Decision.PLAIN

    def observe_step(self, cohort: DraftedCohort, num_committed: int, seconds: float,
                     verify_timing: Timing | None = None) -> None:
        """A verified cohort's measured delivery, for the evidence of its class. A step that asked
        any draft counts as drafted even where nothing was verified (a lookup that found
        nothing, a plan that kept every row plain after asking): what drafting costs is
        weighed on its side, and the plain side is only steps that cost what decoding
        without drafts does. Turnover is left out of both sides, and compaction after a
        drafted step charged to it (see realign_shares)."""
        turnover, carried = realign_shares(cohort, verify_timing)
        if self.evidence is not None:
            drafted = cohort.timing is not None or any(row.num_drafts for row in cohort.rows)
            self.evidence.observe(len(cohort.rows), drafted, num_committed,
                                  max(0.0, seconds - turnover), carried, sampled(cohort.seqs))

    def _ask_first(self, step: _Step, timeout: float | None) -> list[int]:
        """Ask the kinds due before planning for every row; the kinds asked. One not due this
        step (DraftKind.ask_due: plans seldom use its offers) sits it out, as if asked and
        offering nothing."""
        asked = []
        for kind in self.asked_first():
            step.called.add(kind.index)
            if not kind.ask_due():
                continue
            got = self._propose(kind, step, range(len(step.seqs)), self.config.num_draft_tokens,
                                timeout)
            step.offers[kind.index] = {i: p for i, p in got.items() if p.draft_token_ids}
            asked.append(kind.index)
        return asked

    def _call(self, kind: DraftKind, step: _Step, rows: list[int], plan: goodput.Plan,
              timeout: float | None) -> bool:
        """Call `kind` for the rows planned with it; True when some row got nothing."""
        step.called.add(kind.index)
        got = self._propose(kind, step, rows, max(plan.k[i] for i in rows), timeout)
        step.answers.update(got)
        missed = False
        for i in rows:
            if i in got and got[i].draft_token_ids:
                step.drafted[i] = (kind.index, plan.k[i])
            else:
                step.misses.setdefault(i, []).append(kind.index)
                if i in got and got[i].cut:
                    step.declined.add((i, kind.index))
                missed = True
        return missed

    def _observe_earlier_misses(self, step: _Step) -> None:
        """`observe` sees the kind a row ends with (its drafts, or its last miss); any
        earlier miss is observed here."""
        asked = step.asked()
        for i, indices in step.misses.items():
            for index in indices:
                if index != asked[i] and (i, index) not in step.declined:
                    self.policy.observe(step.seqs[i].drafts[index].spec, 1, 0, index)

    def asked_first(self) -> list[DraftKind]:
        """The reachable drafts asked for every row before planning: with the goodput policy,
        those whose cheapest command costs at most ASK_FIRST_SHARE of the target's."""
        if not self.policy.calibrated or self._target_unit_cost is None:
            return []
        return [kind for kind in self.kinds if kind.up
                and kind.unit_cost <= ASK_FIRST_SHARE * self._target_unit_cost]

    def _propose(self, kind: DraftKind, step: _Step, rows, num_drafts: int,
                 timeout: float | None) -> dict[int, Proposal]:
        """{row: Proposal} from `kind` for those of `rows` that can draft together (a row
        the draft holds nothing of is prefilled first); {} when none can or the service is
        lost. A proposal's tokens are what the service drafted (and cached, but the last),
        which may be more than the row verifies (or fewer: a lookup proposes what it finds)."""
        rows = [i for i in rows if not step.seqs[i].drafts[kind.index].refused]
        seqs = [step.seqs[i] for i in rows]
        try:
            if not seqs or not self.peers.warm(kind, seqs) or not num_drafts:
                return {}
            ready, width = scheduler.draft_plan(seqs, kind.index)
            if not ready or (kind.reads_features
                             and not features.ensure(self.peers.target, ready)):
                return {}
            proposals, timing, round_trip = self._send(
                kind, ready, width, num_drafts, timeout,
                self._cut(kind, len(step.seqs), len(ready), num_drafts))
        except errors.Unavailable as error:
            self.peers.draft_lost(kind, error)
            return {}
        except errors.DeadlineExceeded:
            return {}
        except errors.InvalidArgument as error:
            refuse(kind, seqs, error)
            return {}
        step.spent.append((timing, round_trip))
        for seq, proposal in zip(ready, proposals):
            seq.drafts[kind.index].cache_len = proposal.cache_len
            if proposal.draft_token_ids and not seq.sampling.greedy:
                self.recorder.sampled_row()
        row_of = {step.seqs[i].seq_id: i for i in rows}
        return {row_of[p.seq_id]: p for p in proposals}

    def _cut(self, kind: DraftKind, rows: int, drafting: int, num_drafts: int) -> float:
        """The confidence a call's drafts are cut at: --min-draft-confidence where given; else,
        for a calibrated draft, the break-even of this step's shape (`rows` in the cohort,
        `drafting` of them asked); else none (0)."""
        if self.config.min_draft_confidence is not None:
            return self.config.min_draft_confidence
        if not (kind.calibrated and kind.cost is not None and self.policy.calibrated):
            return 0.0
        return goodput.break_even_confidence(self.policy.target, kind.cost, rows, drafting,
                                             num_drafts)

    def _send(self, kind: DraftKind, seqs: list[Sequence], width: int, num_drafts: int,
              timeout: float | None, cut: float = 0.0) -> tuple[list[Proposal], Timing, float]:
        """One propose command; every row appends `width` committed tokens first, and each
        row's draft is cut where the draft's confidence falls below `cut`."""
        specs = [ProposeSpec(s.seq_id, s.drafts[kind.index].cache_len, s.committed_len - width,
                             s.token_ids[s.committed_len - width:], s.sampling,
                             s.features.fed_with(s.committed_len - width, s.committed_len)
                             if kind.reads_features else None) for s in seqs]
        started = time.perf_counter()
        proposals, timing = kind.client.propose(
            num_drafts, mixed(seqs), specs, timeout=timeout, min_confidence=cut)
        round_trip = time.perf_counter() - started
        if kind.cost is not None and self.policy.calibrated:
            drafted = max(len(p.draft_token_ids) for p in proposals)
            if any(p.cut for p in proposals):  # a cut returns fewer drafts than it ran forwards
                drafted = max(p.cache_len - s.committed_len + 1 for s, p in zip(seqs, proposals))
            kind.cost.observe(goodput.draft_calls(len(seqs), width, drafted),
                              timing.forward_seconds, round_trip)
        return proposals, timing, round_trip

    # ---- planning -------------------------------------------------------------------------------
    def plan(self, step: _Step) -> goodput.Plan:
        """Each row's draft kind and tokens to draft this step (0: none), by the policy,
        greedy and sampled rows alike (a seeded request's tokens do not depend on the plan).
        Rows drafted already this step keep their kind and K; kinds called already are not
        asked again, except for what they offered before planning (a choice whose cost is
        paid)."""
        up = [kind for kind in self.kinds if kind.up]
        if not up:
            return goodput.Plan([0] * len(step.seqs), 0.0, [None] * len(step.seqs))
        offered = step.offered()
        rows = [self._row(step, i, up, offered[i]) for i in range(len(step.seqs))]
        plan = self.policy.plan(rows)
        # a kind not offered for the row (not reachable, asked already) cannot draft for it
        indices = [plan.kind(i) for i in range(len(rows))]
        indices = [d if d is not None and rows[i].choices[d] is not None else None
                   for i, d in enumerate(indices)]
        return goodput.Plan([n if d is not None else 0 for n, d in zip(plan.k, indices)],
                            plan.tokens_per_s, indices)

    def _row(self, step: _Step, i: int, up: list[DraftKind],
             offered: dict[int, int]) -> goodput.Row:
        """Row i as the policy sees it: a choice per kind that may still draft for it."""
        s = step.seqs[i]
        choices = [None] * len(self.kinds)
        for kind in up:
            state, tokens = s.drafts[kind.index], offered.get(kind.index)
            if state.refused or not (i in step.drafted or kind.index not in step.called
                                     or tokens):
                continue
            # a cold row (the draft holds nothing of it) is prefilled there if picked
            choice = self.policy.choice(state.spec, s.draft_append_need(kind.index),
                                        kind.index, cold=state.cache_len is None,
                                        prefill=s.committed_len - 1)
            choices[kind.index] = dataclasses.replace(choice, offered=tokens) \
                if tokens else choice
        forced_kind, forced_k = step.drafted.get(i, (0, None))
        return goodput.Row(choices=tuple(choices), forced_k=forced_k, forced_kind=forced_kind,
                           room=s.draft_room)

    # ---- after the verify -----------------------------------------------------------------------
    def observe_verify(self, cohort: DraftedCohort, timing: Timing, seconds: float) -> None:
        """The target's measured cost of verifying the cohort."""
        if self.policy.calibrated:
            drafts = [len(row.draft_token_ids) for row in cohort.rows]
            calls = self.policy.target.verify_calls(len(drafts), sum(map(bool, drafts)),
                                                    max(drafts))
            self.policy.target.observe(calls, timing.forward_seconds, seconds)

    def observe(self, row: RowDraft, outcome: VerifyOutcome) -> None:
        """Before the row's tokens are committed: what its draft got right, for the policy,
        and how much of the draft's cache now holds committed tokens."""
        seq, index = row.seq, row.kind_index
        answered = index is not None and row.proposal is not None
        drafted = len(row.proposal.draft_token_ids) if answered else 0
        verified = min(row.num_drafts, drafted)  # its own drafts the target weighed
        if answered and row.proposal.cache_len == seq.drafts[index].cache_len:
            # The draft cached committed[:before] and at least drafts 1..D-1 (D = drafted,
            # maybe 0: a confidence cut returns a prefix of what it fed); those up to the
            # first rejection are now committed. A draft lost or re-prefilled since holds
            # none of them (its cache_len moved on). A feature head computed its drafts'
            # positions from its own features, not the target's: it keeps none of them.
            own = 0 if self.kinds[index].reads_features else min(
                outcome.num_accepted, verified, max(drafted - 1, 0))  # not forced ones
            seq.drafts[index].valid_len = seq.committed_len + own
        if row.aside:
            # The evidence, not the plan, kept the row plain: it was not idle in the plan's
            # sense. Counted idle, every row of a cohort aside for a while would be planned
            # at the optimistic acceptance, so that the step trying drafting again drafted
            # K for every row: an exploration, far dearer than drafting as planned, which
            # would measure slower and keep the cohort aside.
            return
        for d, state in enumerate(seq.drafts):
            if d != index:
                self.policy.observe(state.spec, 0, 0, d)  # not asked: its evidence fades
            elif answered and row.proposal.cut:
                # The draft declined what it was unsure of: the tokens it kept are the
                # evidence (a rejection only if one of them was rejected), and a draft cut to
                # nothing is none. The acceptance planned with is that of the drafts a row
                # verifies, while the cut keeps their number to what pays.
                self.policy.observe(state.spec, verified, min(outcome.num_accepted, verified), d)
            elif answered:
                # a kind that found nothing to propose is as good as one rejected at once
                self.policy.observe(state.spec, max(row.num_drafts, 1),
                                    min(outcome.num_accepted, row.num_drafts), d)
