"""Draft length by goodput: per sequence and step, the K that maximises expected committed
tokens per second, K = 0 (plain decoding, no draft call) included.

The model of one step of a cohort of B rows, c of which draft K tokens:
- draft time: one forward of c rows feeding W tokens (W >= 1: the last committed token, plus
  any the draft missed while a row was at K = 0), then K - 1 forwards of one token; none when
  c = 0. What a row's catch-up costs past a step's usual W (STEADY_WIDTH) is paid once and
  serves the steps after, so it is spread over cold_horizon steps, as a cold row's prefill
  is: charged whole, a row idle for a while would cost more to resume the longer it idled,
  and stay idle until it explores;
- verify time: one target forward of B rows feeding 1 + K tokens; where the target packs
  positions (its linear layers skip each row's padding), between a forward of B x 1 (c = 0)
  and one of B x (1 + K) (c = B), concave in c: the first drafting rows cost most (the whole
  batch turns wide in attention, and the linear layers leave their small-batch kernels);
- each service's time = ratio x its calibrated forward time + a per-command overhead (RPC,
  encoding, bookkeeping), the ratio and the overhead kept current from live timings;
- a drafting row with per-token acceptance a commits 1 + a + ... + a^K tokens on average, a row
  at K = 0 commits one; a draft kind's expected gain is scaled by what its verified proposals
  delivered against that expectation (drafts whose acceptance is all or nothing, like a
  lookup's, deliver less than the geometric model says).
The plan is the K and the set of drafting rows (those most likely to accept) with the most
expected tokens per second. A row that has not drafted with a kind for long is planned at an
optimistic acceptance for it (exploration), so an estimate never freezes at a value that turned
K off; rows left idle draft together when enough of them would pay at that acceptance, so one
widened verify buys the evidence of many. A kind with too little evidence over all rows must be
tried, by a few rows of a cohort (`explorers`): forced on every row of a large batch, the trial
would cost that batch several plain steps. A row a draft holds nothing of yet ("cold": it is
prefilled on first use) is charged that prefill spread over cold_horizon steps (it is paid once
and serves the steps after): cold rows draft only where they pay for it, never for free,
whether they would ride along on a verify a row forced to draft widens anyway or join a plan of
their own (a stretch aside at a large batch leaves most rows cold, and the step that tries
drafting again must not prefill them all on the plan's word); of cold rows, only one per kind
at a time explores, and only when no row has drafted with that kind for long (or it lacks
evidence), so exploring never buys a prefill per row, and no kind is starved of evidence.
Evidence is bought only where it could change a plan: a kind is forced on no cohort where
drafting would not clearly beat plain decoding even at that optimistic acceptance (wide
verifies at their full price, as at large batches on a CPU).

Pure Python: the coordinator stays free of torch.
"""
import bisect
import dataclasses
import math

from batchspec import packing

# A packed verify of B rows, c of them drafting, costs plain + (wide - plain) * (c / B) ** this:
# concave in c, since the first drafting rows cost most (the whole batch turns wide in
# attention, and the linear layers leave their small-batch kernels). An exponent too large
# prices a few drafting rows below their cost, and plans then widen large batches' verifies
# for a few rows' drafts; the value is fitted to packed verifies at 8, 16 and 32 rows.
PARTIAL_EXPONENT = 0.35


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    max_k: int = 4  # the most a step may draft (the coordinator's -k)
    # tokens a row a command decodes where no row drafts (the coordinator's --plain-steps):
    # plain decoding's rate pays a command's overhead once for that many
    plain_steps: int = 1
    # rounds of proposing and verifying a command of the target's hosted drafts runs (the
    # coordinator's --draft-rounds): a plan drafting only with those pays a command's
    # overheads once for that many rounds
    rounds: int = 1
    # a row not drafting with a kind for this many of its steps is planned at `optimism` for
    # it: rows idle for long draft together once enough of them would pay at that acceptance
    # (one widened verify buys the evidence of all of them), never one at a time
    explore_every: int = 32
    optimism: float = 0.9
    # a kind no row drafted with for this many plans is tried by the rows idle with it, or
    # by one row it holds nothing of yet (no kind is starved of evidence)
    starve_every: int = 128
    # a draft kind with fewer verified drafts than this over all rows is tried by rows that
    # can (`explorers` of a cohort), so a new kind is never starved of evidence by one that
    # looked good first; the running mean's prior weighs as many trials
    min_evidence: float = 8.0
    # a kind forced on a cohort (short of evidence, or starved of it) is forced on at most
    # this many of its rows: a few rows' drafts buy the evidence, while forcing every row
    # widens a large batch's whole verify at once (several plain steps' time where verifies
    # are compute-bound); the other rows draft only where the plan says it pays
    explorers: int = 2
    prior_acceptance: float = 0.6  # before any row has been verified
    prior_weight: float = 2.0  # pseudo-observations of the running mean behind each row's estimate
    decay: float = 0.9  # weight kept by older evidence, per step a row drafts
    delivered_decay: float = 0.99  # the same, per verified proposal, for what a kind delivers
    # drafting must promise this much more than plain decoding (timings are noisy, and a
    # wrong bet costs more than a missed one)
    margin: float = 0.05
    # evidence is bought (a kind forced on a cohort) only where drafting could beat plain
    # decoding by this much at the optimistic acceptance: the calibration is noisy, and near
    # break-even even a good acceptance would barely move a plan
    explore_margin: float = 0.2
    # once live timings flow, a step is plain when the target has run no plain step for this
    # many commands, so what every plan is weighed against is measured
    measure_plain_every: int = 128
    # cold rows are charged their prefill in the draft spread over this many steps (it serves
    # the steps after too): so one row exploring at a large batch never has the draft prefill
    # all of them, nor does a plan that prices them as if the draft held them
    cold_horizon: int = 8

    def __post_init__(self):
        if not 1 <= self.max_k <= 32:
            raise ValueError("max_k must be in [1, 32]")
        if self.plain_steps < 1 or self.rounds < 1:
            raise ValueError("plain_steps and rounds must be >= 1")
        if min(self.explore_every, self.starve_every, self.measure_plain_every,
               self.cold_horizon, self.explorers) < 1 \
                or not 0 < self.decay <= 1 or self.prior_weight <= 0 \
                or not 0 < self.delivered_decay <= 1 or not 0 <= self.optimism < 1 \
                or min(self.margin, self.explore_margin) < 0:
            raise ValueError("explore_every, starve_every, measure_plain_every, "
                             "cold_horizon and explorers >= 1, decay "
                             "and delivered_decay in (0, 1], optimism in [0, 1), "
                             "prior_weight > 0, margins >= 0")


def sampling_band(sampling) -> int:
    """The band of sampling settings a row's acceptance is pooled with: 0 greedy, then
    temperature up to 0.5, up to 0.9, above. A draft's tokens match the target's choices less
    often the hotter a row samples, so each band keeps its own running mean over rows."""
    if sampling.greedy:
        return 0
    return 1 if sampling.temperature <= 0.5 else 2 if sampling.temperature <= 0.9 else 3


@dataclasses.dataclass
class RowState:
    """What the policy knows of one sequence (kept on the Sequence)."""

    band: int = 0  # its sampling_band: the running mean its estimate starts from
    accepted: float = 0.0  # decayed count of accepted drafts
    rejected: float = 0.0  # decayed count of steps that ended in a rejection
    idle_steps: int = 0  # steps since it last drafted

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        """One verified step. A row's drafts are accepted up to the first rejection, so a step
        is num_accepted successes and, if num_accepted < num_drafts, one failure (the
        geometric model's maximum-likelihood counts)."""
        if num_drafts == 0:
            # no evidence: what is known fades, and the estimate drifts back to the running
            # mean, so a row turned off by a few rejections is tried again soon
            self.idle_steps += 1
            self.accepted *= decay
            self.rejected *= decay
            return
        self.idle_steps = 0
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + (1 if num_accepted < num_drafts else 0)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a row commits in one step drafting k at per-token acceptance a: 1 + a + ... + a^k."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class ForwardCosts:
    """Seconds of one forward of `rows` rows feeding `tokens` tokens each, from the grid a
    service measured at start-up. Single timings are noisy, so the grid is smoothed first:
    for each batch size never cheaper for more tokens (the closest such fit), then never
    cheaper for more rows. Between grid points it interpolates linearly, and past the
    grid it extends the last slope."""

    def __init__(self, points):
        # points: (rows, tokens, seconds) triples
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for rows, tokens, seconds in points:
            by_rows.setdefault(rows, []).append((tokens, seconds))
        self._table: dict[int, dict[int, float]] = {}
        for rows in sorted(by_rows):
            for tokens, seconds in _monotone(by_rows[rows]):
                curve = self._table.setdefault(tokens, {})
                fewer = [curve[r] for r in curve if r < rows]
                curve[rows] = max([seconds] + fewer)
        self._tokens = sorted(self._table)
        # (rows, tokens) -> predict's answer: the table never changes, and a plan asks for the
        # same few shapes many times a step
        self._known: dict[tuple[int, int], float] = {}

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def predict(self, rows: int, tokens: int) -> float:
        known = self._known.get((rows, tokens))
        if known is None:
            if len(self._known) >= 4096:  # prefills ask for many shapes: bounded
                self._known.clear()
            known = _interpolate(self._tokens, lambda t: self._by_rows(t, rows), tokens)
            self._known[(rows, tokens)] = known
        return known

    def _by_rows(self, tokens: int, rows: int) -> float:
        curve = self._table[tokens]
        sizes = sorted(curve)
        return _interpolate(sizes, curve.__getitem__, rows)


def _monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The closest never-decreasing fit (least squares, pooling adjacent violators) through
    (tokens, seconds), at the same tokens. Unlike a straight line it keeps a curve's shape:
    at 32 rows on a CPU the first token costs as much as the next three together would on a
    line, and a line makes wide verifies there look cheap."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours, in token order
    for _, seconds in sorted(points):
        blocks.append([seconds, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(count)]
    return list(zip(sorted(t for t, _ in points), fitted))


def _interpolate(xs: list[int], f, x: float) -> float:
    """f at x, linear between the nearest known xs, extended linearly past either end (never
    below zero); a single known x scales proportionally."""
    if len(xs) == 1:
        return f(xs[0]) * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = f(x0), f(x1)
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class ServiceCost:
    """One service's command time: ratio x calibrated forwards + overhead, both tracked live
    (exponential moving averages of what the service and the round trip report). The ratio is
    kept per command shape (its forwards' rows and tokens), per command size (tokens fed,
    summed over the command's forwards) and overall, and the most specific one seen is used:
    a calibration off in its shape (taken while another process loaded on the same cores,
    masks, copies, longer contexts than it measured) would otherwise make one command look
    cheaper than another that costs more."""

    def __init__(self, forwards: ForwardCosts, smoothing: float = 0.1,
                 packs_positions: bool = False):
        self.forwards = forwards
        self.packs_positions = packs_positions  # a target's verify pays for real tokens only
        self.ratio = 1.0  # measured forward time / calibrated forward time, all commands
        self.ratios: dict[int, float] = {}  # the same, per command size
        self.shapes: dict[tuple, float] = {}  # the same, per command shape
        self.overhead_s = 0.0  # round trip minus forward time
        self.observed = 0  # commands timed so far
        self._seen_at: dict[int, int] = {}  # command size -> `observed` when last timed
        self._smoothing = smoothing

    @staticmethod
    def size(calls: list[tuple]) -> int:
        return sum(call[1] for call in calls)

    def _forward_s(self, calls: list[tuple]) -> float:
        """Calibrated seconds of the forwards: (rows, tokens) each, or (rows, tokens, drafting)
        for a packed verify where only `drafting` of the rows feed every token and the
        others one (see verify_calls)."""
        total = 0.0
        for rows, tokens, *drafting in calls:
            wide = self.forwards.predict(rows, tokens)
            if drafting:
                plain = self.forwards.predict(rows, 1)
                wide = plain + (wide - plain) * (drafting[0] / rows) ** PARTIAL_EXPONENT
            total += wide
        return total

    def predict(self, calls: list[tuple]) -> float:
        """Seconds of one command running forwards of (rows, tokens)."""
        ratio = self.shapes.get(tuple(calls)) or self.ratios.get(self.size(calls), self.ratio)
        return ratio * self._forward_s(calls) + self.overhead_s

    def plain_s(self, rows: int, steps: int = 1) -> float:
        """Seconds a token a row of plain decoding where a command decodes `steps` tokens a
        row: a forward each, the command's overhead shared among them."""
        return self.predict([(rows, 1)]) - self.overhead_s * (1 - 1 / max(1, steps))

    def verify_calls(self, batch: int, drafting: int, k: int) -> list[tuple]:
        """A verify of `batch` rows, `drafting` of them with k drafts, as forwards: one of
        batch x (1 + k), or where the target packs positions and some rows do not draft, a
        packed one, (batch, 1 + k, drafting), when it is padded enough to be packed
        (batchspec.packing)."""
        if not (k and drafting):
            return [(batch, 1)]
        if self.packs_positions and drafting < batch \
                and packing.worth_packing(packing.verify_padding(batch, drafting, k)):
            return [(batch, 1 + k, drafting)]
        return [(batch, 1 + k)]

    def stale(self, size: int, every: int) -> bool:
        """Live timings flow, and no command of this size was among the last `every`."""
        seen = self._seen_at.get(size)
        return self.observed > 0 and (seen is None or self.observed - seen >= every)

    def observe(self, calls: list[tuple], forward_s: float, round_trip_s: float) -> None:
        predicted = self._forward_s(calls)
        overhead = max(0.0, round_trip_s - forward_s)
        if predicted <= 0 or forward_s <= 0:
            return
        measured, size, a = forward_s / predicted, self.size(calls), self._smoothing
        if not self.observed:
            self.ratio, self.overhead_s = measured, overhead
        self.ratio += a * (measured - self.ratio)
        self.overhead_s += a * (overhead - self.overhead_s)
        for table, key in ((self.ratios, size), (self.shapes, tuple(calls))):
            known = table.get(key)
            table[key] = measured if known is None else known + a * (measured - known)
        self.observed += 1
        self._seen_at[size] = self.observed


# The widest catch-up a row that drafted the step before feeds: its bonus token, and the last
# draft when all were accepted (which the draft proposed but never fed).
STEADY_WIDTH = 2


def draft_calls(rows: int, width: int, k: int) -> list[tuple[int, int]]:
    """The forwards of one proposal: the appended tokens, then one per further draft."""
    return [(rows, width)] + [(rows, 1)] * (k - 1) if rows and k else []


def break_even_confidence(target: ServiceCost, draft: ServiceCost, rows: int, drafting: int,
                          k: int, plain_steps: int = 1) -> float:
    """The least probability of being accepted at which a drafted token pays for itself, in
    a step of `rows` rows of which `drafting` draft up to k tokens each: what one more
    verified token and one more draft forward cost a row, over what a committed token is
    worth (a plain token's time per row, `plain_steps` of them a command). Where a draft's
    probability of its drafts tracks their acceptance, drafts are cut where it falls below
    this (ProposeCommand)."""
    plain = target.predict(target.verify_calls(rows, 0, 0))
    if drafting < 1 or k < 1 or plain <= 0:
        return 0.0
    verify = max(0.0, target.predict(target.verify_calls(rows, drafting, k)) - plain)
    forwards = max(0.0, draft.predict(draft_calls(drafting, 1, k))
                   - draft.predict(draft_calls(drafting, 1, 1)))
    per_token = verify / (drafting * k) + forwards / (drafting * max(k - 1, 1))
    return min(1.0, per_token * rows / target.plain_s(rows, plain_steps))


@dataclasses.dataclass(frozen=True)
class Option:
    """One draft kind as it stands for one row."""

    acceptance: float
    catch_up: int = 1  # tokens that draft must be fed before proposing (>= 1)
    explore: bool = False  # not tried on this row for long: must draft this step
    cold: bool = False  # that draft holds nothing of the row yet (prefilled if picked)
    prefill: int = 0  # tokens that prefill feeds (cold rows)
    # already proposed this step (a draft asked for every row before planning): its cost is
    # paid, and it has at most this many tokens to offer
    offered: int | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a cohort as the planner sees it. With one draft kind, `acceptance`,
    `catch_up` and `explore` describe it; with several, `choices` has one entry per kind
    (None: that kind cannot draft for this row now)."""

    acceptance: float = 0.0
    catch_up: int = 1
    explore: bool = False
    choices: tuple[Option | None, ...] = ()
    # the most drafts worth verifying: a step commits at most a row's drafts and one more
    # token, so a row with n tokens left to commit gains nothing from drafts past n - 1 (and
    # drafts nothing on its last token); None: no end in sight
    room: int | None = None

    def drafts(self, k: int) -> int:
        """What the row drafts in a plan of K = k (k itself short of its end)."""
        return k if self.room is None else max(0, min(k, self.room))

    def options(self) -> tuple[Option | None, ...]:
        return self.choices or (Option(self.acceptance, self.catch_up, self.explore),)


@dataclasses.dataclass(frozen=True)
class Plan:
    k: list[int]  # per row, in the cohort's order
    tokens_per_s: float  # the expected goodput of this plan
    kinds: list[int | None] | None = None  # per row, the draft kind (None: all kind 0)

    def kind(self, i: int) -> int | None:
        if not self.k[i]:
            return None
        return self.kinds[i] if self.kinds is not None else 0


class GoodputPolicy:
    """drafts: one ServiceCost per draft kind (None: not calibrated); target: the target's."""

    def __init__(self, config: GoodputConfig, drafts: list[ServiceCost | None],
                 target: ServiceCost | None, hosted: frozenset[int] = frozenset()):
        """hosted: the draft kinds whose commands run config.rounds (the target's hosted
        draft, and lookups: their lines)."""
        self.config = config
        self.drafts = list(drafts)
        self.target = target
        self.hosted = hosted
        # running acceptance over every row, per (draft kind, sampling band): (mean, trials
        # behind it)
        self._means: dict[tuple[int, int], tuple[float, float]] = {}
        # per draft kind, decayed sums of (accepted drafts, what the model above expected of
        # those proposals): the geometric model misjudges drafts whose acceptance is
        # all-or-nothing (a lookup either copies on or fails at once), so a kind's expected
        # gain is scaled by what it actually delivered
        self._delivered: dict[int, tuple[float, float]] = {}
        self._plans_since: dict[int, int] = {}  # per kind, plans since it last drafted

    def usable(self, kind: int) -> bool:
        cost = self.drafts[kind] if kind < len(self.drafts) else None
        return bool(cost and cost.forwards)

    @property
    def calibrated(self) -> bool:
        return bool(self.target and self.target.forwards) and any(
            self.usable(d) for d in range(len(self.drafts)))

    def acceptance(self, state: RowState, kind: int = 0) -> float:
        """A row's per-token acceptance with one draft kind: its own decayed evidence, behind a
        prior of prior_weight observations at that kind's running mean over all rows of its
        sampling band."""
        w = self.config.prior_weight
        mean = self._means.get((kind, state.band), (self.config.prior_acceptance, 0.0))[0]
        estimate = (state.accepted + w * mean) / (state.accepted + state.rejected + w)
        return min(0.99, max(0.01, estimate))

    def observe(self, state: RowState, num_drafts: int, num_accepted: int,
                kind: int = 0) -> None:
        if num_drafts:
            self._plans_since[kind] = 0
            expected = expected_tokens(self.acceptance(state, kind), num_drafts) - 1.0
            got, hoped = self._delivered.get(kind, (0.0, 0.0))
            keep = self.config.delivered_decay
            self._delivered[kind] = (got * keep + num_accepted, hoped * keep + expected)
        state.observe(num_drafts, num_accepted, self.config.decay)
        if num_drafts:
            trials = num_accepted + (1 if num_accepted < num_drafts else 0)
            # weight counts real trials; the prior weighs as min_evidence of them, so one
            # lucky first step (two drafts, both accepted) does not make every row's estimate
            # 0.99 and the next plan draft K = 4 for a whole large batch on its word
            key = (kind, state.band)
            mean, weight = self._means.get(key, (self.config.prior_acceptance, 0.0))
            weight = min(weight + trials, 1000.0)
            mean += (num_accepted / trials - mean) * trials / (weight + self.config.min_evidence)
            self._means[key] = (mean, weight)

    def delivered(self, kind: int) -> float:
        """Accepted drafts over those the acceptance model expected, for one kind (1 until it
        has evidence; within [0.25, 1.5])."""
        got, hoped = self._delivered.get(kind, (0.0, 0.0))
        if hoped < self.config.min_evidence:
            return 1.0
        return min(1.5, max(0.25, got / hoped))

    def choice(self, state: RowState, catch_up: int, kind: int, cold: bool = False,
               prefill: int = 0) -> Option:
        """One row's standing with one kind (the rules: the module's docstring and
        GoodputConfig). Not forced but optimistic when idle, since forcing one row widens its
        whole cohort's verify. cold: the draft holds nothing of the row yet (picking it costs
        a prefill of `prefill` tokens, kept only then); plan() lets at most one cold row per
        kind explore, none if a held row does."""
        short = self._means.get((kind, state.band), (0.0, 0.0))[1] < self.config.min_evidence
        starved = self._plans_since.get(kind, 0) >= self.config.starve_every
        acceptance = self.acceptance(state, kind)
        if cold:
            return Option(acceptance, 1, explore=short or starved, cold=True, prefill=prefill)
        idle = state.idle_steps >= self.config.explore_every
        if idle:
            acceptance = max(acceptance, self.config.optimism)
        # a starved kind is forced on the rows idle with it: they draft in one step together
        return Option(acceptance, catch_up, explore=short or (starved and idle))

    def plan(self, rows: list[Row]) -> Plan:
        """The plan with the most expected tokens per second. Without calibrated costs every
        row drafts max_k, with the kind it accepts best (the fixed-K behaviour)."""
        rows = _few_explorers(_one_cold_explorer(rows), self.config.explorers)
        for kind in range(len(self.drafts)):
            self._plans_since[kind] = self._plans_since.get(kind, 0) + 1
        if not self.calibrated:
            return self._fixed(rows)
        if self.target.stale(1, self.config.measure_plain_every):
            return self._best_for(rows, 0, ())  # the yardstick, measured
        must = {kind for r in rows for kind, c in enumerate(r.options()) if c and c.explore
                and self.usable(kind)}
        hopeless = {kind for kind in must if not self._could_pay(kind, rows)}
        if hopeless:  # evidence could not change the plan here: gathering it is waste
            rows = [_not_exploring(r, hopeless) for r in rows]
            must -= hopeless
        candidates = list(range(1 if must else 0, self.config.max_k + 1))
        plans = []
        for k in candidates:
            plans += [self._best_for(rows, k, kinds) for kinds in self._kind_sets(rows, must)] \
                if k else [self._best_for(rows, 0, ())]
        best = max(plans, key=lambda p: p.tokens_per_s)
        plain = plans[0] if candidates[0] == 0 else None
        if plain is not None and best.tokens_per_s < plain.tokens_per_s * (1 + self.config.margin):
            return plain
        return best

    def _plain_rate(self, batch: int) -> float:
        """Tokens a second of `batch` rows decoding plainly, plain_steps tokens a command."""
        return batch / self.target.plain_s(batch, self.config.plain_steps)

    def _could_pay(self, kind: int, rows: list[Row]) -> bool:
        """Whether drafting with `kind` could beat plain decoding for this cohort if every
        row it can draft for accepted at `optimism` (its best case as exploration sees it).
        Where even that loses (wide verifies at their full price, as at large batches on a
        CPU, or a lookup with something to offer for few of many rows), no acceptance
        evidence would change a plan, so none is bought. "Beat" means by explore_margin."""
        batch = len(rows)
        able = sum(1 for r in rows if r.drafts(1)
                   and kind < len(r.options()) and r.options()[kind])
        plain = self._plain_rate(batch) * (1 + self.config.explore_margin)
        gain = self.delivered(kind)
        for k in range(1, self.config.max_k + 1):
            tokens = batch + able * (expected_tokens(self.config.optimism, k) - 1) * gain
            seconds = self._round_s(self.target.predict(self.target.verify_calls(batch, able, k)),
                                    {kind: self.drafts[kind].predict(draft_calls(able, 1, k))})
            if tokens / seconds > plain:
                return True
        return False

    def _kind_sets(self, rows: list[Row], must: set[int]) -> list[tuple[int, ...]]:
        """The sets of draft kinds a step may call: every non-empty set of usable kinds that
        some row can use, holding the kinds that must draft."""
        usable = [d for d in range(len(self.drafts)) if self.usable(d)
                  and any(d < len(r.options()) and r.options()[d] for r in rows)]
        sets = [tuple(d for j, d in enumerate(usable) if mask >> j & 1)
                for mask in range(1, 1 << len(usable))]
        return [s for s in sets if must <= set(s)] or [tuple(usable)]

    def _best_for(self, rows: list[Row], k: int, kinds: tuple[int, ...] = (0,)) -> Plan:
        """With K = k and the given draft kinds, the best set of drafting rows and each one's
        kind: rows that must draft first, then (row, kind) pairs by expected gain, as many
        as pay."""
        batch = len(rows)
        if k == 0 or not kinds:
            return Plan([0] * batch, self._plain_rate(batch), [None] * batch)
        pairs = []  # (required, gain, row, kind, catch_up, paid, prefill)
        for i, row in enumerate(rows):
            options = row.options()
            for d in kinds:
                c = options[d] if d < len(options) else None
                if c is None or not row.drafts(k):
                    continue
                required = c.explore
                drafts = row.drafts(k if c.offered is None else min(k, c.offered))
                gain = (expected_tokens(c.acceptance, drafts) - 1.0) * self.delivered(d)
                pairs.append((required, gain, i, d, c.catch_up, c.offered is not None,
                              c.prefill if c.cold else 0))
        pairs.sort(key=lambda p: (not p[0], -p[1]))
        required = len({p[2] for p in pairs if p[0]})
        counts, widths, draft_s, cold = {}, {}, {}, {}
        chosen, tokens, best = [], float(batch), None
        for _, gain, i, d, catch_up, paid, prefill in pairs:
            if any(i == j for j, _ in chosen):
                continue
            chosen.append((i, d))
            tokens += gain
            counts[d] = counts.get(d, 0) + 1
            widths[d] = max(widths.get(d, 1), catch_up)
            if prefill:  # (rows, longest prompt) of the cold rows it would prefill
                rows_cold, longest = cold.get(d, (0, 0))
                cold[d] = (rows_cold + 1, max(longest, prefill))
            draft_s[d] = 0.0 if paid else \
                self._draft_s(d, counts[d], widths[d], k) \
                + (self.drafts[d].predict([cold[d]]) / self.config.cold_horizon
                   if d in cold else 0.0)
            verify_s = self.target.predict(self.target.verify_calls(batch, len(chosen), k))
            rate = tokens / self._round_s(verify_s, draft_s)
            if len(chosen) >= required and (best is None or rate > best[1]):
                best = (len(chosen), rate)
        if best is None:  # no row can draft with these kinds
            return Plan([0] * batch, self._plain_rate(batch), [None] * batch)
        picked = dict(chosen[:best[0]])
        return Plan([row.drafts(k) if i in picked else 0 for i, row in enumerate(rows)],
                    best[1], [picked.get(i) for i in range(batch)])

    def _round_s(self, verify_s: float, draft_s: dict[int, float]) -> float:
        """Seconds a drafted step of these predicted verify and proposal times takes a
        round: where every kind drafting runs rounds (`hosted`), the command runs
        config.rounds of them and pays the target's command overhead once (each round's
        proposal pays its own)."""
        seconds = verify_s + sum(draft_s.values())
        if self.config.rounds > 1 and set(draft_s) <= self.hosted:
            seconds -= self.target.overhead_s * (1 - 1 / self.config.rounds)
        return max(seconds, 1e-9)

    def _draft_s(self, kind: int, rows: int, width: int, k: int) -> float:
        """Predicted seconds of a proposal of k drafts for `rows` rows, the widest feeding
        `width` tokens first: a steady step's, plus what a wider catch-up costs more, spread
        over cold_horizon steps (see the module docstring)."""
        cost = self.drafts[kind]
        steady = cost.predict(draft_calls(rows, min(width, STEADY_WIDTH), k))
        if width <= STEADY_WIDTH:
            return steady
        extra = cost.predict(draft_calls(rows, width, k)) - steady
        return steady + max(0.0, extra) / self.config.cold_horizon

    def _fixed(self, rows: list[Row]) -> Plan:
        """Every row drafts max_k, with the kind it must explore, else the one it accepts
        best; a row no kind can draft for drafts nothing."""
        k, kinds = [], []
        for row in rows:
            options = [(d, c) for d, c in enumerate(row.options()) if c is not None]
            if options:
                kind = max(options, key=lambda o: (o[1].explore, o[1].acceptance))[0]
                n = row.drafts(self.config.max_k)
            else:
                kind, n = None, 0
            k.append(n)
            kinds.append(kind if n else None)
        return Plan(k, math.nan, kinds)


def _not_exploring(row: Row, kinds: set[int]) -> Row:
    """The row with its choices of `kinds` no longer exploring (the row itself when none
    was: most plans change nothing, and then nothing is copied)."""
    choices = tuple(dataclasses.replace(c, explore=False) if c is not None and c.explore
                    and d in kinds else c for d, c in enumerate(row.options()))
    if choices == row.options():
        return row
    return dataclasses.replace(row, choices=choices, explore=False)


def _few_explorers(rows: list[Row], limit: int) -> list[Row]:
    """The rows with, per draft kind, at most `limit` exploring it: held rows before cold
    ones, those with the least to catch up on (the cheapest to draft) first, then the
    cohort's order, so the same cohort always explores with the same rows."""
    ranked = sorted(((c.cold, c.catch_up, i, d) for i, r in enumerate(rows)
                     for d, c in enumerate(r.options()) if c and c.explore))
    kept: dict[int, int] = {}
    dropped: dict[int, set[int]] = {}
    for _, _, i, d in ranked:
        kept[d] = kept.get(d, 0) + 1
        if kept[d] > limit:
            dropped.setdefault(i, set()).add(d)
    return [_not_exploring(r, dropped[i]) if i in dropped else r for i, r in enumerate(rows)]


def _one_cold_explorer(rows: list[Row]) -> list[Row]:
    """The rows with, per draft kind, at most one cold row exploring it, and none when a row
    it holds explores it: one prefill buys the evidence."""
    taken: set[int] = {d for r in rows for d, c in enumerate(r.options())
                       if c and c.explore and not c.cold}
    out = []
    for row in rows:
        cold = {d for d, c in enumerate(row.options()) if c and c.explore and c.cold}
        out.append(_not_exploring(row, cold & taken))
        taken |= cold
    return out
