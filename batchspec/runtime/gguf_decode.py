"""A step of a Llama-family model over its GGUF blocks, all layers in one C++ call.

Through the lean forward (forward.py) a step costs about fifty Python calls a layer around a
handful of kernels. `llama_step` (csrc/gguf_linear.cpp) makes the same ATen calls in the same
order from C++: the input norm, the joined q/k/v product, the rotation of q and k, the keys
and values written into the layer's buffer, SDPA called as transformers' SDPA function and
attention.grouped_sdpa call it (with the same mask), the o product, the post-attention norm,
the joined gate/up product, SiLU and the down product. So its hidden states are the lean
forward's bit for bit (tested), for the price of the kernels.

It takes a step only where that holds: a model whose every layer multiplies by GGUF blocks
(`forward._joined`), transformers' RMS norm and SiLU feed-forward; no more positions than
every layer's blocks take; every position computed (no `fastlinear.only_positions` packing);
a mask wherever more than one position a row is fed; attention that grouped_sdpa runs in one
SDPA call; and a cache of the runtime's buffers (kvcache.AppendLayer) already holding the
rows. Every other step takes the lean forward.
"""
import dataclasses
import logging

import torch

from batchspec.runtime import attention, fastlinear, gguf_blocks, kvcache

log = logging.getLogger(__name__)

_KINDS = {"q4_1": 1, "q8_0": 0}  # Blocks.kind -> llama_step's kind code
DIRECT, PACKED, FOLDED = 0, 1, 2  # llama_step's ways to attend (csrc: Attend)


@dataclasses.dataclass(frozen=True)
class Decoder:
    weights: list[torch.Tensor]  # per layer: input norm, q/k/v, o, post norm, gate/up, down
    kinds: list[int]  # per layer: the kind codes of its four block products
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    # how transformers calls SDPA for one query, with no mask / under a mask: with
    # enable_gqa (True), without it over ungrouped heads (False), or packing the heads (None)
    gqa: bool
    gqa_masked: bool | None
    max_rows: int  # the most positions a step may feed (over all rows)

    @classmethod
    def of(cls, base, layers, qkv_blocks, gate_up_blocks) -> "Decoder | None":
        """The decoder of a LlamaModel `base` whose layers' q/k/v and gate/up blocks are
        joined as given, whose norms are transformers' RMS norm and whose feed-forward blocks
        are down(silu(gate(x)) * up(x)) (the caller checks both); None where the C++ step
        does not do what its lean forward does."""
        config = base.config
        if not layers or None in qkv_blocks or None in gate_up_blocks \
                or getattr(config, "hidden_act", None) != "silu":
            return None  # (blocks mean the kernels are loaded)
        weights, kinds, limits, norms = [], [], [], []
        for layer, qkv, gate_up in zip(layers, qkv_blocks, gate_up_blocks):
            attn, mlp = layer.self_attn, layer.mlp
            o, down = (gguf_blocks.blocks_of(m.weight) for m in (attn.o_proj, mlp.down_proj))
            products = (qkv, o, gate_up, down)
            layer_norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(p is None for p in products) or attn.o_proj.bias is not None \
                    or mlp.down_proj.bias is not None \
                    or any(n.weight.dtype != torch.float32 for n in layer_norms):
                return None
            weights += [layer_norms[0].weight, qkv.data, o.data, layer_norms[1].weight,
                        gate_up.data, down.data]
            kinds += [_KINDS[p.kind] for p in products]
            limits += [p.max_rows for p in products]
            norms += [n.variance_epsilon for n in layer_norms]
        attn = layers[0].self_attn
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        groups = heads // kv_heads
        gqa = _sdpa_gqa(groups, attn.head_dim, masked=False)
        if gqa is None or len(set(norms)) != 1 or \
                len({layer.self_attn.scaling for layer in layers}) != 1:
            return None
        decoder = cls([w.detach() for w in weights], kinds, heads, kv_heads, attn.head_dim,
                      float(norms[0]), float(attn.scaling), gqa,
                      _sdpa_gqa(groups, attn.head_dim, masked=True), min(limits))
        log.info("GGUF steps of up to %d positions run all %d layers in one C++ call",
                 decoder.max_rows, len(layers))
        return decoder

    def _takes(self, hidden: torch.Tensor, cache, mask: torch.Tensor | None) -> bool:
        """Whether a forward of `hidden` [batch, new, hidden] after `cache` under `mask` (as
        the lean forward passes it) is a step this decoder takes (but for its attention)."""
        batch, fed, _ = hidden.shape
        layers = getattr(cache, "layers", ())
        return (batch * fed <= self.max_rows and (fed == 1 or mask is not None)
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and not torch.is_grad_enabled() and fastlinear.valid_positions() is None
                and len(layers) * 6 == len(self.weights)
                and all(isinstance(layer, kvcache.AppendLayer) and layer.is_initialized
                        and layer.keys.dim() == 4 for layer in layers))

    def __call__(self, hidden, cos, sin, cache, mask) -> torch.Tensor | None:
        """The hidden states after every layer (before the final norm), each layer's cache
        advanced by the new positions; None (nothing done) where this decoder does not take
        the step (see the module docstring)."""
        if not self._takes(hidden, cache, mask):
            return None
        attend, mask, gqa = self._attention(hidden.shape[1], mask)
        if attend is None:
            return None
        fed = hidden.shape[1]
        buffers = [layer.room(fed, layer.keys) for layer in cache.layers]
        hidden = torch.ops.batchspec_gguf.llama_step(
            hidden, cos, sin, self.weights, self.kinds, [b.keys for b in buffers],
            [b.values for b in buffers], [b.written for b in buffers], mask, attend,
            self.heads, self.kv_heads, self.head_dim, self.eps, self.scaling, gqa)
        for layer, buffer in zip(cache.layers, buffers):
            layer.keys, layer.values = buffer.advanced(fed)
        return hidden

    def _attention(self, fed: int, mask: torch.Tensor | None):
        """(way to attend, the mask SDPA takes, enable_gqa) as grouped_sdpa and transformers'
        SDPA function attend for `fed` queries a row under `mask`; (None, ...) where it
        takes several SDPA calls."""
        groups = self.heads // self.kv_heads
        if mask is None:
            return DIRECT, None, self.gqa
        if fed == 1 or groups == 1:  # transformers' SDPA function
            if self.gqa_masked is None:
                return PACKED, mask, False
            return DIRECT, mask, self.gqa_masked
        steps = attention.plan(mask, fed, groups)
        if len(steps) != 1 or steps[0][:3] != (0, mask.shape[0], fed):
            return None, None, False
        return FOLDED, steps[0][3], False


def _sdpa_gqa(groups: int, head_dim: int, masked: bool) -> bool | None:
    """Whether transformers calls SDPA with enable_gqa for one query (masked or not); False
    where the heads are not grouped; None where it does something else (packs the heads
    under a mask; repeats them, or an unknown release, without one)."""
    if groups == 1:
        return False
    try:
        from transformers.integrations.sdpa_attention import use_gqa_in_sdpa
    except ImportError:
        return None
    like = torch.empty(1, 1, 1, head_dim)
    return True if use_gqa_in_sdpa(torch.ones(1, dtype=torch.bool) if masked else None,
                                   like, like) else None
