"""When a forward computes only its real positions: the rule the target's runner follows and
the coordinator's cost model prices (no torch here).

Where the runner packs positions (fastlinear.only_positions) its linear layers skip the right
padding of rows that feed fewer tokens than the widest one. Packing has costs of its own: the
real positions are gathered and scattered around every block and attention runs by runs of
rows, while the linear kernels cost about the same for a few positions more or less. Verifies
of SmolLM2-135M on a 2-core x86 CPU, packed and padded taken in turn (`python3
scripts/verify_width.py --k 1 --min-padding 1,1000000`): with 8 rows, 7 of them drafting one
token (1 padded position) cost 85 ms packed against 73 padded, 4 of them (4 positions) the
same either way, 1 of them (7) 74 against 76; with 16 rows, 12 drafting (4) 131 against 121,
8 drafting (8) the same, 1 drafting (15) 107 against 121. So a forward is packed only from
MIN_PADDING padded positions on.
"""
MIN_PADDING = 6


def worth_packing(padding: int) -> bool:
    """Whether a forward with `padding` padded positions (over all its rows) is packed."""
    return padding >= MIN_PADDING


def verify_padding(batch: int, drafting: int, k: int) -> int:
    """Padded positions of a verify of `batch` rows, `drafting` of them with k drafts and the
    others none."""
    return (batch - drafting) * k
