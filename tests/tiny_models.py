"""Tiny model pairs (from batchspec.tiny) and the target-alone greedy reference."""
import torch

from batchspec.tiny import BUILDERS, EOS, VOCAB, noisy_copy, pick_eos, save_pair  # noqa: F401


def reference_greedy(model, prompt: list[int], max_new_tokens: int,
                     ignore_eos: bool = False) -> list[int]:
    """The target alone at batch 1: Hugging Face greedy generate, up to the first EOS."""
    if ignore_eos:
        return _greedy_loop(model, prompt, max_new_tokens)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@torch.no_grad()
def _greedy_loop(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain batch-1 greedy decoding that treats EOS as an ordinary token."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens
