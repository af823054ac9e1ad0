"""A feature-level (EAGLE-style) draft head: one decoder layer that reads the target's own
features and predicts the next ones.

Features of position i are the target's final hidden state there, after its last norm: what
its output head reads to score token i + 1. The head's position j takes token x_j and the
target's features of position j - 1 (zeros for j = 0), fused by one linear layer, runs them
through its decoder layer (its own KV cache, its own rotary positions) and outputs predicted
features of position j, which the target's output head (rows of a draft vocabulary) turns
into a guess at x_{j+1}. Drafting further, the head feeds its own predicted features in place
of the target's.

A head directory holds `batchspec_draft.json` (format FORMAT: the target it reads, its layer
shape and how it was trained), `head.safetensors` (fuse, layer and norm weights) and
`vocab.json` (the draft vocabulary). The token embedding and the output head are the target's:
they are loaded from the target, never stored.
"""
import dataclasses
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

from batchspec.runtime import kvcache

FORMAT = "batchspec-feature-head-v1"
WEIGHTS = "head.safetensors"


@dataclasses.dataclass
class HeadOutput:
    logits: torch.Tensor  # [batch, logits_to_keep, vocab]
    cache: object
    hidden: torch.Tensor  # [batch, T, hidden] predicted features of every fed position


def is_head_manifest(manifest: dict) -> bool:
    return manifest.get("format") == FORMAT


def body_config(target_config, max_context_len: int):
    """The head's decoder-layer config: the shape of the target's layers (a Llama-style one
    for any target), one layer, no vocabulary of its own."""
    from transformers import LlamaConfig

    hidden = target_config.hidden_size
    heads = getattr(target_config, "num_attention_heads", None) or target_config.n_head
    config = LlamaConfig(
        vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        hidden_size=hidden,
        intermediate_size=getattr(target_config, "intermediate_size", None) or 4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
        num_hidden_layers=1, max_position_embeddings=max_context_len,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        tie_word_embeddings=False)
    rope = getattr(target_config, "rope_parameters", None)
    if rope:
        config.rope_parameters = dict(rope)
    config._attn_implementation = "sdpa"
    return config


class FeatureHead(torch.nn.Module):
    """The head as a causal LM the model-runner drives: forward(input_ids, position_ids,
    cache, attention_mask, logits_to_keep, features) with features [batch, T,
    hidden], the features of the position before each fed token."""

    def __init__(self, target, vocab: list[int], max_context_len: int):
        super().__init__()
        from transformers import LlamaModel

        from batchspec.runtime.draft_model import SubsetHead

        cfg = body_config(target.config, max_context_len)
        hidden = cfg.hidden_size
        self.body = LlamaModel(cfg)
        # what the runner reads: the target's vocabulary and context
        self.config = cfg.__class__.from_dict(cfg.to_dict())
        self.config.vocab_size = int(target.config.vocab_size)
        self.config._attn_implementation = "sdpa"
        self.embed_tokens = target.get_input_embeddings()
        self.embed_tokens.weight.requires_grad_(False)
        self.fuse = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.lm_head = SubsetHead(target.get_output_embeddings().weight, vocab,
                                  int(target.config.vocab_size))
        self.vocab = list(vocab)
        self.feature_width = hidden
        self.cache_keyword = kvcache.cache_keyword(self.body)  # asked once: forwards are hot

    def forward(self, input_ids, features, position_ids=None, cache=None,
                attention_mask=None, use_cache=True, logits_to_keep=1, **_):
        embedded = self.embed_tokens(input_ids)
        fused = self.fuse(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))
        out = self.body(inputs_embeds=fused, position_ids=position_ids,
                        attention_mask=attention_mask, use_cache=use_cache,
                        **{self.cache_keyword: cache})
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:]) if logits_to_keep else None
        return HeadOutput(logits, kvcache.returned_cache(out), hidden)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a head directory stores: everything but the target's embedding and head."""
        state = {f"fuse.{k}": v for k, v in self.fuse.state_dict().items()}
        state.update({f"body.{k}": v for k, v in self.body.state_dict().items()
                      if not k.startswith("embed_tokens")})
        return state

    def load_trained(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.trained_state()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"head weights lack {missing[:3]}")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(tensors[name].to(tensor.dtype))

    def init_from_target(self, target) -> None:
        """Start from the target's last decoder layer and final norm where their shapes match
        (a Llama-style target) with its residual branches off (output projections zero: the
        layer starts as the identity and learns what to add), and a fuse that adds the
        token's embedding to the features."""
        body = target.base_model
        with torch.no_grad():
            hidden = self.feature_width
            self.fuse.weight.zero_()
            self.fuse.weight[:, :hidden] = torch.eye(hidden)
            self.fuse.weight[:, hidden:] = torch.eye(hidden)
            layer = self.body.layers[0]
            source = getattr(body, "layers", [None])[-1]
            if source is not None:
                own = layer.state_dict()
                theirs = source.state_dict()
                if all(k in theirs and theirs[k].shape == v.shape for k, v in own.items()):
                    layer.load_state_dict(theirs)
                norm = getattr(body, "norm", None)
                if norm is not None and norm.weight.shape == self.body.norm.weight.shape:
                    self.body.norm.weight.copy_(norm.weight)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def save_head(out: pathlib.Path, head: FeatureHead, manifest: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", torch.float16).contiguous()
               for k, v in head.trained_state().items()}, str(out / WEIGHTS))
    (out / WEIGHTS).chmod(0o644)  # written private; a head is read by services of any user
    (out / "vocab.json").write_text(json.dumps(head.vocab))
    from batchspec.runtime.draft_model import MANIFEST

    (out / MANIFEST).write_text(json.dumps({**manifest, "format": FORMAT}, indent=2))


def build_head(target, vocab: list[int], max_context_len: int) -> FeatureHead:
    return FeatureHead(target, vocab, max_context_len)


def load_head(path: str, target, max_context_len: int, *, dtype: str,
              device: str) -> FeatureHead:
    """The head a directory describes, on its target (loaded by the caller, float32 on the
    CPU: its embedding and output head are shared with the head; its layers are not kept)."""
    from batchspec.runtime import attention, fastlinear

    root = pathlib.Path(path)
    vocab = json.loads((root / "vocab.json").read_text())
    head = FeatureHead(target, vocab, max_context_len)
    head.load_trained(load_file(str(root / WEIGHTS)))
    fastlinear.patch_linears(head)
    fastlinear.patch_feed_forwards(head)
    attention.install(head.body)
    return head.to(device=device, dtype=getattr(torch, dtype)).eval()
