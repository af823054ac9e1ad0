"""Tiny random causal LMs built on the fly (no hub), for tests and `batchspec bench --quick`:
a Llama-style model (RoPE) and a GPT-2-style model (learned absolute positions), plus a draft
that agrees with its target only sometimes."""
import pathlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 96
EOS = 3  # placeholder in the configs; save_pair picks a real one per model (pick_eos)


def llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2,
                         eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        initializer_range=0.2, eos_token_id=EOS, bos_token_id=1)
    return GPT2LMHeadModel(config).eval()


BUILDERS = {"llama": llama, "gpt2": gpt2}


def noisy_copy(model, seed: int, scale: float):
    """The model with Gaussian noise on every weight: a draft that is right only sometimes."""
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return draft


@torch.no_grad()
def greedy_ignoring_eos(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target alone at batch 1: plain greedy decoding that treats EOS as an ordinary token
    (the reference for requests with ignore_eos)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens


def pick_eos(model, rate: float = 0.04) -> int:
    """A token the model picks greedily about `rate` of the time: as EOS it gives early stops
    in some requests but not all."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randint(4, VOCAB, (64, 16), generator=generator)
    with torch.no_grad():
        picks = model(inputs).logits.argmax(-1).flatten()
    freq = torch.bincount(picks, minlength=VOCAB).float() / picks.numel()
    return int((freq - rate).abs().argmin())


def save_pair(arch: str, root: pathlib.Path, noise: float = 0.08) -> tuple[str, str]:
    """Save a (target, draft) pair of `arch` under root; returns their directories."""
    target = BUILDERS[arch](seed=0)
    draft = noisy_copy(target, seed=1, scale=noise)
    eos = pick_eos(target)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / f"{arch}-{name}"
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
        model.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]
