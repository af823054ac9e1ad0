"""A lean forward for the model families the runtime serves: Llama-style decoders (Llama,
Mistral, Qwen2; and a feature head's decoder layer) and GPT-2.

transformers' forward spends about as long again as the layers' own work on a small model
(output dataclasses, mask factories, kwarg plumbing, hooks, per-layer wrappers). This one
calls the model's own modules in the order its transformers forward does, over the same
cache object (its layers' `update`, so positions land in the runtime's buffers) and through
the same attention function (attention.grouped_sdpa, with the mask transformers would build:
None where it would skip it), so the logits are those of transformers' forward bit for bit
(tested). A model of another family, or one whose attention is not the runtime's, keeps
transformers' forward (`lean_forward` returns None).
"""
import functools
from collections.abc import Callable

import torch

from batchspec.runtime import attention, decode_step, fastlinear, gguf_blocks

LLAMA_TYPES = ("llama", "mistral", "qwen2")


def lean_forward(model: torch.nn.Module) -> Callable | None:
    """forward(input_ids, position_ids, cache, column_mask, num_logits, keep_hidden,
    features=None) -> (logits [batch, num_logits, vocab] or None, hidden or None) for
    `model`, or None where it has none (see the module docstring). num_logits 0: no logits.
    hidden: the final hidden states of every position (after the last norm), where kept."""
    from batchspec.runtime.feature_head import FeatureHead

    if isinstance(model, FeatureHead):
        body = _llama_body(model.body)
        return None if body is None else _head(model, body)
    config = model.config
    if getattr(config, "model_type", None) in LLAMA_TYPES:
        body = _llama_body(model.model)
        return None if body is None else _causal_lm(model.model.embed_tokens, body,
                                                    model.lm_head)
    if getattr(config, "model_type", None) == "gpt2" and _runtime_attention(config) \
            and not config.reorder_and_upcast_attn and not config.add_cross_attention:
        return _causal_lm(model.transformer.wte, _gpt2_body(model.transformer), model.lm_head)
    return None


def _runtime_attention(config) -> bool:
    return getattr(config, "_attn_implementation", None) == attention.NAME


def _llama_body(base) -> Callable | None:
    """body(embedded, position_ids, cache, mask) -> final hidden states, for a LlamaModel
    (or a sibling of the same layout); None where the layout differs."""
    layers = list(base.layers[:base.config.num_hidden_layers])
    plain = all(type(getattr(layer.self_attn, "q_norm", None)) is type(None)
                and getattr(layer.self_attn, "sliding_window", None) is None
                for layer in layers)
    if not (_runtime_attention(base.config) and plain and hasattr(base, "rotary_emb")):
        return None
    qkv_blocks = [_joined((layer.self_attn.q_proj, layer.self_attn.k_proj,
                           layer.self_attn.v_proj)) for layer in layers]
    gate_up_blocks = [_joined((layer.mlp.gate_proj, layer.mlp.up_proj))
                      if type(layer.mlp).__name__ in _MLPS else None for layer in layers]
    projections = [(_attention_inputs(layer.self_attn, qkv), _feed_forward(layer.mlp, gate_up))
                   for layer, qkv, gate_up in zip(layers, qkv_blocks, gate_up_blocks)]
    inline = all(type(n).__name__ in RMS_NORMS for layer in layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm))
    decoder = decode_step.Decoder.of(base, layers, qkv_blocks, gate_up_blocks) \
        if inline and all(type(layer.mlp).__name__ in _MLPS for layer in layers) else None

    def body(hidden, position_ids, cache, mask):
        batch, width, _ = hidden.shape
        cos, sin = base.rotary_emb(hidden, position_ids)
        cos, sin = cos[:, :, None], sin[:, :, None]  # over [batch, width, heads, head_dim]
        stepped = None if decoder is None else decoder(hidden, cos, sin, cache, mask)
        if stepped is not None:
            return _rms_norm(base.norm, stepped)
        for index, (layer, (qkv, feed_forward)) in enumerate(zip(layers, projections)):
            attn = layer.self_attn
            q, k, v = qkv(_rms_norm(layer.input_layernorm, hidden), cos, sin)
            k, v = cache.update(k, v, index)
            out, _ = attention.grouped_sdpa(attn, q, k, v, mask, scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(batch, width, -1).contiguous())
            hidden = hidden + feed_forward(_rms_norm(layer.post_attention_layernorm, hidden))
        return _rms_norm(base.norm, hidden)

    body.decoder = decoder  # (draft_loop steps with it)
    return body


# RMS norms whose forward is _rms_norm's (transformers' Llama-family norm)
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """norm(hidden), the same operations inline for transformers' Llama-family norms."""
    if type(norm).__name__ not in RMS_NORMS:
        return norm(hidden)
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon)).to(dtype)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, width, heads, head_dim] with rotary embeddings applied (transformers'
    apply_rotary_pos_emb, over this layout)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _attention_inputs(attn, joined) -> Callable:
    """qkv(x, cos, sin) -> q, k, v [batch, heads, width, head_dim], q and k rotated.

    Where the three projections have `joined` GGUF blocks, a product of a few rows is one
    call over them, and q and k are rotated together; each output is what its own layer
    gives (the kernels sum each output alone, in one order)."""
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    sizes = [m.out_features for m in linears]

    def qkv(x, cos, sin):
        batch, width, _ = x.shape
        shape = (batch, width, -1, attn.head_dim)
        out = None if joined is None else fastlinear.by_blocks(x, joined)
        if out is None:
            q, k, v = (m(x).view(shape) for m in linears)
            q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        else:
            qk = _rotated(out[..., :sizes[0] + sizes[1]].view(shape), cos, sin)
            heads = sizes[0] // attn.head_dim
            q, k, v = qk[:, :, :heads], qk[:, :, heads:], out[..., -sizes[2]:].view(shape)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    return qkv


# feed-forward blocks whose forward is down(act(gate(x)) * up(x)) (transformers' LlamaMLP)
_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")


def _feed_forward(mlp, joined) -> Callable:
    """mlp's forward, its gate and up products one call over their `joined` GGUF blocks where
    they have them (see _attention_inputs); packed to the real positions as the module itself
    is (fastlinear)."""
    if joined is None:
        return mlp
    inner = mlp.gate_proj.out_features
    down = mlp.down_proj

    def forward(x):
        out = fastlinear.by_blocks(x, joined)
        if out is None:
            return down(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return down(mlp.act_fn(out[..., :inner]) * out[..., inner:])

    if getattr(mlp, "packs_positions", False):
        return functools.partial(fastlinear.packed_forward, forward)
    return forward


def _joined(linears) -> "gguf_blocks.Blocks | None":
    """The GGUF blocks of bias-free linear layers fed one input, joined (None where any has
    none)."""
    if any(m.bias is not None for m in linears):
        return None
    return gguf_blocks.join([m.weight for m in linears])


def _gpt2_body(base) -> Callable:
    blocks = list(base.h[:base.config.num_hidden_layers])

    def body(hidden, position_ids, cache, mask):
        batch, width, _ = hidden.shape
        hidden = hidden + base.wpe(position_ids)
        for index, block in enumerate(blocks):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(hidden)).split(attn.split_size, dim=2)
            shape = (batch, width, -1, attn.head_dim)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            k, v = cache.update(k, v, index)
            out, _ = attention.grouped_sdpa(attn, q, k, v, mask, scaling=attn.scaling)
            hidden = attn.c_proj(out.reshape(batch, width, -1).contiguous()) + hidden
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return base.ln_f(hidden)

    return body


def _causal_lm(embed, body, head) -> Callable:
    @torch.inference_mode()
    def forward(input_ids, position_ids, cache, column_mask, num_logits, keep_hidden,
                features=None):
        hidden = body(embed(input_ids), position_ids, cache,
                      causal_mask(column_mask, *input_ids.shape, cache))
        logits = head(hidden[:, -num_logits:]) if num_logits else None
        return logits, hidden if keep_hidden else None

    forward.decoder = getattr(body, "decoder", None)  # a Llama body's C++ step, or None
    return forward


def _head(model, body) -> Callable:
    """A feature head: its tokens' embeddings fused with the features before them, through
    its decoder layer; the hidden states (its predicted features) always kept, its logits
    over its own vocabulary (SubsetHead.subset_logits)."""
    @torch.inference_mode()
    def forward(input_ids, position_ids, cache, column_mask, num_logits, keep_hidden,
                features=None):
        embedded = model.embed_tokens(input_ids)
        fused = model.fuse(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))
        hidden = body(fused, position_ids, cache,
                      causal_mask(column_mask, *input_ids.shape, cache))
        logits = model.lm_head.subset_logits(hidden[:, -num_logits:]) if num_logits else None
        return logits, hidden

    forward.decoder = getattr(body, "decoder", None)
    return forward


def causal_mask(column_mask: torch.Tensor | None, batch: int, num_new: int,
                cache) -> torch.Tensor | None:
    """The attention mask transformers' SDPA path gives a forward feeding num_new tokens after
    the cache's columns, column_mask [batch, columns + num_new] marking real columns (None:
    all): None where every column is real and the queries are one token or the whole
    sequence (SDPA's own causal flag then), else [batch, 1, num_new, columns + num_new] bool,
    True where a query may attend."""
    past = cache.get_seq_length()
    if column_mask is not None and bool(column_mask.all()):
        column_mask = None
    if column_mask is None and (num_new == 1 or past == 0):
        return None
    device = column_mask.device if column_mask is not None else cache.layers[0].keys.device
    total = past + num_new
    columns = torch.arange(total, device=device)
    causal = columns[None, :] <= (past + torch.arange(num_new, device=device))[:, None]
    if column_mask is None:
        return causal[None, None].expand(batch, 1, num_new, total)
    return causal[None, None] & column_mask.bool()[:, None, None, :]
