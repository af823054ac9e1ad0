"""A distilled draft stored as what the target does not already hold.

A draft directory holds `batchspec_draft.json` (what it is built from and how it was trained),
`adapter.safetensors` (low-rank deltas for the kept layers, and the final norm) and
`vocab.json` (the token ids its output head covers). Loading takes the base model's first
`num_layers` layers, adds the deltas, and gives it a head over the vocabulary subset that
scores every other token -inf, so its distributions are over the full vocabulary.
"""
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

from batchspec.runtime import fastlinear

MANIFEST = "batchspec_draft.json"
ADAPTER = "adapter.safetensors"
VOCAB = "vocab.json"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_draft_dir(spec: str) -> bool:
    return (pathlib.Path(spec) / MANIFEST).is_file()


class LoRALinear(torch.nn.Module):
    """y = base(x) + scale * (x A^T) B^T with the base frozen; B starts at zero."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        fan_in, device = base.in_features, base.weight.device
        # drawn on CPU: the same seed starts the same deltas on any device
        self.lora_a = torch.nn.Parameter((torch.randn(rank, fan_in) / fan_in**0.5).to(device))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=device))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + self.scale * (self.lora_b @ self.lora_a)


class SubsetHead(torch.nn.Module):
    """Output head over a vocabulary subset; logits of other tokens are -inf."""

    uses_weight_major = True  # fastlinear.tune times its weight's shape

    def __init__(self, embedding_weight: torch.Tensor, token_ids: list[int], vocab_size: int):
        super().__init__()
        ids = torch.tensor(token_ids, dtype=torch.long, device=embedding_weight.device)
        self.register_buffer("token_ids", ids, persistent=False)
        self.weight = torch.nn.Parameter(embedding_weight[ids].detach().clone(),
                                         requires_grad=False)  # [subset, hidden]
        self.vocab_size = vocab_size

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return fastlinear.weight_major(hidden, self.weight)  # [..., subset]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.subset_logits(hidden)
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_ids] = logits
        return full


def attach_lora(model, rank: int, alpha: float) -> list[tuple[str, LoRALinear]]:
    """Wrap the kept layers' projections with LoRA; returns (qualified name, module) pairs."""
    wrapped = []
    for layer_index, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_TARGETS:
                if hasattr(parent, name):
                    module = LoRALinear(getattr(parent, name), rank, alpha)
                    setattr(parent, name, module)
                    wrapped.append((f"layers.{layer_index}.{name}", module))
    return wrapped


def attach_subset_head(model, token_ids: list[int]) -> SubsetHead:
    head = SubsetHead(model.get_input_embeddings().weight, token_ids, model.config.vocab_size)
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return head


def save_adapter(out: pathlib.Path, wrapped, norm_weight: torch.Tensor) -> None:
    def stored(tensor):
        return tensor.detach().to("cpu", torch.float16).contiguous()

    tensors = {"norm.weight": stored(norm_weight)}
    for name, module in wrapped:
        tensors[f"{name}.lora_a"] = stored(module.lora_a)
        tensors[f"{name}.lora_b"] = stored(module.lora_b)
    save_file(tensors, str(out / ADAPTER))


def read_manifest(path: str) -> dict:
    """A draft directory's manifest: its base model, layer count and LoRA settings."""
    return json.loads((pathlib.Path(path) / MANIFEST).read_text())


def apply_adapter(model, path: str, manifest: dict) -> None:
    """Turn `model` (the manifest's base model cut to its layers, float32) into the draft the
    directory describes: LoRA deltas merged, the trained final norm, the subset head."""
    root = pathlib.Path(path)
    tensors = load_file(str(root / ADAPTER))
    scale = manifest["lora_alpha"] / manifest["lora_rank"]
    with torch.no_grad():
        for layer_index, layer in enumerate(model.model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name in LORA_TARGETS:
                    key = f"layers.{layer_index}.{name}"
                    if hasattr(parent, name) and f"{key}.lora_a" in tensors:
                        a, b = tensors[f"{key}.lora_a"].float(), tensors[f"{key}.lora_b"].float()
                        getattr(parent, name).weight += scale * (b @ a)
        model.model.norm.weight.copy_(tensors["norm.weight"].float())
    attach_subset_head(model, json.loads((root / VOCAB).read_text()))
