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
    template = next(r for r, n in zip(rows, lengths) if n > 0)
    stacked = []
    for layer_index, (k_ref, v_ref) in enumerate(template):
        keys, values = [], []
        for row, n in zip(rows, lengths):
            keys.append(_left_pad(row, layer_index, 0, n, width, k_ref))
            values.append(_left_pad(row, layer_index, 1, n, width, v_ref))
        stacked.append((torch.cat(keys, dim=0), torch.cat(values, dim=0)))
    return stacked


def _left_pad(row, layer_index, which, n, width, ref):
    shape = (1, ref.shape[1], width, ref.shape[3])
    if n == width:
        return row[layer_index][which][:, :, :n]
    out = ref.new_zeros(shape)
    if n:
        out[:, :, width - n:] = row[layer_index][which][:, :, :n]
    return out


def take_row(layers: list[LayerKV], row: int, start: int, length: int) -> list[LayerKV] | None:
    """Row `row`'s positions [start, start + length) of a batched cache (views, no copy)."""
    if length == 0:
        return None
    end = start + length
    return [(k[row:row + 1, :, start:end], v[row:row + 1, :, start:end]) for k, v in layers]
