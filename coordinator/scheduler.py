"""Choosing the next cohort of sequences to step: cohorts, formed by equal length (EXSPEC).

Sequences are stepped in cohorts of at most batch_size that stay together from step to step,
always in the same row order. Invariants:
- A cohort's rows are, in both services, exactly the rows of the batch it last ran as, so the
  services reuse that batch as it is: no copy, whatever each row accepted (the rows' rejected
  positions are masked). A change of membership makes the services copy only the newcomers,
  into the rows that left (past the rows a batch keeps vacant, they realign it whole).
- New cohorts are cut from equal committed lengths first (EXSPEC), then from neighbouring
  lengths: a cohort of one length starts with no padding at all.
- Membership changes only when it must: a sequence arrives, or finishing sequences leave two
  or more cohorts short. Then the newcomers and the short cohorts are re-formed together, which
  leaves at most one short cohort.
- Cohorts take turns, the one that waited longest first, so none starves.
"""
import dataclasses
from collections import defaultdict

from coordinator.sequence import Sequence, mixed


@dataclasses.dataclass(frozen=True)
class CohortPolicy:
    batch_size: int = 32  # a cohort has at most this many sequences (one batch in the services)

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")


@dataclasses.dataclass(frozen=True)
class Cohort:
    """The sequences one step takes, in their row order."""

    sequences: list[Sequence]

    @property
    def mixed(self) -> bool:
        return mixed(self.sequences)


def pick_cohort(active: list[Sequence], policy: CohortPolicy, step: int) -> Cohort | None:
    """The next cohort to step, or None when nothing is active. Places new sequences into
    cohorts (sets `Sequence.cohort`)."""
    if not active:
        return None
    cohorts = _place(active, policy.batch_size)
    oldest = min(cohorts, key=lambda c: (min(s.last_step for s in c), c[0].seq_id))
    return Cohort(oldest)


def _place(active: list[Sequence], batch_size: int) -> list[list[Sequence]]:
    """The active sequences' cohorts, each in seq_id order, after placing newcomers."""
    by_cohort: dict[int | None, list[Sequence]] = defaultdict(list)
    for s in sorted(active, key=lambda s: s.seq_id):
        by_cohort[s.cohort].append(s)
    loose = by_cohort.pop(None, [])
    short = [c for c in by_cohort if len(by_cohort[c]) < batch_size]
    if loose or len(short) > 1:
        loose += [s for c in short for s in by_cohort.pop(c)]
        for members in form_cohorts(loose, batch_size):
            for s in members:
                s.cohort = members[0].seq_id  # unique: a seq_id is never reused
            by_cohort[members[0].seq_id] = members
    return list(by_cohort.values())


def form_cohorts(sequences: list[Sequence], batch_size: int) -> list[list[Sequence]]:
    """Cut sequences into cohorts of at most batch_size: full cohorts of one committed length
    first (EXSPEC), then the rest in length order, so neighbours in length share a batch.
    Each cohort is in seq_id order."""
    by_length: dict[int, list[Sequence]] = defaultdict(list)
    for s in sorted(sequences, key=lambda s: s.seq_id):
        by_length[s.committed_len].append(s)
    cohorts, rest = [], []
    for length in sorted(by_length):
        bucket = by_length[length]
        full = len(bucket) - len(bucket) % batch_size
        cohorts += [bucket[i:i + batch_size] for i in range(0, full, batch_size)]
        rest += bucket[full:]
    cohorts += [rest[i:i + batch_size] for i in range(0, len(rest), batch_size)]
    return [sorted(c, key=lambda s: s.seq_id) for c in cohorts]


def split_by_tokens(sequences: list[Sequence], budget: int,
                    copied: frozenset[int] = frozenset()) -> list[list[Sequence]]:
    """Consecutive runs of sequences whose cached prefixes (all committed tokens but the
    last) total at most `budget` tokens, in order; a longer one goes alone. One run is one
    prefill command, so no command runs unboundedly long. A sequence in `copied` (its cache
    a copy of another's: no forward) counts no tokens."""
    runs, run, total = [], [], 0
    for s in sequences:
        size = 0 if s.seq_id in copied else s.committed_len - 1
        if run and total + size > budget:
            runs.append(run)
            run, total = [], 0
        run.append(s)
        total += size
    if run:
        runs.append(run)
    return runs


def draft_plan(sequences: list[Sequence], kind: int = 0) -> tuple[list[Sequence], int]:
    """Rows that can share one proposal of draft `kind`, and how many tokens each appends.

    Every row appends the same count T (the largest need), rolling its cache back further if
    its own need is smaller; rows shorter than T cannot and are left for a later step."""
    width = max(s.draft_append_need(kind) for s in sequences)
    return [s for s in sequences if s.committed_len >= width], width
