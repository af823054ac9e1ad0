"""Measured truth beside the goodput policy's predictions: does drafting pay here?

The policy plans from predicted costs and acceptances; this keeps what steps actually
delivered: committed tokens per second of the engine's own time (from choosing the cohort to
streaming its tokens, draft prefills included; admissions and turnover copies, which the
server pays whether it drafts or not, left out: policy.DraftingPolicy.realign_shares) of
drafted steps and of plain steps, per batch-size bucket. Where drafted steps measure slower
than plain ones, cohorts step aside (decode plainly, asking no model draft, so they cost what
the same server without drafts costs; a cohort of at most `cheap_probe_rows` still drafts what
the lookups offer, steps weighed on neither side: lookups_aside); where they measure faster
again, the policy plans as before.
Each side is kept measured: while one is chosen, the other is tried every few steps of its
bucket.

The comparison is paired. Whenever a bucket's step is of the other side than its step before,
the two adjacent steps form a pair, and the decision follows the throughput of the pairs'
drafted steps over that of their plain steps: decayed sums of each side's tokens over decayed
sums of its seconds, every pair adding to both sides at once. Two adjacent steps ran on the
machine as it was then, so a machine that slows down or speeds up (other processes, its host)
moves both sides alike, where sums of each side's own steps would compare a yardstick taken at
one speed with drafted steps taken at another (a yardstick taken while the machine ran slow
makes drafted steps that lose look as fast). Throughput, not a mean of each pair's ratio of
rates: a lone row's drafted steps commit 1 to K + 1 tokens, and a (geometric) mean of per-step
rates weighs the many one-token steps against the few long ones more than the tokens they
deliver do, so it underrates drafting, and a bucket once aside would rarely show the 1 +
margin it needs to come back. Until a bucket has decided, its
steps alternate after the yardstick, so the pairs come at once.

A drafted step that ends a run of plain steps the evidence chose (the yardstick, or a stretch
aside) is a warm-up, weighed on neither side: it pays, once, for the draft catching up on every
token it missed and for its prefill of prompts it has not seen, which the drafted steps after
it do not pay. Weighed as one pair among a few decayed ones, that one-off cost makes drafting
that pays look like it loses (a lone row aside probed every 12 steps has its draft catch up 12
tokens at each probe, and stays aside). So the step after a warm-up drafts too, and it is the
one paired with the plain step that follows.

Probes are paced in tokens a row, not in commands: a plain command may decode several tokens a
row (`observe`'s `steps`), and `room` says how many the next one may decode before a probe falls
due, so a bucket aside is probed, and its draft catches up, as often in tokens as when every
command decoded one. A drafted step counts one (or, where it verified no draft and decoded
several tokens a row, that many).

Invariants: a decision changes only when the paired ratio differs from 1 by more than
`margin` (hysteresis), and only once the bucket has `min_pairs` pairs (`min_clear_pairs`
where the two sides differ by more than `clear_share`), so timing noise does not flip it step
to step; probes of a settled decision grow rarer (backoff), except from aside in a bucket of
one or two rows, where a probe costs little. A new bucket decodes plainly for
its first `min_steps` steps: the yardstick is measured before anything is weighed against it.
Pure Python, no clock: callers pass the seconds they measured.
"""
import dataclasses
import enum


class Decision(enum.Enum):
    PLAN = "plan"  # let the policy plan (it may still choose plain decoding)
    PLAIN = "plain"  # step aside: every row decodes plainly, no draft is asked


@dataclasses.dataclass(frozen=True)
class EvidenceConfig:
    min_steps: int = 6  # plain steps of a new bucket before any drafting (the yardstick)
    min_pairs: int = 6  # pairs of adjacent drafted and plain steps before a decision ...
    # ... but where the two sides differ by more than `clear_share`, this many suffice:
    # drafted steps cost most exactly where drafting loses (3 pairs: 2 drafted steps)
    min_clear_pairs: int = 3
    pair_decay: float = 0.9  # weight kept by older pairs, per pair
    margin: float = 0.05  # how much slower (faster) drafting must measure to step aside (back)
    probe_every: int = 12  # steps of a bucket between tries of the side not chosen
    # where the two sides differ by more than this share, the side not chosen is tried only
    # every `probe_every * clear_factor` steps (a clear case needs less checking)
    clear_share: float = 0.25
    clear_factor: int = 4
    # each probe doubles the interval to the next one, up to this factor, unless it measured
    # better than the side chosen (then, as when the decision flips, it starts again at 1):
    # a settled bucket, above all a large batch where drafting loses, pays for probes ever
    # more rarely
    max_backoff: int = 4
    # a bucket of at most this many rows, aside, tries drafting every `probe_every` steps, with
    # no clear_factor or backoff: there a probe is one row's drafted step, a fraction of a
    # step lost at worst, while a lone request kept aside wrongly loses all its gain (aside
    # after a stretch of hard prompts, a one-row bucket probed every 192 steps came back
    # only after about 1,000, a whole benchmark run)
    cheap_probe_rows: int = 2

    def __post_init__(self):
        if not 1 <= self.min_clear_pairs <= self.min_pairs or self.min_steps < 1:
            raise ValueError("min_steps >= 1 and min_clear_pairs in [1, min_pairs]")
        if self.probe_every < 2 or self.clear_factor < 1 or self.max_backoff < 1 \
                or self.cheap_probe_rows < 0:
            raise ValueError("probe_every must be >= 2, clear_factor and max_backoff >= 1, "
                             "cheap_probe_rows >= 0")
        if not 0 < self.pair_decay < 1 or not 0 <= self.margin < 1:
            raise ValueError("pair_decay must be in (0, 1) and margin in [0, 1)")


@dataclasses.dataclass
class Step:
    drafted: bool
    tokens: int
    seconds: float
    # weighed on neither side: a warm-up (it pays the draft's one-off catch-up), or a
    # drafted step that verified no draft and decoded several tokens a row (`observe`)
    unweighed: bool = False

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclasses.dataclass
class Pairs:
    """Adjacent drafted and plain steps compared: decayed sums of each side's tokens and
    seconds, one term per pair on both sides (so each side's sums weigh the same pairs)."""

    drafted_tokens: float = 0.0
    drafted_seconds: float = 0.0
    plain_tokens: float = 0.0
    plain_seconds: float = 0.0
    count: int = 0

    def add(self, drafted: Step, plain: Step, decay: float) -> None:
        self.drafted_tokens = decay * self.drafted_tokens + drafted.tokens
        self.drafted_seconds = decay * self.drafted_seconds + drafted.seconds
        self.plain_tokens = decay * self.plain_tokens + plain.tokens
        self.plain_seconds = decay * self.plain_seconds + plain.seconds
        self.count += 1

    @property
    def ratio(self) -> float | None:
        """Drafted steps' tokens per second over plain steps' (None before any pair)."""
        if not self.count:
            return None
        return (self.drafted_tokens / self.drafted_seconds) / (
            self.plain_tokens / self.plain_seconds)


@dataclasses.dataclass
class Bucket:
    plain_steps: int = 0  # plain steps so far (the yardstick comes first)
    pairs: Pairs = dataclasses.field(default_factory=Pairs)
    # its last two steps: `last` may still be charged what the step after it pays for it
    # (carried seconds), so it is weighed, and paired with `prev`, only once that step came
    prev: Step | None = None
    last: Step | None = None
    decided: bool = False  # enough pairs have been weighed once
    aside: bool = False  # drafting measured slower: step aside
    since_probe: int = 0  # steps since the side not chosen was last tried
    backoff: int = 1  # the probe interval's factor (see EvidenceConfig.max_backoff)
    plain_run: int = 0  # tokens a row decoded plainly since its last drafted step
    warming: bool = False  # its last step was a warm-up: the next one drafts too


def bucket_of(rows: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a bucket (0, 1, 2, 3, 4, ...)."""
    return max(0, rows - 1).bit_length()


class Evidence:
    """Buckets of greedy cohorts (`buckets`) and, apart, of cohorts with a sampled row
    (`sampled_buckets`): a draft matches sampled choices less often than greedy ones, so
    drafting may pay for one class of cohort and not for the other."""

    def __init__(self, config: EvidenceConfig = EvidenceConfig()):
        self.config = config
        self.buckets: dict[int, Bucket] = {}
        self.sampled_buckets: dict[int, Bucket] = {}

    def _bucket(self, rows: int, sampled: bool) -> Bucket:
        buckets = self.sampled_buckets if sampled else self.buckets
        return buckets.setdefault(bucket_of(rows), Bucket())

    def choose(self, rows: int, sampled: bool = False) -> Decision:
        """For a cohort of `rows` (with a sampled row, or greedy): plan, or step aside.
        Called once per such step."""
        bucket = self._bucket(rows, sampled)
        if bucket.plain_steps < self.config.min_steps:
            # the yardstick first: a plain step costs what the server without drafts pays,
            # so a bucket where drafting loses pays only for the few drafted steps that show
            # it, never for a start-up stretch of the plan's guesses
            return Decision.PLAIN
        if not bucket.decided:  # alternate: every step after the first makes a pair
            return Decision.PLAIN if bucket.last is not None and bucket.last.drafted \
                and not bucket.warming else Decision.PLAN
        bucket.since_probe += 1
        if bucket.warming:  # the step after a warm-up drafts, so that a pair comes of it
            return Decision.PLAN
        if bucket.since_probe >= self._probe_interval(rows, bucket, sampled):
            bucket.since_probe = 0
            bucket.backoff = min(2 * bucket.backoff, self.config.max_backoff)
            return Decision.PLAN if bucket.aside else Decision.PLAIN
        return Decision.PLAIN if bucket.aside else Decision.PLAN

    def lookups_aside(self, rows: int) -> bool:
        """Whether a cohort of `rows` stepped aside still drafts what lookups offer (a bucket
        of at most `cheap_probe_rows`, where a lookup's line costs a fraction of a step at
        worst); larger cohorts aside decode plainly."""
        return rows <= self.config.cheap_probe_rows

    def room(self, rows: int, sampled: bool = False) -> int | None:
        """Tokens a row the command of a step just chosen plain may decode before the side not
        chosen is next tried; None: no bound (a bucket not yet decided, whose next step
        drafts, or one that just probed)."""
        bucket = self._bucket(rows, sampled)
        if not bucket.decided or bucket.since_probe == 0:
            return None
        return max(1, self._probe_interval(rows, bucket, sampled) - bucket.since_probe)

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float,
                carried: float = 0.0, sampled: bool = False, steps: int = 1,
                weighed: bool = True) -> None:
        """A verified step: whether any row verified drafts, the tokens it committed and the
        seconds it took; `carried` of them it paid for the bucket's step before (compacting
        the holes that step's rejected drafts left), which are charged to that step; `steps`:
        the tokens a row a command of plain steps decoded (counted as that many steps toward
        the next probe; a drafted step that verified no draft may have decoded several).
        Not `weighed`: the step is paired with neither neighbour (a drafted step that
        verified no draft and decoded several tokens a row: it says nothing of what drafted
        steps deliver, and weighed as drafted, its plain steps made a draft that loses look
        as fast as decoding plainly, so the bucket planned, and drafted, more)."""
        bucket = self._bucket(rows, sampled)
        bucket.plain_steps += not drafted
        steps = max(1, steps)
        if bucket.decided and bucket.since_probe:
            bucket.since_probe += steps - 1  # `choose` counted the command's first
        # plain steps the evidence chose: all of them aside, the yardstick before deciding
        warm_up = drafted and bucket.plain_run >= 2 and (bucket.aside or not bucket.decided)
        bucket.plain_run = 0 if drafted else bucket.plain_run + steps
        bucket.warming = warm_up
        if seconds <= 0 or tokens <= 0:
            return
        last, carried = bucket.last, min(max(carried, 0.0), 0.9 * seconds)
        bucket.last = Step(drafted, tokens, seconds - carried, warm_up or not weighed)
        if last is None:
            return
        last.seconds += carried
        prev, bucket.prev = bucket.prev, last
        if prev is not None and prev.drafted != last.drafted \
                and not (prev.unweighed or last.unweighed):
            self._pair(bucket, prev, last)

    def _pair(self, bucket: Bucket, before: Step, after: Step) -> None:
        """Weigh two adjacent steps of different sides."""
        config = self.config
        # of the two, the step of the side not chosen (a probe, once decided)
        probe, neighbour = (after, before) if after.drafted == bucket.aside else (before, after)
        if probe.rate > neighbour.rate * (1 + config.margin):
            bucket.backoff = 1  # a probe that disagrees with the decision: check again soon
        drafted, plain = (before, after) if before.drafted else (after, before)
        bucket.pairs.add(drafted, plain, config.pair_decay)
        self._decide(bucket)

    def _decide(self, bucket: Bucket) -> None:
        ratio = bucket.pairs.ratio
        clear = abs(ratio - 1) > self.config.clear_share
        if bucket.pairs.count < (self.config.min_clear_pairs if clear else self.config.min_pairs):
            return
        bucket.decided = True
        if not bucket.aside and ratio < 1 - self.config.margin:
            bucket.aside, bucket.backoff = True, 1
        elif bucket.aside and ratio > 1 + self.config.margin:
            bucket.aside, bucket.backoff = False, 1

    def _probe_interval(self, rows: int, bucket: Bucket, sampled: bool) -> int:
        """Steps between tries of the side not chosen."""
        if bucket.aside and rows <= self.config.cheap_probe_rows:
            return self.config.probe_every
        ratio = self.ratio(rows, sampled)
        clear = ratio is not None and abs(ratio - 1) > self.config.clear_share
        return self.config.probe_every * (self.config.clear_factor if clear else 1) \
            * bucket.backoff

    def ratio(self, rows: int, sampled: bool = False) -> float | None:
        """Drafted over plain tokens per second in the bucket of `rows`, as its pairs of
        adjacent steps measured them (None: no pair yet)."""
        bucket = (self.sampled_buckets if sampled else self.buckets).get(bucket_of(rows))
        return None if bucket is None else bucket.pairs.ratio
