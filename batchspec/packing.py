"""When a forward computes only its real positions: the rule the target's runner follows and
the coordinator's cost model prices (no torch here).

Where the runner packs positions (fastlinear.only_positions) its linear layers skip the right
padding of rows that feed fewer tokens than the widest one. Packing has costs of its own: the
real positions are gathered and scattered around every block and attention runs by runs of
rows, while the linear kernels cost about the same for a few positions more or less. So a
forward is packed only where it skips enough padding to pay for that: from MIN_PADDING padded
positions on (below it, packed and padded verifies cost about the same; a handful of padded
positions made packing a loss).
"""
MIN_PADDING = 6


def worth_packing(padding: int) -> bool:
    """Whether a forward with `padding` padded positions (over all its rows) is packed."""
    return padding >= MIN_PADDING


def verify_padding(batch: int, drafting: int, k: int) -> int:
    """Padded positions of a verify of `batch` rows, `drafting` of them with k drafts and the
    others none."""
    return (batch - drafting) * k
