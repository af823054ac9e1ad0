"""A draft's greedy steps in one C++ call (csrc/gguf_linear.cpp: llama_draft).

After a proposal's first forward (the appended tokens, through the lean forward), each
further draft is one single-token step per row: its embedding, every layer as llama_step
computes it (step_ops' loops; over float32 weights or GGUF blocks), the final norm, the head
and the first largest logit, fed to the next step, with no Python between the steps.

A draft's numbers never reach the output (the target verifies every token), so the loop
computes as llama_step does, not bit for bit as the lean forward: its drafts may differ from
the lean forward's only where two logits are within rounding of each other.

It takes the steps of a Llama-family causal LM whose layers the C++ step takes
(decode_step.Decoder), whose input embedding and head are plain float32 weights (a
distilled draft's subset head included) and whose final norm is transformers' RMS norm; every
row greedy, on the CPU, over the runtime's cache buffers. A feature head, a sampled row or any
other model keeps the forward a step.
"""
import dataclasses
import logging

import torch

from batchspec.runtime import decode_step, forward, kvcache

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DraftLoop:
    decoder: decode_step.Decoder
    embed: torch.Tensor  # [vocab, width]
    norm: torch.Tensor  # the final norm's weight [width]
    norm_eps: float
    head: torch.Tensor  # [vocab', width]
    head_ids: torch.Tensor | None  # the token of each head row; None: row i is token i
    cos: torch.Tensor  # [positions, head_dim]: the rotation of every position
    sin: torch.Tensor

    @classmethod
    def of(cls, model, lean_forward, max_context_len: int) -> "DraftLoop | None":
        """The loop of `model`, whose lean forward is `lean_forward` (see the module
        docstring), or None where it has none."""
        from batchspec.runtime.draft_model import SubsetHead

        decoder = getattr(lean_forward, "decoder", None)
        if decoder is None or getattr(model.config, "model_type", None) \
                not in forward.LLAMA_TYPES or getattr(model, "feature_width", 0):
            return None
        base, head = model.model, model.lm_head
        embed = base.embed_tokens
        head_ids = head.token_ids if isinstance(head, SubsetHead) else None
        plain = isinstance(head, SubsetHead) or (isinstance(head, torch.nn.Linear)
                                                 and head.bias is None)
        if not plain or type(embed) is not torch.nn.Embedding \
                or type(base.norm).__name__ not in forward.RMS_NORMS or any(
                    w.dtype != torch.float32 or w.device.type != "cpu"
                    for w in (embed.weight, head.weight, base.norm.weight)):
            return None
        positions = torch.arange(max_context_len)[None]
        with torch.inference_mode():
            cos, sin = base.rotary_emb(embed.weight[:1, None], positions)
        log.info("draft steps after a proposal's first run in one C++ loop")
        return cls(decoder, embed.weight.detach(), base.norm.weight.detach(),
                   float(base.norm.variance_epsilon), head.weight.detach(), head_ids,
                   cos[0].float().contiguous(), sin[0].float().contiguous())

    def takes(self, cache, batch: int, last_position: int) -> bool:
        """Whether a loop of single-token steps of `batch` rows over `cache` up to
        `last_position` is one this loop runs."""
        layers = getattr(cache, "layers", ())
        return (batch <= self.decoder.max_rows and last_position < self.cos.shape[0]
                and len(layers) * self.decoder.per_layer == len(self.decoder.weights)
                and all(isinstance(layer, kvcache.AppendLayer) and layer.is_initialized
                        and layer.keys.dim() == 4 and layer.keys.shape[0] == batch
                        for layer in layers))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                 column_mask: torch.Tensor | None, steps: int, sure: torch.Tensor,
                 min_confidence: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens [batch] at positions [batch], then each step's choice, for `steps`
        steps (fewer where min_confidence cuts every row: see llama_draft); the cache's
        layers advanced by the steps run. Returns (choices [batch, run], their
        confidences [batch, run])."""
        d = self.decoder
        buffers = [layer.room(steps, layer.keys) for layer in cache.layers]
        chosen, confidence = torch.ops.batchspec_gguf.llama_draft(
            tokens, positions, self.embed, self.cos, self.sin, d.weights,
            d.kinds, [b.keys for b in buffers], [b.values for b in buffers],
            [b.written for b in buffers], column_mask, self.norm, self.head, self.head_ids,
            steps, d.heads, d.kv_heads, d.head_dim, d.eps, d.scaling, self.norm_eps, sure,
            min_confidence)
        for layer, buffer in zip(cache.layers, buffers):
            layer.keys, layer.values = buffer.advanced(chosen.shape[1])
        return chosen, confidence
