"""A draft's proposal in one C++ call (csrc/gguf_linear.cpp: llama_draft).

Its K steps: the first feeds the appended tokens, each after it the draft the one before
chose, one position a row; each step's embeddings (a feature head's fused with the target's
features of the appended tokens, then with those the step before predicted), every layer as
llama_step computes it (step_ops' loops; over float32 weights or GGUF blocks), the final
norm, the head and the choice (a greedy row's first largest logit, a sampled row's seeded
Gumbel-max choice as sampling.choose makes it), with no Python between the steps.

A draft's numbers never reach the output (the target verifies every token), so the loop
computes as llama_step does, not bit for bit as the lean forward: its drafts may differ from
the lean forward's only where two logits (a sampled row's: two scores) are within rounding
of each other.

It takes the steps of a Llama-family causal LM or feature head whose layers the C++ step
takes (decode_step.Decoder), whose input embedding is a float32 nn.Embedding, whose head (a
distilled draft's subset head included) and feature fuse are bias-free and float32 or
GGUF blocks, and whose final norm is transformers' RMS norm; on the CPU, over the runtime's
cache buffers. GPT-2 or any other model keeps a forward a step.
"""
import dataclasses
import logging

import torch

from batchspec.runtime import decode_step, forward, gguf_blocks, kvcache

log = logging.getLogger(__name__)

FLOAT32 = -1  # llama_draft's kind of a float32 weight (else decode_step's block kind codes)


@dataclasses.dataclass(frozen=True)
class Product:
    """A bias-free linear layer's weight as llama_draft multiplies by it: float32 [out, in],
    and its GGUF blocks where it has them, for up to `max_rows` rows."""
    weight: torch.Tensor
    blocks: gguf_blocks.Blocks | None

    @classmethod
    def of(cls, module) -> "Product | None":
        weight = getattr(module, "weight", None)
        if weight is None or getattr(module, "bias", None) is not None \
                or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        blocks = gguf_blocks.blocks_of(weight)
        return cls(weight.detach(), blocks if blocks is not None
                   and blocks.kind in decode_step.KINDS else None)

    def args(self, rows: int) -> tuple[torch.Tensor, int]:
        """(weight, kind) for a product of `rows` rows."""
        if self.blocks is not None and rows <= self.blocks.max_rows:
            return self.blocks.data, decode_step.KINDS[self.blocks.kind]
        return self.weight, FLOAT32


@dataclasses.dataclass(frozen=True)
class DraftLoop:
    decoder: decode_step.Decoder
    embed: torch.Tensor  # [vocab, width]
    fuse: Product | None  # a feature head's: [width, 2 * width]
    norm: torch.Tensor  # the final norm's weight [width]
    norm_eps: float
    head: Product  # [vocab', width]
    head_ids: torch.Tensor | None  # the token of each head row; None: row i is token i
    cos: torch.Tensor  # [positions, head_dim]: the rotation of every position
    sin: torch.Tensor

    @classmethod
    def of(cls, model, lean_forward, max_context_len: int) -> "DraftLoop | None":
        """The loop of `model`, whose lean forward is `lean_forward` (see the module
        docstring), or None where it has none."""
        from batchspec.runtime.draft_model import SubsetHead
        from batchspec.runtime.feature_head import FeatureHead

        decoder = getattr(lean_forward, "decoder", None)
        if decoder is None or getattr(model.config, "model_type", None) \
                not in forward.LLAMA_TYPES:
            return None
        head_module = model.lm_head
        if isinstance(model, FeatureHead):
            base, embed, fuse = model.body, model.embed_tokens, Product.of(model.fuse)
            if fuse is None:
                return None
        else:
            base, embed, fuse = model.model, model.model.embed_tokens, None
        head = Product.of(head_module) if isinstance(head_module, (SubsetHead, torch.nn.Linear)) \
            else None
        if head is None or type(embed) is not torch.nn.Embedding \
                or type(base.norm).__name__ not in forward.RMS_NORMS or any(
                    w.dtype != torch.float32 or w.device.type != "cpu"
                    for w in (embed.weight, base.norm.weight)):
            return None
        positions = torch.arange(max_context_len)[None]
        with torch.inference_mode():
            cos, sin = base.rotary_emb(embed.weight[:1, None], positions)
        log.info("draft steps after a proposal's first run in one C++ loop")
        return cls(decoder, embed.weight.detach(), fuse, base.norm.weight.detach(),
                   float(base.norm.variance_epsilon), head,
                   head_module.token_ids if isinstance(head_module, SubsetHead) else None,
                   cos[0].float().contiguous(), sin[0].float().contiguous())

    def takes(self, cache, positions: int, last_position: int) -> bool:
        """Whether a proposal feeding `positions` positions a step at most (over all rows)
        over `cache`, up to `last_position`, is one this loop runs."""
        layers = getattr(cache, "layers", ())
        return (positions <= self.decoder.max_rows and last_position < self.cos.shape[0]
                and len(layers) * self.decoder.per_layer == len(self.decoder.weights)
                and all(isinstance(layer, kvcache.AppendLayer) and layer.is_initialized
                        and layer.keys.dim() == 4 for layer in layers))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                 column_mask: torch.Tensor | None, steps: int, sure: torch.Tensor,
                 min_confidence: float, features: torch.Tensor | None = None,
                 sampling: list[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens [batch, fed] from positions [batch] on (a feature head: after
        features [batch, fed, width]), then each step's choice, for `steps` steps (fewer where
        min_confidence cuts every row: see llama_draft); sampling: each row's temperature (0:
        greedy), top_k, top_p and seed (none: every row greedy). The cache's layers advanced
        by the positions fed. Returns (choices [batch, run], their confidences [batch,
        run])."""
        d, (rows, fed) = self.decoder, tokens.shape
        buffers = [layer.room(fed + steps - 1, layer.keys) for layer in cache.layers]
        fuse, fuse_kind = (None, FLOAT32) if self.fuse is None else self.fuse.args(rows * fed)
        chosen, confidence = torch.ops.batchspec_gguf.llama_draft(
            tokens, positions, self.embed, fuse, fuse_kind,
            None if features is None else features.float().contiguous(), self.cos, self.sin,
            d.weights, d.kinds, [b.keys for b in buffers], [b.values for b in buffers],
            [b.written for b in buffers], column_mask, self.norm, *self.head.args(rows),
            self.head_ids, list(sampling), steps, d.heads, d.kv_heads, d.head_dim, d.eps,
            d.scaling, self.norm_eps, sure, min_confidence)
        for layer, buffer in zip(cache.layers, buffers):
            layer.keys, layer.values = buffer.advanced(fed + chosen.shape[1] - 1)
        return chosen, confidence
