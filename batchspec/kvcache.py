"""The one place that touches the transformers Cache API (it moves between releases).

A sequence's cache is kept here as plain tensors, one (keys, values) pair per layer, each
[1, num_kv_heads, length, head_dim]. Only `to_model_cache` and `from_model_cache` know how the
installed transformers wants them.
"""
import torch
from transformers import DynamicCache

LayerKV = tuple[torch.Tensor, torch.Tensor]


def to_model_cache(layers: list[LayerKV] | None) -> DynamicCache:
    """A DynamicCache holding `layers` (an empty cache for None)."""
    if layers is None:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=layers)


def from_model_cache(cache: DynamicCache) -> list[LayerKV]:
    """The per-layer (keys, values) tensors of a cache, [batch, heads, length, head_dim]."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.56


def stack_rows(rows: list[list[LayerKV] | None], lengths: list[int]) -> list[LayerKV] | None:
    """Stack per-sequence caches into one batch, left-padding shorter rows with zeros.

    Row i keeps its first lengths[i] positions; in the result they sit at the right end of
    [max(lengths)] columns. Returns None when every row is empty.
    """
    width = max(lengths)
    if width == 0:
        return None
    if len(rows) == 1:  # a group of one needs no copy: views of the sequence's own tensors
        return [(k[:, :, :width], v[:, :, :width]) for k, v in rows[0]]
    if min(lengths) == width:  # equal lengths: one concatenation per tensor
        return [tuple(torch.cat([row[layer_index][which][:, :, :width] for row in rows])
                      for which in (0, 1)) for layer_index in range(len(rows[0]))]
    template = next(r for r, n in zip(rows, lengths) if n > 0)
    return [tuple(_left_padded(rows, lengths, layer_index, which, ref, width)
                  for which, ref in enumerate(pair)) for layer_index, pair in enumerate(template)]


def _left_padded(rows, lengths, layer_index, which, ref, width) -> torch.Tensor:
    """One layer's keys (which=0) or values (1) of every row, copied once into a
    [batch, heads, width, head_dim] tensor whose pad columns are zeros."""
    out = ref.new_empty((len(rows), ref.shape[1], width, ref.shape[3]))
    for i, (row, n) in enumerate(zip(rows, lengths)):
        if n < width:
            out[i, :, :width - n].zero_()
        if n:
            out[i, :, width - n:].copy_(row[layer_index][which][0, :, :n])
    return out


def take_row(layers: list[LayerKV], row: int, start: int, length: int) -> list[LayerKV] | None:
    """Row `row`'s positions [start, start + length) of a batched cache (views, no copy)."""
    if length == 0:
        return None
    end = start + length
    return [(k[row:row + 1, :, start:end], v[row:row + 1, :, start:end]) for k, v in layers]
