"""Grouped-query attention over masked, multi-token queries without copying the KV cache.

transformers' SDPA path repeats every key/value head once per query head it serves
(`repeat_kv`, a copy of the whole cache each layer) whenever a mask is given and more than one
token is fed, which is every verify: on a CPU that copy cost a 16-row verify of 5 tokens over
256 cached positions about a quarter of its time. Here the query heads that share a key/value
head are folded into the query axis instead, [batch, kv_heads, groups * T, dim], and the mask
(one for all heads) is repeated along it: each query row still attends to exactly the keys it
did, with the same softmax, so results agree to float rounding. A lone query token, no mask,
or no grouping go to transformers' SDPA path unchanged. Every layer of a forward is given the
same mask, so it is folded once per forward, not once per layer.

Where the linear layers skip right padding (`fastlinear.only_positions`), rows feed different
numbers of real tokens (a verify whose rows draft different K, a batch of prompts). Attention
then runs on runs of adjacent rows, each for as many query tokens as its longest row feeds:
slices of the batch are views, so nothing is copied, and a row that decodes one token among
rows that verify five no longer pays for five. Which rows share a call is chosen by a cost
model (`split_rows`); padded query positions are given zeros, which no real position reads.
"""
import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchspec.runtime import fastlinear

NAME = "batchspec_sdpa"


class _Plan(threading.local):
    """The last forward's plan on this thread: ((mask, valid, num_new, groups), runs). The
    mask and valid are held, so their identities cannot pass to other tensors while kept."""

    last: tuple[tuple, list] | None = None


_PLAN = _Plan()

# The cost model of split_rows, microseconds (float32 on an x86 CPU; only their ratios steer
# the choice): an SDPA call and its slicing; then, per row and cached position, reading its
# keys and values, and each folded query token's work.
CALL_US = 30.0
ROW_POSITION_US = 0.086
QUERY_POSITION_US = 0.008


def split_rows(counts: list[int], groups: int, cached: int) -> list[tuple[int, int]]:
    """Runs [start, end) of adjacent rows that share an attention call, for rows feeding
    `counts` real query tokens each over `cached` keys: the split of least modelled cost
    (one call's overhead against the padded queries it computes)."""
    rows = len(counts)
    best = [0.0] + [float("inf")] * rows
    cut = [0] * (rows + 1)
    for end in range(1, rows + 1):
        widest = 0
        for start in range(end - 1, -1, -1):
            widest = max(widest, counts[start])
            cost = best[start] + CALL_US + (end - start) * cached * (
                ROW_POSITION_US + QUERY_POSITION_US * groups * widest)
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], rows
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


# Rows past which a batch is run in one call (the split's search grows with rows squared).
MAX_SPLIT_ROWS = 64


def plan(mask: torch.Tensor, num_new: int, groups: int):
    """[(start, end, query tokens, folded mask [end - start, 1, groups * tokens, L])] for a
    forward over mask [batch, 1, T or 1, L]; once per forward (see _Plan)."""
    valid = fastlinear.valid_positions()
    key = (mask, valid, num_new, groups)
    last = _PLAN.last
    if last is not None and all(a is b for a, b in zip(last[0][:2], key[:2])) \
            and last[0][2:] == key[2:]:
        return last[1]
    batch = mask.shape[0]
    full = mask.expand(batch, 1, num_new, -1)
    if valid is None or tuple(valid.shape) != (batch, num_new) or batch > MAX_SPLIT_ROWS:
        runs = [(0, batch, num_new)]
    else:
        counts = valid.sum(dim=1).tolist()
        runs = [(a, b, max(counts[a:b])) for a, b in split_rows(counts, groups, mask.shape[-1])]
    steps = [(a, b, n, full[a:b, :, :n].repeat(1, 1, groups, 1)) for a, b, n in runs if n]
    _PLAN.last = (key, steps)
    return steps


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                 scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """An attention function for transformers' AttentionInterface (query [B, H, T, D], key and
    value [B, H_kv, L, D]); returns ([B, T, H, D], None) as its SDPA function does."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, num_new, dim = query.shape
    if (num_new == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or kwargs.get("position_bias") is not None
            or dropout or (groups == 1 and fastlinear.valid_positions() is None)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    kv_heads = heads // groups
    steps = plan(attention_mask, num_new, groups)
    out = None if len(steps) == 1 and steps[0][2] == num_new else query.new_zeros(query.shape)
    for start, end, tokens, mask in steps:
        # query head h = g * groups + r serves key/value head g: fold r into the query axis
        folded = query[start:end, :, :tokens].reshape(end - start, kv_heads, groups * tokens,
                                                      dim)
        part = torch.nn.functional.scaled_dot_product_attention(
            folded, key[start:end], value[start:end], attn_mask=mask, scale=scaling)
        part = part.reshape(end - start, heads, tokens, dim)
        if out is None:
            out = part
        else:
            out[start:end, :, :tokens] = part
    return out.transpose(1, 2).contiguous(), None


def install(model: torch.nn.Module) -> bool:
    """Make a model that attends through SDPA use grouped_sdpa; returns whether it does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes, built as for it
    model.set_attn_implementation(NAME)
    return True
