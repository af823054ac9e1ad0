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
"""
import threading

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "batchspec_sdpa"


class _Folded(threading.local):
    """The last mask folded on this thread: (mask, (num_new, groups), folded). The mask is
    held, so its identity cannot pass to another tensor while it is kept."""

    last: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None


_FOLDED = _Folded()


def folded_mask(mask: torch.Tensor, num_new: int, groups: int) -> torch.Tensor:
    """mask [batch, 1, T or 1, L] repeated along the query axis for `groups` query heads per
    key/value head: [batch, 1, groups * T, L]; one fold per mask (see _Folded)."""
    last = _FOLDED.last
    if last is not None and last[0] is mask and last[1] == (num_new, groups):
        return last[2]
    batch = mask.shape[0]
    folded = mask.expand(batch, 1, num_new, -1).repeat(1, 1, groups, 1)
    _FOLDED.last = (mask, (num_new, groups), folded)
    return folded


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                 scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """An attention function for transformers' AttentionInterface (query [B, H, T, D], key and
    value [B, H_kv, L, D]); returns ([B, T, H, D], None) as its SDPA function does."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, num_new, dim = query.shape
    if (groups == 1 or num_new == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or kwargs.get("position_bias") is not None
            or dropout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    kv_heads = heads // groups
    # query head h = g * groups + r serves key/value head g: fold r into the query axis
    folded = query.reshape(batch, kv_heads, groups * num_new, dim)
    mask = folded_mask(attention_mask, num_new, groups)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask,
                                                           scale=scaling)
    out = out.reshape(batch, heads, num_new, dim).transpose(1, 2).contiguous()
    return out, None


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
