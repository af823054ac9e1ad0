"""Measured truth beside the goodput policy's predictions: does drafting pay here?

The policy plans from predicted costs and acceptances; this keeps what steps actually
delivered: committed tokens per second of the engine's own time (from choosing the cohort to
streaming its tokens, draft prefills included; admissions and turnover copies, which the
server pays whether it drafts or not, left out: drafting.turnover_seconds) of drafted steps
and of plain steps, per batch-size bucket. Where drafted steps measure slower than plain ones,
greedy cohorts step aside (decode plainly, asking no draft at all, so they cost what the same
server without drafts costs); where they measure faster again, the policy plans as before.
Each side is kept measured: while one is chosen, the other is tried every few steps of its
bucket.

Invariants: a decision changes only when the measured rates differ by more than `margin`
(hysteresis), and only once both sides have `min_steps` steps of evidence, so timing noise does
not flip it step to step; probes of a settled decision grow rarer (backoff). A new bucket
decodes plainly until its plain side has `min_steps` steps: the yardstick is measured before
anything is weighed against it. Pure Python, no clock: callers pass the seconds they measured.
"""
import dataclasses
import enum


class Choice(enum.Enum):
    PLAN = "plan"  # let the policy plan (it may still choose plain decoding)
    PLAIN = "plain"  # step aside: every row decodes plainly, no draft is asked


@dataclasses.dataclass(frozen=True)
class EvidenceConfig:
    min_steps: int = 6  # steps of each side in a bucket before they are compared
    # ... but drafted steps, which cost most exactly where drafting loses, count as enough
    # after this many when the two sides differ by more than `clear_share`
    min_clear_steps: int = 2
    decay: float = 0.95  # weight kept by older steps, per step of that side and bucket
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

    def __post_init__(self):
        if not 1 <= self.min_clear_steps <= self.min_steps:
            raise ValueError("min_clear_steps must be in [1, min_steps]")
        if self.probe_every < 2 or self.clear_factor < 1 or self.max_backoff < 1:
            raise ValueError("probe_every must be >= 2, clear_factor and max_backoff >= 1")
        if not 0 < self.decay < 1 or not 0 <= self.margin < 1:
            raise ValueError("decay must be in (0, 1) and margin in [0, 1)")


@dataclasses.dataclass
class Rate:
    """Tokens per second of one side in one bucket: decayed sums of tokens and of seconds
    (a ratio of sums, so a few slow steps weigh by their time, not as outliers)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class Bucket:
    drafted: Rate = dataclasses.field(default_factory=Rate)
    plain: Rate = dataclasses.field(default_factory=Rate)
    aside: bool = False  # drafting measured slower: step aside
    since_probe: int = 0  # steps since the side not chosen was last tried
    backoff: int = 1  # the probe interval's factor (see EvidenceConfig.max_backoff)


def bucket_of(rows: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, 9-16, ... share a bucket (0, 1, 2, 3, 4, ...)."""
    return max(0, rows - 1).bit_length()


class Evidence:
    def __init__(self, config: EvidenceConfig = EvidenceConfig()):
        self.config = config
        self.buckets: dict[int, Bucket] = {}

    def choose(self, rows: int) -> Choice:
        """For a greedy cohort of `rows`: plan, or step aside. Called once per such step."""
        bucket = self.buckets.setdefault(bucket_of(rows), Bucket())
        if bucket.plain.steps < self.config.min_steps:
            # the yardstick first: a plain step costs what the server without drafts pays,
            # so a bucket where drafting loses pays only for the few drafted steps that show
            # it (min_clear_steps), never for a start-up stretch of the plan's guesses
            return Choice.PLAIN
        bucket.since_probe += 1
        if bucket.since_probe >= self._probe_every(rows) * bucket.backoff:
            bucket.since_probe = 0
            bucket.backoff = min(2 * bucket.backoff, self.config.max_backoff)
            return Choice.PLAN if bucket.aside else Choice.PLAIN
        return Choice.PLAIN if bucket.aside else Choice.PLAN

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A verified step: whether any row verified drafts, the tokens it committed and the
        seconds it took."""
        config = self.config
        bucket = self.buckets.setdefault(bucket_of(rows), Bucket())
        if drafted == bucket.aside and seconds > 0:  # a probe of the side not chosen ...
            chosen = bucket.plain if drafted else bucket.drafted
            if tokens / seconds > chosen.per_second * (1 + config.margin):
                bucket.backoff = 1  # ... that disagrees with the decision: check again soon
        (bucket.drafted if drafted else bucket.plain).add(tokens, seconds, config.decay)
        if bucket.plain.steps < config.min_steps or not bucket.drafted.steps:
            return
        ratio = bucket.drafted.per_second / max(bucket.plain.per_second, 1e-9)
        clear = abs(ratio - 1) > config.clear_share
        if bucket.drafted.steps < (config.min_clear_steps if clear else config.min_steps):
            return
        if not bucket.aside and ratio < 1 - config.margin:
            bucket.aside, bucket.backoff = True, 1
        elif bucket.aside and ratio > 1 + config.margin:
            bucket.aside, bucket.backoff = False, 1

    def _probe_every(self, rows: int) -> int:
        ratio = self.ratio(rows)
        clear = ratio is not None and abs(ratio - 1) > self.config.clear_share
        return self.config.probe_every * (self.config.clear_factor if clear else 1)

    def ratio(self, rows: int) -> float | None:
        """Drafted over plain tokens per second in the bucket of `rows` (None: unmeasured)."""
        bucket = self.buckets.get(bucket_of(rows))
        if bucket is None or not (bucket.drafted.seconds and bucket.plain.seconds):
            return None
        return bucket.drafted.per_second / bucket.plain.per_second
