"""The drafting policy: whether a cohort drafts this step, and with which kind and how many
tokens each of its rows does.

One interface, asked once per step by the drafter (coordinator/drafting.py, which calls the
services): `plan(rows, ask) -> StepPlan`. Its parts, each tested alone:
- step-aside evidence (coordinator/evidence.py): where drafted steps measured slower than plain
  ones for cohorts of this size and class (greedy or sampled), the cohort decodes plainly and
  no draft is asked (StepPlan.aside);
- lookups asked first, throttled (KindModel.ask_due): a draft whose cheapest command costs
  next to nothing next to the target's is asked for every row before planning, so the plan
  knows what it has for each row; while plans seldom use its offers, only every few steps;
- goodput (coordinator/goodput.py): each row's kind and K, K = 0 included, for the most
  expected tokens a second, exploring kinds and rows it has too little evidence of;
- the confidence cut (`cut_at`): where a calibrated draft ends a row's draft.

The policy's state lives here, nothing of it on Sequence or DraftKind: per sequence and kind,
its acceptance evidence (goodput.RowState), forgotten when the sequence ends (`forget`); per
kind, its measured costs and how often plans use its offers (KindModel); the evidence of
drafted and plain steps. Pure Python, no I/O: what the services cost and answer is passed in.
"""
import dataclasses
import math
from collections.abc import Callable

from coordinator import goodput
from coordinator.evidence import Decision, Evidence

# A draft whose cheapest command costs at most this share of the target's (a lookup, not a
# model) is asked for every row before the step is planned.
ASK_FIRST_SHARE = 0.05
# Such a draft is asked every step while at least this share of recent asks (an exponential
# average, DECAY per ask) had a row drafting with what it offered; below, once every
# IDLE_ASK_EVERY tokens a row (a step of several plain tokens counts them all), so it keeps
# gathering evidence and finds a sequence that starts to repeat itself that soon.
ASK_USE_FLOOR = 0.125
ASK_USE_DECAY = 0.9
IDLE_ASK_EVERY = 4


@dataclasses.dataclass(frozen=True)
class DraftingConfig:
    num_draft_tokens: int  # K, the most a row drafts in a step
    draft_policy: str  # "goodput" or "fixed" (see EngineConfig)
    min_draft_confidence: float | None  # None: calibrated drafts cut at break-even
    plain_steps: int = 1  # tokens a row a command decodes where no row drafts (EngineConfig)
    draft_rounds: int = 1  # rounds a command of the target's hosted draft runs (EngineConfig)


@dataclasses.dataclass
class KindModel:
    """What the policy knows of one draft kind (by its index in every per-kind list)."""

    cost: goodput.ServiceCost | None = None  # its measured costs, once calibrated
    unit_cost: float = math.inf  # seconds of its cheapest measured command
    # its probabilities of its drafts track their acceptance (ModelInfo.calibrated): its
    # drafts are cut where they stop paying (goodput.break_even_confidence)
    calibrated: bool = False
    ask_use: float = 1.0  # recent share of asks before planning that a plan drafted with
    # tokens a row the steps since its last ask before planning decoded (that step's own
    # included): paced in tokens, an idle kind is asked as often in a sequence's tokens
    # whether commands decode one token a row or several
    since_ask: int = IDLE_ASK_EVERY

    def ask_due(self) -> bool:
        """Whether to ask it before planning this step (called once per step)."""
        if self.ask_use >= ASK_USE_FLOOR or self.since_ask >= IDLE_ASK_EVERY:
            self.since_ask = 0
            return True
        return False

    def decoded(self, tokens: int) -> None:
        """A step was verified that decoded `tokens` tokens a row."""
        self.since_ask += max(1, tokens)

    def asked(self, used: bool) -> None:
        """Record whether the plan drafted any row with what it offered."""
        self.ask_use = ASK_USE_DECAY * self.ask_use + (1 - ASK_USE_DECAY) * used


@dataclasses.dataclass(frozen=True)
class CohortRow:
    """One row of a cohort as the policy sees it."""

    seq_id: int
    band: int  # goodput.sampling_band of its request
    # per kind: the tokens that kind must be fed before it proposes (>= 1); None where it
    # cannot draft for the row (the kind is down, or refused the row's tokens)
    catch_up: tuple[int | None, ...]
    cold: tuple[bool, ...]  # per kind: it holds nothing of the row yet (prefilled if picked)
    prefill: int = 0  # tokens a cold kind's prefill feeds
    room: int | None = None  # the most drafts worth verifying (goodput.Row.room)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step's drafting: per row (in the cohort's order) the drafts it verifies (0: plain
    decoding) and the kind that drafts them."""

    k: tuple[int, ...]
    kinds: tuple[int | None, ...]
    asked_first: tuple[int, ...] = ()  # kinds asked for every row before planning
    aside: bool = False  # the evidence stepped the cohort aside: no draft is asked
    # the evidence stepped the cohort aside, and rows draft what lookups offered them
    aside_lookups: bool = False
    room: int | None = None  # aside: tokens a row its command may decode before the next probe
    # per row, the kind that drafts its k where its own proposes nothing (None: it decodes
    # plainly): with measured costs, a kind asked first that offered it something (paid
    # for already); without, the row's next best kind
    fallback: tuple[int | None, ...] = ()

    def kind(self, i: int) -> int | None:
        return self.kinds[i] if self.k[i] else None


# ask(kind index) -> {row index: tokens the kind offers it} (rows offered nothing left out)
Ask = Callable[[int], dict[int, int]]


class DraftingPolicy:
    def __init__(self, config: DraftingConfig, num_kinds: int,
                 planner: goodput.GoodputPolicy | None = None,
                 evidence: Evidence | None = None):
        """planner: a goodput policy to use as it is (a test's scripted one); else one is
        built from the services' measured costs at `calibrate`. evidence: what drafted and
        plain steps measured, consulted before planning (None: the planner alone)."""
        self.config = config
        self.kinds = [KindModel() for _ in range(num_kinds)]
        self.planner = planner
        self.evidence = evidence
        self._target_unit_cost: float | None = None  # seconds of its cheapest command
        self._lookups: frozenset[int] = frozenset()  # kinds that are lookups (calibrate)
        self._rows: dict[int, list[goodput.RowState]] = {}  # seq_id -> per kind
        # seq_id -> (the seq_ids its last verify ran with, in order; whether it verified
        # drafts): see realign_shares
        self._ran: dict[int, tuple[tuple[int, ...], bool]] = {}

    # ---- start-up -------------------------------------------------------------------------------
    def calibrate(self, target, kinds: list, hosted: frozenset[int] = frozenset(),
                  lookups: frozenset[int] = frozenset()) -> None:
        """Start from what each service measured of its forwards at start-up (target and each
        kind: its ModelInfo, or None where not known): the planner's costs (without them
        every row drafts K) and the order kinds are asked in. hosted: the kinds the target
        hosts; lookups: the kinds that look up what a sequence repeats (DraftKind.lookup).
        The commands of both run rounds."""
        fixed = self.config.draft_policy == "fixed"
        self._lookups = lookups

        def cost(info):
            return None if fixed or info is None else \
                goodput.ServiceCost(goodput.ForwardCosts(info.step_costs),
                                    packs_positions=info.packs_positions)

        self._target_unit_cost = min((s for _, _, s in target.step_costs), default=None) \
            if target is not None else None
        for model, info in zip(self.kinds, kinds):
            model.cost = cost(info)
            model.calibrated = info is not None and info.calibrated
            if info is not None and info.step_costs:
                model.unit_cost = min(seconds for _, _, seconds in info.step_costs)
        if self.planner is None:
            self.planner = goodput.GoodputPolicy(
                goodput.GoodputConfig(max_k=self.config.num_draft_tokens,
                                      plain_steps=self.config.plain_steps,
                                      rounds=self.config.draft_rounds),
                [model.cost for model in self.kinds], cost(target), hosted | lookups)

    # ---- a step's plan --------------------------------------------------------------------------
    def plan(self, rows: list[CohortRow], ask: Ask) -> StepPlan:
        """The step's plan for a cohort of `rows`: after asking the lookups due (`ask`) what
        they have for each row, each row's kind and K by the planner. Where the evidence
        steps the cohort aside, no model draft is asked: a small cohort (Evidence.
        lookups_aside) still drafts what its lookups offer (StepPlan.aside_lookups), every
        other one decodes plainly and asks nothing. Greedy and sampled rows alike: a seeded
        request's tokens do not depend on the plan."""
        sampled = any(r.band for r in rows)
        if self.evidence is None or self.evidence.choose(len(rows), sampled) is Decision.PLAN:
            return self._planned(rows, ask)
        aside = StepPlan((0,) * len(rows), (None,) * len(rows), aside=True,
                         room=self.evidence.room(len(rows), sampled))
        if not self._lookups or not self.evidence.lookups_aside(len(rows)):
            return aside
        # the lookups cost next to nothing and their drafts are weighed on neither side
        # (observe_step): the evidence decides for the model drafts alone
        plan = self._planned(rows, ask, self._lookups)
        return dataclasses.replace(plan, aside_lookups=True, room=aside.room) \
            if any(plan.k) else dataclasses.replace(aside, asked_first=plan.asked_first)

    def _planned(self, rows: list[CohortRow], ask: Ask,
                 only: frozenset[int] | None = None) -> StepPlan:
        """The planner's plan for the cohort, with the kinds in `only` (None: every kind)."""
        none = (None,) * len(rows)
        if only is not None:
            rows = [dataclasses.replace(r, catch_up=tuple(
                c if i in only else None for i, c in enumerate(r.catch_up))) for r in rows]
        # a lookup not due this step sits it out, as if asked and offering nothing
        first = self.asked_first(rows)
        due = tuple(i for i in first if self.kinds[i].ask_due())
        offers = {index: ask(index) if index in due else {} for index in first}
        if all(r.catch_up[i] is None for r in rows for i in range(len(self.kinds))):
            return StepPlan((0,) * len(rows), none, due)
        planned_rows = [self._row(r, i, offers) for i, r in enumerate(rows)]
        planned = self.planner.plan(planned_rows)
        # a kind the row has no option with (down, refused, a lookup with nothing) cannot draft
        kinds = []
        for i, row in enumerate(planned_rows):
            index, options = planned.kind(i), row.options()
            kinds.append(index if index is not None and index < len(options)
                         and options[index] is not None else None)
        for index in due:
            self.kinds[index].asked(index in kinds)
        fixed = not self.planner.calibrated
        fallback = tuple(_fallback(row.options(), kind, fixed)
                         for row, kind in zip(planned_rows, kinds))
        return StepPlan(tuple(n if d is not None else 0 for n, d in zip(planned.k, kinds)),
                        tuple(kinds), due, fallback=fallback)

    def asked_first(self, rows: list[CohortRow] | None = None) -> list[int]:
        """The kinds asked for every row before planning (if due): with the goodput planner,
        those whose cheapest command costs at most ASK_FIRST_SHARE of the target's, among
        those that can draft for some row."""
        if self.planner is None or not self.planner.calibrated \
                or self._target_unit_cost is None:
            return []
        return [i for i, model in enumerate(self.kinds)
                if model.unit_cost <= ASK_FIRST_SHARE * self._target_unit_cost
                and (rows is None or any(r.catch_up[i] is not None for r in rows))]

    def _row(self, row: CohortRow, i: int, offers: dict[int, dict[int, int]]) -> goodput.Row:
        """Row i as the planner sees it: an option per kind that may draft for it. A kind
        asked first drafts for it only what it offered."""
        states = self._states(row.seq_id, row.band)
        options = []
        for index, catch_up in enumerate(row.catch_up):
            offered = offers[index].get(i) if index in offers else None
            if catch_up is None or (index in offers and not offered):
                options.append(None)
                continue
            option = self.planner.choice(states[index], catch_up, index, cold=row.cold[index],
                                         prefill=row.prefill)
            options.append(dataclasses.replace(option, offered=offered) if offered else option)
        return goodput.Row(choices=tuple(options), room=row.room)

    def cut_at(self, kind: int, rows: int, drafting: int, num_drafts: int) -> float:
        """The confidence a call's drafts are cut at: --min-draft-confidence where given; else,
        for a calibrated draft, the break-even of this step's shape (`rows` in the cohort,
        `drafting` of them asked); else none (0)."""
        if self.config.min_draft_confidence is not None:
            return self.config.min_draft_confidence
        model = self.kinds[kind]
        if not (model.calibrated and model.cost is not None and self.planner.calibrated):
            return 0.0
        return goodput.break_even_confidence(self.planner.target, model.cost, rows, drafting,
                                             num_drafts, self.planner.config.plain_steps)

    # ---- what steps measured --------------------------------------------------------------------
    def observe_call(self, kind: int, rows: int, width: int, drafted: int, forward_s: float,
                     round_trip_s: float) -> None:
        """A propose command to `kind`: `rows` fed `width` tokens, then `drafted` forwards."""
        cost = self.kinds[kind].cost
        if cost is not None and self.planner.calibrated:
            cost.observe(goodput.draft_calls(rows, width, drafted), forward_s, round_trip_s)

    def observe_verify(self, drafts: list[int], forward_s: float, round_trip_s: float) -> None:
        """The target's verify of a cohort whose rows verified `drafts` tokens each."""
        if self.planner is not None and self.planner.calibrated:
            calls = self.planner.target.verify_calls(len(drafts), sum(map(bool, drafts)),
                                                     max(drafts))
            self.planner.target.observe(calls, forward_s, round_trip_s)

    def observe_row(self, seq_id: int, band: int, kind: int | None,
                    evidence: tuple[int, int] | None, fade_others: bool = True) -> None:
        """A row's verified step: `kind` was asked for it (None: none was), with `evidence`
        (drafts weighed, of them accepted; None: it answered nothing, no evidence). Every
        other kind's evidence fades, unless not `fade_others` (a row stepped aside: the
        evidence, not the plan, kept the other kinds from it)."""
        for index, state in enumerate(self._states(seq_id, band)):
            if index != kind:
                if fade_others:
                    self.planner.observe(state, 0, 0, index)
            elif evidence is not None:
                self.planner.observe(state, *evidence, index)

    def observe_miss(self, seq_id: int, band: int, kind: int) -> None:
        """A kind proposed nothing for a row that then drafted with its fallback: as good as
        a draft rejected at once."""
        self.planner.observe(self._states(seq_id, band)[kind], 1, 0, kind)

    def observe_step(self, seq_ids: tuple[int, ...], drafted: bool, verified: bool,
                     sampled: bool, num_committed: int, seconds: float,
                     realign_s: float, steps: int = 1, aside_lookups: bool = False) -> None:
        """A verified cohort's measured delivery, for the evidence of its class. `drafted`: the
        step asked a draft or verified drafts (what drafting costs is weighed on its side even
        where nothing was verified, unless it then decoded several plain steps: weighed on
        neither side); `verified`: it verified drafts; `steps`: tokens a row its command
        decoded (each row's mean, for a step of drafts). `aside_lookups`: the cohort was aside
        and drafted lookups' offers (StepPlan.aside_lookups): weighed on neither side, and
        for the model drafts' catch-up a stretch of plain steps. Turnover is left out of both
        sides, and compaction after a drafted step charged to it (see realign_shares)."""
        turnover, carried = self.realign_shares(seq_ids, verified, realign_s)
        for model in self.kinds:
            model.decoded(steps)
        if self.evidence is not None:
            self.evidence.observe(len(seq_ids), drafted and not aside_lookups, num_committed,
                                  max(0.0, seconds - turnover), carried, sampled, steps,
                                  weighed=not aside_lookups and (
                                      verified or not drafted or steps <= 1))

    def realign_shares(self, seq_ids: tuple[int, ...], verified: bool,
                       realign_s: float) -> tuple[float, float]:
        """The target's seconds of re-stacking a verified cohort's rows, as the evidence
        weighs them: (turnover, carried). Turnover: the rows are not the batch they last ran
        in, in its order (requests joined or left), a copy that comes once per arrival and
        departure whether or not the server drafts, so it says nothing about drafting.
        Carried: the same batch after a step that verified drafts, compacting the holes its
        rejected drafts left: drafting's cost, charged to that step. Records what each row
        ran with."""
        last = [self._ran.get(seq_id) for seq_id in seq_ids]
        changed = any(r is None or r[0] != seq_ids for r in last)
        after_drafts = not changed and any(r[1] for r in last)
        for seq_id in seq_ids:
            self._ran[seq_id] = (seq_ids, verified)
        return (realign_s, 0.0) if changed else (0.0, realign_s if after_drafts else 0.0)

    def forget(self, seq_ids) -> None:
        """The sequences left this engine (ended or moved): their state goes."""
        for seq_id in seq_ids:
            self._rows.pop(seq_id, None)
            self._ran.pop(seq_id, None)

    def _states(self, seq_id: int, band: int) -> list[goodput.RowState]:
        states = self._rows.get(seq_id)
        if states is None:
            states = self._rows[seq_id] = [goodput.RowState(band=band) for _ in self.kinds]
        return states

    def acceptance_state(self, seq_id: int, kind: int) -> goodput.RowState | None:
        """What the policy knows of a sequence's acceptance with `kind` (None: nothing)."""
        states = self._rows.get(seq_id)
        return states[kind] if states is not None else None


def _fallback(options, kind: int | None, fixed: bool) -> int | None:
    """A drafting row's fallback kind (StepPlan.fallback): of its other options, those
    offered (any, without measured costs), the one it accepts best."""
    if kind is None:
        return None
    others = [(option.acceptance, index) for index, option in enumerate(options)
              if option is not None and index != kind and (fixed or option.offered)]
    return max(others)[1] if others else None
