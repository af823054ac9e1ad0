"""When a forward computes only its real positions: the rule the target's runner follows and
the coordinator's cost model prices (no torch here).

Where the runner packs positions (fastlinear.only_positions) its linear layers skip the right
padding of rows that feed fewer tokens than the widest one. Packing has costs of its own: the
real positions are gathered and scattered around every block and attention runs by runs of
rows, while the linear kernels cost about the same for a few positions more or less. Verifies
of SmolLM2-135M on a 2-core x86 CPU, packed and padded taken step by step in turn
(scripts/verify_width.py at commit d840292, `--k 1 --min-padding 1,1000000`, medians of
3 rounds, ms): of 8 rows,
7 drafting one token (1 padded position) 70.9 packed against 66.2 padded, 4 drafting (4)
70.7 against 71.4, 1 drafting (7) 70.8 against 73.3; of 16 rows, 15 drafting (1) 127.7
against 116.4, 12 (4) 109.7 against 108.9, 8 (8) 116.3 against 126.3, 1 (15) 92.8 against
110.0. So a forward is packed only from MIN_PADDING padded positions on.
"""
MIN_PADDING = 6


def worth_packing(padding: int) -> bool:
    """Whether a forward with `padding` padded positions (over all its rows) is packed."""
    return padding >= MIN_PADDING


def verify_padding(batch: int, drafting: int, k: int) -> int:
    """Padded positions of a verify of `batch` rows, `drafting` of them with k drafts and the
    others none."""
    return (batch - drafting) * k
