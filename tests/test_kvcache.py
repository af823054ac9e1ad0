"""Spans (which cache columns are real positions), stacking per-sequence caches into a
left-padded batch, and taking rows back out."""
import pytest
import torch

from batchspec.runtime import kvcache


def cache(columns, layers=2, heads=3, dim=4, extra=2):
    """A sequence cache of `columns + extra` columns (the extra ones past its last span)."""
    if columns == 0:
        return None
    shape = (1, heads, columns + extra, dim)
    return [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]


def real_columns(layers, spans, layer_index, which):
    return torch.cat([layers[layer_index][which][0, :, a:b] for a, b in spans], dim=1)


@pytest.mark.parametrize("row_spans", [
    [((0, 5),)],
    [((0, 4),), ((0, 4),), ((0, 4),)],
    [((0, 3),), ((0, 7),), (), ((0, 5),)],
    [((0, 1),), ((0, 9),)],
    [((2, 6), (8, 9)), ((0, 6),), ((1, 3), (4, 5), (7, 8))],  # left pads and holes
])
def test_stack_rows_left_pads_the_real_positions_of_each_row(row_spans):
    torch.manual_seed(len(row_spans))
    rows = [cache(s[-1][1] if s else 0) for s in row_spans]
    lengths = [kvcache.span_length(s) for s in row_spans]
    width = max(lengths)
    stacked = kvcache.stack_rows(rows, row_spans)
    assert len(stacked) == 2
    for layer_index, (keys, values) in enumerate(stacked):
        assert keys.shape == values.shape == (len(rows), 3, width, 4)
        for i, n in enumerate(lengths):
            for which, got in ((0, keys), (1, values)):
                assert torch.count_nonzero(got[i, :, :width - n]) == 0
                if n:
                    want = real_columns(rows[i], row_spans[i], layer_index, which)
                    assert torch.equal(got[i, :, width - n:], want)
    # and the rows come back out as views of the batch
    for i, n in enumerate(lengths):
        back = kvcache.take_row(stacked, i, width)
        if n:
            assert torch.equal(back[0][0][0, :, width - n:],
                               real_columns(rows[i], row_spans[i], 0, 0))


def test_stack_rows_of_empty_caches_is_none():
    assert kvcache.stack_rows([None, None], [(), ()]) is None


def test_keep_first_cuts_spans_at_the_kept_position():
    spans = ((2, 5), (7, 9), (10, 14))
    assert kvcache.keep_first(spans, 0) == ()
    assert kvcache.keep_first(spans, 3) == ((2, 5),)
    assert kvcache.keep_first(spans, 4) == ((2, 5), (7, 8))
    assert kvcache.keep_first(spans, 9) == spans
    assert kvcache.span_length(kvcache.keep_first(spans, 6)) == 6


def test_append_span_merges_adjacent_columns_only():
    assert kvcache.append_span((), 0, 3) == ((0, 3),)
    assert kvcache.append_span(((0, 3),), 3, 5) == ((0, 5),)
    assert kvcache.append_span(((0, 3),), 4, 6) == ((0, 3), (4, 6))
    assert kvcache.is_plain(((0, 5),)) and kvcache.is_plain(())
    assert not kvcache.is_plain(((1, 5),)) and not kvcache.is_plain(((0, 2), (3, 4)))


def test_column_mask_marks_the_spans():
    mask = kvcache.column_mask([((1, 3), (4, 5)), ((0, 5),)], 5)
    assert mask.tolist() == [[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]]


def test_to_model_cache_holds_the_tensors_themselves_and_from_model_cache_returns_them():
    layers = cache(6)
    model_cache = kvcache.to_model_cache(layers)
    assert model_cache.get_seq_length() == 8
    for (k, v), (k2, v2) in zip(layers, kvcache.from_model_cache(model_cache)):
        assert k2.data_ptr() == k.data_ptr() and v2.data_ptr() == v.data_ptr()  # no copy
        assert k2.shape == k.shape
