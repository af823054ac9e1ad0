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


def _appended(layers, new):
    """Feed `new` ([batch, heads, T, dim] keys, the same as values) to every layer of a model
    cache made of `layers`; returns the cache's layers after it."""
    model_cache = kvcache.to_model_cache(layers)
    for index in range(len(layers)):
        model_cache.update(new, new, index)
    return kvcache.from_model_cache(model_cache)


def test_a_batch_appends_into_its_free_columns_and_never_below_what_was_written():
    torch.manual_seed(0)
    rows = [cache(5, extra=0), cache(5, extra=0)]
    batch = kvcache.stack_rows(rows, [((0, 5),), ((0, 5),)], more=3)
    held = [(k.clone(), v.clone()) for k, v in batch]
    step = torch.randn(2, 3, 2, 4)
    after = _appended(batch, step)
    assert isinstance(after, kvcache.Batch)
    for (k, v), (k0, v0), (k1, _) in zip(batch, held, after):
        assert k1.data_ptr() == k.data_ptr()  # written in place: no copy of the cache
        assert k1.shape[2] == 7 and torch.equal(k1[:, :, 5:], step)
        assert torch.equal(k, k0) and torch.equal(v, v0)  # what was held is unchanged
    # the first batch's views no longer end their buffers: appending after them again moves
    # them into a new buffer instead of overwriting the columns `after` holds
    other = torch.randn(2, 3, 2, 4)
    again = _appended(batch, other)
    for (k1, _), (k2, _) in zip(after, again):
        assert k2.data_ptr() != k1.data_ptr()
        assert torch.equal(k1[:, :, 5:], step) and torch.equal(k2[:, :, 5:], other)


def test_a_full_buffer_moves_once_into_a_larger_one():
    torch.manual_seed(1)
    batch = kvcache.stack_rows([cache(4, extra=0)], [((0, 4),)])
    capacity = batch.buffers[0].keys.shape[2]
    assert capacity == 4 + kvcache.spare_columns(4)
    layers = batch
    pointers = set()
    for _ in range(capacity - 4 + 1):  # one position past the capacity
        layers = _appended(layers, torch.ones(1, 3, 1, 4))
        pointers.add(layers[0][0].data_ptr())
    assert len(pointers) == 2 and layers[0][0].shape[2] == capacity + 1
    assert torch.equal(layers[0][0][:, :, :4], batch[0][0])
