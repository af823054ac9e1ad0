"""KV-cache tensors of sequences and groups, and the one place that touches the transformers
Cache API (it moves between releases).

A sequence's cache is a set of columns of one batch tensor per layer, kept as views
[1, num_kv_heads, columns, head_dim] of that batch's row. Not every column holds a real position:
`Spans`, the ordered (start, end) column ranges that do, say which. Columns outside the spans
are left padding or the positions of rejected drafts ("holes"); they hold finite stale values
and are masked out of attention, never read as positions. Only `to_model_cache` and
`from_model_cache` know how the installed transformers wants the tensors.
"""
import torch
from transformers import DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]
Spans = tuple[tuple[int, int], ...]


def to_model_cache(layers: list[LayerKV] | None) -> DynamicCache:
    """A DynamicCache holding `layers` as they are (an empty cache for None): no copy.

    (DynamicCache(ddp_cache_data=layers) would copy every tensor, as big a copy as a
    realignment: it appends the data to empty layers with torch.cat; scripts/group_steps.py
    times both.)"""
    if layers is None:
        return DynamicCache()
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in layers])
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.keys, layer.values = keys, values
    return cache


def from_model_cache(cache: DynamicCache) -> list[LayerKV]:
    """The per-layer (keys, values) tensors of a cache, [batch, heads, length, head_dim]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


# ---- spans: which columns are real positions ---------------------------------------------------
def span_length(spans: Spans) -> int:
    return sum(end - start for start, end in spans)


def keep_first(spans: Spans, keep: int) -> Spans:
    """The spans of the first `keep` real positions (keep <= span_length(spans))."""
    kept, left = [], keep
    for start, end in spans:
        if left <= 0:
            break
        kept.append((start, min(end, start + left)))
        left -= end - start
    return tuple(kept)


def append_span(spans: Spans, start: int, end: int) -> Spans:
    """spans followed by the columns [start, end), merged with the last span when adjacent."""
    if spans and spans[-1][1] == start:
        return spans[:-1] + ((spans[-1][0], end),)
    return spans + ((start, end),)


def is_plain(spans: Spans) -> bool:
    """True when the real positions are columns 0.. with no padding or hole among them."""
    return len(spans) <= 1 and (not spans or spans[0][0] == 0)


def column_mask(row_spans: list[Spans], width: int) -> torch.Tensor:
    """[batch, width] long: 1 on the columns that are real positions of each row."""
    mask = torch.zeros(len(row_spans), width, dtype=torch.long)
    for i, spans in enumerate(row_spans):
        for start, end in spans:
            mask[i, start:end] = 1
    return mask


# ---- stacking rows into a batch ----------------------------------------------------------------
def stack_rows(rows: list[list[LayerKV] | None], row_spans: list[Spans]) -> list[LayerKV] | None:
    """Copy each row's real positions (its spans) into one left-padded batch.

    Row i's positions, in order, end up as the last span_length(row_spans[i]) columns of
    [max length] columns; the pad columns before them are zeros. None when every row is empty.
    """
    lengths = [span_length(s) for s in row_spans]
    width = max(lengths)
    if width == 0:
        return None
    if all(n == width and is_plain(s) for n, s in zip(lengths, row_spans)):
        # equal lengths, no holes: one concatenation per tensor
        return [tuple(torch.cat([row[layer_index][which][:, :, :width] for row in rows])
                      for which in (0, 1)) for layer_index in range(len(rows[0]))]
    template = next(r for r, n in zip(rows, lengths) if n > 0)
    indices = [_column_index(spans, ref=template[0][0]) for spans in row_spans]
    return [tuple(_left_padded(rows, row_spans, indices, lengths, layer_index, which, ref, width)
                  for which, ref in enumerate(pair)) for layer_index, pair in enumerate(template)]


def _column_index(spans: Spans, ref: torch.Tensor) -> torch.Tensor | None:
    """The real columns of a row with more than one span, as an index tensor (else None)."""
    if len(spans) <= 1:
        return None
    return torch.cat([torch.arange(start, end) for start, end in spans]).to(ref.device)


def _left_padded(rows, row_spans, indices, lengths, layer_index, which, ref, width):
    """One layer's keys (which=0) or values (1) of every row, copied once into a
    [batch, heads, width, head_dim] tensor whose pad columns are zeros."""
    out = ref.new_empty((len(rows), ref.shape[1], width, ref.shape[3]))
    for i, (row, spans, index, n) in enumerate(zip(rows, row_spans, indices, lengths)):
        if n < width:
            out[i, :, :width - n].zero_()
        if not n:
            continue
        source = row[layer_index][which][0]
        if index is None:
            start, end = spans[0]
            out[i, :, width - n:].copy_(source[:, start:end])
        else:
            out[i, :, width - n:].copy_(source.index_select(1, index))
    return out


def take_row(layers: list[LayerKV], row: int, columns: int) -> list[LayerKV] | None:
    """Row `row`'s first `columns` columns of a batched cache (views, no copy)."""
    if columns == 0:
        return None
    return [(k[row:row + 1, :, :columns], v[row:row + 1, :, :columns]) for k, v in layers]
