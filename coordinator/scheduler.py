"""Choosing the next group of sequences to step (EXSPEC grouping with a realigning fallback).

A group of equal committed length needs no realignment in either service: every row's target
cache is L - 1 long and every row feeds the same number of tokens. Only when no such group is
worth running (or a sequence has waited too long) do we take a mixed group, which the
services left-pad (a cost we count and keep rare).
"""
import dataclasses
from collections import defaultdict

from coordinator.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class GroupPolicy:
    batch_size: int = 8
    # A same-length group smaller than this share of the batch we could fill is not worth
    # running alone; a mixed (realigned) group is taken instead.
    min_fill: float = 0.5
    # A sequence not stepped for this many steps forces a mixed group that includes it.
    max_wait_steps: int = 4
    # False: no same-length grouping; every step takes the longest-waiting batch_size
    # sequences and realigns them (the EQSPEC way, kept for comparison).
    grouping: bool = True

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= self.min_fill <= 1:
            raise ValueError("min_fill must be in [0, 1]")
        if self.max_wait_steps < 1:
            raise ValueError("max_wait_steps must be >= 1")


@dataclasses.dataclass(frozen=True)
class Group:
    sequences: list[Sequence]
    mixed: bool  # rows have different committed lengths: the services must realign


def pick_group(active: list[Sequence], policy: GroupPolicy, step: int) -> Group | None:
    """The next group to step, or None when nothing is active."""
    if not active:
        return None
    by_age = sorted(active, key=lambda s: (s.last_step, s.seq_id))
    if not policy.grouping:
        group = by_age[:policy.batch_size]
        return Group(group, mixed=len({s.committed_len for s in group}) > 1)
    starved = [s for s in by_age if step - s.last_step > policy.max_wait_steps]
    best = _largest_bucket(active)
    wanted = min(policy.batch_size, len(active))
    if not starved and len(best) >= max(1, policy.min_fill * wanted):
        return Group(best[:policy.batch_size], mixed=False)
    lengths = {s.committed_len for s in by_age[:policy.batch_size]}
    if len(lengths) == 1:
        return Group(by_age[:policy.batch_size], mixed=False)
    return Group(by_age[:policy.batch_size], mixed=True)


def _largest_bucket(active: list[Sequence]) -> list[Sequence]:
    """The biggest set of equal-length sequences, longest-waiting first; ties go to the
    bucket holding the longest-waiting sequence."""
    buckets: dict[int, list[Sequence]] = defaultdict(list)
    for s in sorted(active, key=lambda s: (s.last_step, s.seq_id)):
        buckets[s.committed_len].append(s)
    return max(buckets.values(), key=lambda b: (len(b), -b[0].last_step, -b[0].seq_id))


def split_by_tokens(sequences: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Consecutive runs of sequences whose cached prefixes (all committed tokens but the
    last) total at most `budget` tokens, in order; a longer one goes alone. One run is one
    prefill command, so no command runs unboundedly long."""
    runs, run, total = [], [], 0
    for s in sequences:
        size = s.committed_len - 1
        if run and total + size > budget:
            runs.append(run)
            run, total = [], 0
        run.append(s)
        total += size
    if run:
        runs.append(run)
    return runs


def draft_plan(sequences: list[Sequence]) -> tuple[list[Sequence], int]:
    """Rows that can share one proposal, and how many tokens each appends.

    Every row appends the same count T (the largest need), rolling its cache back further if
    its own need is smaller; rows shorter than T cannot and are left for a later step."""
    width = max(s.draft_append_need() for s in sequences)
    return [s for s in sequences if s.committed_len >= width], width
