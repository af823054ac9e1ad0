"""Draft length by goodput: per sequence and step, the K that maximises expected committed
tokens per second, K = 0 (plain decoding, no draft call) included.

The model of one step of a group of B rows, c of which draft K tokens:
- draft time: one forward of c rows feeding W tokens (W >= 1: the last committed token, plus
  any the draft missed while a row was at K = 0), then K - 1 forwards of one token; none when
  c = 0;
- verify time: one target forward of B rows feeding 1 + K tokens;
- each service's time = ratio x its calibrated forward time + a per-command overhead (RPC,
  encoding, bookkeeping), the ratio and the overhead kept current from live timings;
- a drafting row with per-token acceptance a commits 1 + a + ... + a^K tokens on average, a row
  at K = 0 commits one.
The plan is the K and the set of drafting rows (those most likely to accept) with the most
expected tokens per second. Rows whose acceptance is unknown for long are made to draft now
and then (exploration), so an estimate never freezes at a value that turned K off.

Pure Python: the coordinator stays free of torch.
"""
import bisect
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    max_k: int = 4  # the most a step may draft (the coordinator's -k)
    explore_every: int = 32  # a row not drafting for this many of its steps drafts once
    prior_acceptance: float = 0.6  # before any row has been verified
    prior_weight: float = 2.0  # pseudo-observations of the running mean behind each row's estimate
    decay: float = 0.9  # weight kept by older evidence, per step a row drafts
    # drafting must promise this much more than plain decoding (timings are noisy, and a
    # wrong bet costs more than a missed one)
    margin: float = 0.05

    def __post_init__(self):
        if not 1 <= self.max_k <= 32:
            raise ValueError("max_k must be in [1, 32]")
        if self.explore_every < 1 or not 0 < self.decay <= 1 or self.prior_weight <= 0:
            raise ValueError("explore_every >= 1, decay in (0, 1], prior_weight > 0")


@dataclasses.dataclass
class RowState:
    """What the policy knows of one sequence (kept on the Sequence)."""

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
    for each batch size a straight line in tokens (least squares, never decreasing), then
    never cheaper for more rows. Between grid points it interpolates linearly, and past the
    grid it extends the last slope."""

    def __init__(self, points):
        # points: (rows, tokens, seconds) triples
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for rows, tokens, seconds in points:
            by_rows.setdefault(rows, []).append((tokens, seconds))
        self._table: dict[int, dict[int, float]] = {}
        for rows in sorted(by_rows):
            for tokens, seconds in _line(by_rows[rows]):
                curve = self._table.setdefault(tokens, {})
                fewer = [curve[r] for r in curve if r < rows]
                curve[rows] = max([seconds] + fewer)
        self._tokens = sorted(self._table)

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def predict(self, rows: int, tokens: int) -> float:
        return _interpolate(self._tokens, lambda t: self._by_rows(t, rows), tokens)

    def _by_rows(self, tokens: int, rows: int) -> float:
        curve = self._table[tokens]
        sizes = sorted(curve)
        return _interpolate(sizes, curve.__getitem__, rows)


def _line(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The least-squares line through (tokens, seconds), slope >= 0, at the same tokens."""
    if len(points) < 2:
        return points
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    slope = max(0.0, sum((t - mean_t) * (s - mean_s) for t, s in points) / spread) \
        if spread else 0.0
    return [(t, mean_s + slope * (t - mean_t)) for t, _ in points]


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
    kept per command size (tokens fed, summed over the command's forwards) as well as overall,
    since a calibration off in its slope (masks, copies, longer contexts than it measured)
    would otherwise make more tokens look cheaper than they are; a size not seen yet uses the
    overall ratio."""

    def __init__(self, forwards: ForwardCosts, smoothing: float = 0.1):
        self.forwards = forwards
        self.ratio = 1.0  # measured forward time / calibrated forward time, all commands
        self.ratios: dict[int, float] = {}  # the same, per command size
        self.overhead_s = 0.0  # round trip minus forward time
        self._smoothing = smoothing
        self._seen = False

    @staticmethod
    def size(calls: list[tuple[int, int]]) -> int:
        return sum(tokens for _, tokens in calls)

    def predict(self, calls: list[tuple[int, int]]) -> float:
        """Seconds of one command running forwards of (rows, tokens)."""
        ratio = self.ratios.get(self.size(calls), self.ratio)
        return ratio * sum(self.forwards.predict(r, t) for r, t in calls) + self.overhead_s

    def observe(self, calls: list[tuple[int, int]], forward_s: float, round_trip_s: float) -> None:
        predicted = sum(self.forwards.predict(r, t) for r, t in calls)
        overhead = max(0.0, round_trip_s - forward_s)
        if predicted <= 0 or forward_s <= 0:
            return
        measured, size, a = forward_s / predicted, self.size(calls), self._smoothing
        if not self._seen:
            self.ratio, self.overhead_s, self._seen = measured, overhead, True
        self.ratio += a * (measured - self.ratio)
        self.overhead_s += a * (overhead - self.overhead_s)
        known = self.ratios.get(size)
        self.ratios[size] = measured if known is None else known + a * (measured - known)


def draft_calls(rows: int, width: int, k: int) -> list[tuple[int, int]]:
    """The forwards of one proposal: the appended tokens, then one per further draft."""
    return [(rows, width)] + [(rows, 1)] * (k - 1) if rows and k else []


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a group as the planner sees it."""

    acceptance: float
    catch_up: int = 1  # tokens the draft must be fed before proposing (>= 1)
    forced_k: int | None = None  # must draft exactly this many (seeded sampling: repeatable)
    explore: bool = False  # must draft at least one token this step


@dataclasses.dataclass(frozen=True)
class Plan:
    k: list[int]  # per row, in the group's order
    tokens_per_s: float  # the expected goodput of this plan


class GoodputPolicy:
    def __init__(self, config: GoodputConfig, draft: ServiceCost | None,
                 target: ServiceCost | None):
        self.config = config
        self.draft = draft
        self.target = target
        self._mean = config.prior_acceptance  # running acceptance over every row
        self._mean_weight = 0.0

    @property
    def calibrated(self) -> bool:
        return bool(self.draft and self.draft.forwards and self.target and self.target.forwards)

    def acceptance(self, state: RowState) -> float:
        """A row's per-token acceptance: its own decayed evidence, behind a prior of
        prior_weight observations at the running mean over all rows."""
        w = self.config.prior_weight
        estimate = (state.accepted + w * self._mean) / (state.accepted + state.rejected + w)
        return min(0.99, max(0.01, estimate))

    def observe(self, state: RowState, num_drafts: int, num_accepted: int) -> None:
        state.observe(num_drafts, num_accepted, self.config.decay)
        if num_drafts:
            trials = num_accepted + (1 if num_accepted < num_drafts else 0)
            self._mean_weight = min(self._mean_weight + trials, 1000.0)
            rate = num_accepted / trials
            self._mean += (rate - self._mean) * trials / self._mean_weight

    def row(self, state: RowState, catch_up: int, forced_k: int | None = None) -> Row:
        return Row(self.acceptance(state), catch_up, forced_k,
                   explore=state.idle_steps >= self.config.explore_every)

    def plan(self, rows: list[Row]) -> Plan:
        """The plan with the most expected tokens per second. Without calibrated costs every
        row drafts max_k (the fixed-K behaviour)."""
        if not self.calibrated:
            k = [r.forced_k if r.forced_k is not None else self.config.max_k for r in rows]
            return Plan(k, math.nan)
        forced = {r.forced_k for r in rows if r.forced_k is not None}
        must = any(r.explore for r in rows)
        if forced:
            candidates = [max(forced)]
        else:
            candidates = list(range(1 if must else 0, self.config.max_k + 1))
        plans = [self._best_for(rows, k) for k in candidates]
        best = max(plans, key=lambda p: p.tokens_per_s)
        plain = plans[0] if candidates[0] == 0 else None
        if plain is not None and best.tokens_per_s < plain.tokens_per_s * (1 + self.config.margin):
            return plain
        return best

    def _best_for(self, rows: list[Row], k: int) -> Plan:
        """With K = k, the best number of drafting rows: rows that must draft first, then the
        rest by acceptance, as many as pay."""
        batch = len(rows)
        verify_s = self.target.predict([(batch, 1 + k)])
        if k == 0:
            return Plan([0] * batch, batch / verify_s)
        order = sorted(range(batch), key=lambda i: (
            not (rows[i].forced_k is not None or rows[i].explore), -rows[i].acceptance))
        required = sum(1 for r in rows if r.forced_k is not None or r.explore)
        best, tokens, width = None, float(batch), 1
        for count, i in enumerate(order, start=1):
            row = rows[i]
            tokens += expected_tokens(row.acceptance, k) - 1.0
            width = max(width, row.catch_up)
            seconds = verify_s + self.draft.predict(draft_calls(count, width, k))
            rate = tokens / seconds
            if count >= required and (best is None or rate > best[1]):
                best = (count, rate)
        chosen = set(order[:best[0]])
        return Plan([k if i in chosen else 0 for i in range(batch)], best[1])
