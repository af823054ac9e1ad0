"""Stacking per-sequence caches into a left-padded batch, and taking rows back out."""
import pytest
import torch

from batchspec import kvcache


def cache(length, layers=2, heads=3, dim=4, extra=2):
    """A sequence cache holding `length + extra` positions (the extra ones rolled back)."""
    if length == 0:
        return None
    return [(torch.randn(1, heads, length + extra, dim), torch.randn(1, heads, length + extra, dim))
            for _ in range(layers)]


@pytest.mark.parametrize("lengths", [[5], [4, 4, 4], [3, 7, 0, 5], [1, 9], [6, 6, 2]])
def test_stack_rows_left_pads_each_row_with_zeros(lengths):
    torch.manual_seed(len(lengths))
    rows = [cache(n) for n in lengths]
    width = max(lengths)
    stacked = kvcache.stack_rows(rows, lengths)
    assert len(stacked) == 2
    for layer_index, (keys, values) in enumerate(stacked):
        assert keys.shape == values.shape == (len(lengths), 3, width, 4)
        for i, n in enumerate(lengths):
            for which, got in ((0, keys), (1, values)):
                assert torch.count_nonzero(got[i, :, :width - n]) == 0
                if n:
                    assert torch.equal(got[i, :, width - n:], rows[i][layer_index][which][0, :, :n])
    # and the rows come back out as they went in
    layers = [(k, v) for k, v in stacked]
    for i, n in enumerate(lengths):
        back = kvcache.take_row(layers, i, width - n, n)
        if n == 0:
            assert back is None
        else:
            assert torch.equal(back[0][0], rows[i][0][0][:, :, :n])


def test_stack_rows_of_empty_caches_is_none():
    assert kvcache.stack_rows([None, None], [0, 0]) is None
