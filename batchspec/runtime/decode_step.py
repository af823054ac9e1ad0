"""A step of a Llama-family model, all layers in one C++ call: over its GGUF blocks, or over
float32 weights as the lean forward multiplies them.

Through the lean forward (forward.py) a step costs about fifty Python calls a layer around a
handful of kernels. Both C++ steps (csrc/gguf_linear.cpp) run a layer as the lean forward
does: the input norm, the q/k/v products (joined over GGUF blocks; apart, by fastlinear's
plan, over float32 weights), the rotation of q and k, the keys and values written into the
layer's buffer, attention under the same mask, the o product, the post-attention norm, the
gate/up products, SiLU and the down product.
- `llama_step_dense` makes the lean forward's ATen calls in the same order (SDPA called as
  transformers' SDPA function and attention.grouped_sdpa call it), so its hidden states are
  the lean forward's bit for bit (tested).
- `llama_step` does the work beside its products in loops of its own (csrc/step_ops.h): a
  position's hidden states are the same bit for bit whatever step, batch or cache layout it
  is computed in (tested), and the lean forward's up to rounding, as its products are.
  Over float32 weights it multiplies in its own loops too (for a draft's loop only,
  draft_loop.py: a target's float32 steps keep the lean forward's bits).

It takes a step only where that holds: transformers' RMS norm and SiLU feed-forward; a model
whose every layer multiplies by GGUF blocks (`forward._joined`), no more positions than every
layer's blocks take or than it measured faster for at start-up (calibration.StepWidening); or one
whose every linear layer is float32, bias-free, planned by fastlinear (patched) and not
multiplied by the oneDNN-packed copy for this many rows, whose attention grouped_sdpa runs in
one SDPA call; every position computed (no `fastlinear.only_positions` packing); a mask
wherever more than one position a row is fed; and a cache of the runtime's buffers
(kvcache.AppendLayer) already holding the rows, on the CPU. Every other step takes the lean
forward.
"""
import dataclasses
import logging
import sys

import torch

from batchspec.runtime import attention, fastlinear, gguf_blocks, kvcache

log = logging.getLogger(__name__)

KINDS = {"q4_1": 1, "q8_0": 0}  # Blocks.kind -> llama_step's kind code
DIRECT, PACKED, FOLDED = 0, 1, 2  # llama_step's ways to attend (csrc: Attend)


@dataclasses.dataclass
class Decoder:
    # per layer, over blocks: input norm, q/k/v, o, post norm, gate/up, down; over float32
    # weights: input norm, q, k, v, o, post norm, gate, up, down
    weights: list[torch.Tensor]
    # over blocks, per layer: the kind codes of its four block products; over float32
    # weights: empty (each step's plans are asked for its rows)
    kinds: list[int]
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    # how transformers calls SDPA for one query, with no mask / under a mask: with
    # enable_gqa (True), without it over ungrouped heads (False), or packing the heads (None)
    gqa: bool
    gqa_masked: bool | None
    # the most positions a step may feed (over all rows): over blocks, at first the fewest any
    # layer's blocks multiply faster than its float32 weight (calibration.StepWidening widens it)
    max_rows: int
    # over float32 weights: (out, in) of a layer's seven products, the same in every layer
    shapes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, base, layers, qkv_blocks, gate_up_blocks) -> "Decoder | None":
        """The decoder of a LlamaModel `base` whose layers' q/k/v and gate/up blocks are
        joined as given (None: a layer has none), whose norms are transformers' RMS norm and
        whose feed-forward blocks are down(silu(gate(x)) * up(x)) (the caller checks both);
        None where the C++ step does not do what its lean forward does."""
        config = base.config
        if not layers or getattr(config, "hidden_act", None) != "silu":
            return None
        if all(b is None for b in (*qkv_blocks, *gate_up_blocks)):
            found = _dense(layers)
        elif None in qkv_blocks or None in gate_up_blocks:
            return None
        else:  # (blocks mean the kernels are loaded)
            found = _blocks(layers, qkv_blocks, gate_up_blocks)
        if found is None:
            return None
        weights, kinds, max_rows, shapes, norms = found
        attn = layers[0].self_attn
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        groups = heads // kv_heads
        gqa = _sdpa_gqa(groups, attn.head_dim, masked=False)
        if (gqa is None and shapes) or len(set(norms)) != 1 or \
                len({layer.self_attn.scaling for layer in layers}) != 1 or \
                any(w.dtype != torch.float32 or w.device.type != "cpu"
                    for w in weights if w.dtype != torch.uint8):
            return None
        decoder = cls([w.detach() for w in weights], kinds, heads, kv_heads, attn.head_dim,
                      float(norms[0]), float(attn.scaling), gqa,
                      _sdpa_gqa(groups, attn.head_dim, masked=True), max_rows, shapes)
        if shapes:
            log.info("float32 steps run all %d layers in one C++ call", len(layers))
        else:
            log.info("GGUF steps of up to %d positions run all %d layers in one C++ call",
                     max_rows, len(layers))
        return decoder

    def _takes(self, hidden: torch.Tensor, cache, mask: torch.Tensor | None) -> bool:
        """Whether a forward of `hidden` [batch, new, hidden] after `cache` under `mask` (as
        the lean forward passes it) is a step this decoder takes (but for its attention and
        products' plans)."""
        batch, fed, _ = hidden.shape
        layers = getattr(cache, "layers", ())
        return (batch * fed <= self.max_rows and (fed == 1 or mask is not None)
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and not torch.is_grad_enabled() and fastlinear.valid_positions() is None
                and len(layers) * self.per_layer == len(self.weights)
                and all(isinstance(layer, kvcache.AppendLayer) and layer.is_initialized
                        and layer.keys.dim() == 4 for layer in layers))

    def __call__(self, hidden, cos, sin, cache, mask) -> torch.Tensor | None:
        """The hidden states after every layer (before the final norm), each layer's cache
        advanced by the new positions; None (nothing done) where this decoder does not take
        the step (see the module docstring)."""
        if not self._takes(hidden, cache, mask):
            return None
        fed = hidden.shape[1]
        if self.shapes:  # as the lean forward: its products' plans and SDPA calls
            attend, mask, gqa = self._attention(fed, mask)
            methods = self._methods(hidden.shape[0] * fed)
            if attend is None or methods is None:
                return None
        buffers = [layer.room(fed, layer.keys) for layer in cache.layers]
        caches = [b.keys for b in buffers], [b.values for b in buffers], \
            [b.written for b in buffers]
        if self.shapes:
            hidden = torch.ops.batchspec_gguf.llama_step_dense(
                hidden, cos, sin, self.weights, methods, *caches, mask, attend, self.heads,
                self.kv_heads, self.head_dim, self.eps, self.scaling, gqa)
        else:  # over blocks: every query attends where the mask says (csrc/step_ops.h)
            hidden = torch.ops.batchspec_gguf.llama_step(
                hidden, cos, sin, self.weights, self.kinds, *caches, mask, self.heads,
                self.kv_heads, self.head_dim, self.eps, self.scaling)
        for layer, buffer in zip(cache.layers, buffers):
            layer.keys, layer.values = buffer.advanced(fed)
        return hidden

    @property
    def per_layer(self) -> int:
        """Weights a layer hands the C++ step (see `weights`)."""
        return 9 if self.shapes else 6

    def _methods(self, rows: int) -> list[int] | None:
        """Each float32 product's method for `rows` rows as fastlinear.weight_major takes it
        (0: the usual product; n: weight-major over n rows), for every layer; None where one
        takes the oneDNN-packed weight (not made in C++)."""
        methods = []
        for out_features, in_features in self.shapes:
            method = fastlinear.plan(out_features, in_features, torch.float32, rows)
            if method == fastlinear.PACKED:
                return None
            methods.append(fastlinear.USUAL if rows > fastlinear.MAX_ROWS else method)
        return methods * (len(self.weights) // self.per_layer)

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


def _blocks(layers, qkv_blocks, gate_up_blocks):
    """(weights, kinds, max_rows, (), norms) of layers that multiply by GGUF blocks, or None
    where one product has none, a bias or a norm is not float32."""
    weights, kinds, limits, norms = [], [], [], []
    for layer, qkv, gate_up in zip(layers, qkv_blocks, gate_up_blocks):
        attn, mlp = layer.self_attn, layer.mlp
        o, down = (gguf_blocks.blocks_of(m.weight) for m in (attn.o_proj, mlp.down_proj))
        products = (qkv, o, gate_up, down)
        layer_norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(p is None for p in products) or attn.o_proj.bias is not None \
                or mlp.down_proj.bias is not None:
            return None
        weights += [layer_norms[0].weight, qkv.data, o.data, layer_norms[1].weight,
                    gate_up.data, down.data]
        kinds += [KINDS[p.kind] for p in products]
        limits += [p.max_rows for p in products]
        norms += [n.variance_epsilon for n in layer_norms]
    return weights, kinds, min(limits), (), norms


def _dense(layers):
    """(weights, [], no limit, shapes, norms) of layers whose linear layers are float32,
    bias-free, without GGUF blocks and planned by fastlinear, each the same shape in every
    layer; None otherwise."""
    weights, shapes, norms = [], set(), []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        if any(m.bias is not None or gguf_blocks.blocks_of(m.weight) is not None
               or not fastlinear.planned(m) for m in linears):
            return None
        layer_norms = (layer.input_layernorm, layer.post_attention_layernorm)
        weights += [layer_norms[0].weight, *(m.weight for m in linears[:4]),
                    layer_norms[1].weight, *(m.weight for m in linears[4:])]
        shapes.add(tuple(tuple(m.weight.shape) for m in linears))
        norms += [n.variance_epsilon for n in layer_norms]
    if len(shapes) != 1 or not gguf_blocks.load():  # (the step is built with the kernels)
        return None
    return weights, [], sys.maxsize, shapes.pop(), norms
