"""Tiny model pairs (from batchspec.runtime.tiny) and the target-alone greedy reference."""
import torch

from batchspec.runtime.tiny import (  # noqa: F401
    BUILDERS,
    EOS,
    VOCAB,
    greedy_ignoring_eos,
    noisy_copy,
    pick_eos,
    save_pair,
)


def reference_greedy(model, prompt: list[int], max_new_tokens: int,
                     ignore_eos: bool = False) -> list[int]:
    """The target alone at batch 1: Hugging Face greedy generate, up to the first EOS."""
    if ignore_eos:
        return greedy_ignoring_eos(model, prompt, max_new_tokens)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def reference_sampled(model, prompt: list[int], max_new_tokens: int, params) -> list[int]:
    """The target alone at batch 1 sampling with `params` (a SamplingParams), end-of-sequence
    ignored: at each position a full forward over every token so far, and the seeded choice
    of batchspec.runtime.sampling for that (seed, position), the definition the services'
    output must equal whatever they drafted."""
    from batchspec.runtime import sampling

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=model.device)).logits[:, -1:]
            tokens.append(int(sampling.choose(logits, [params], [len(tokens)])[0, 0]))
    return tokens[len(prompt):]
