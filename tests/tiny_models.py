"""Tiny model pairs (from batchspec.runtime.tiny) and the target-alone references.

Each runs on the model services' compute thread (batchspec.runtime.compute): a test process
whose main thread also ran torch would hold two OpenMP teams, and from then on every worker
sleeps between parallel regions, which made both the references and the services in-process
several times slower."""
import functools

import torch

from batchspec.runtime import compute, tiny
from batchspec.runtime.tiny import BUILDERS, EOS, VOCAB, noisy_copy, pick_eos  # noqa: F401


def on_compute_thread(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return compute.run(fn, *args, **kwargs)
    return run


save_pair = on_compute_thread(tiny.save_pair)
save_feature_head = on_compute_thread(tiny.save_feature_head)
save_one_layer_target = on_compute_thread(tiny.save_one_layer_target)
save_translating_pair = on_compute_thread(tiny.save_translating_pair)
greedy_ignoring_eos = on_compute_thread(tiny.greedy_ignoring_eos)


@on_compute_thread
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


@on_compute_thread
def reference_sampled(model, prompt: list[int], max_new_tokens: int, params) -> list[int]:
    """The target alone at batch 1 sampling with `params` (a SamplingParams), end-of-sequence
    ignored: one token a forward over its own KV cache, and the seeded choice of
    batchspec.runtime.sampling for that (seed, position), the definition the services'
    output must equal whatever they drafted."""
    from batchspec.runtime import sampling

    return tiny.decode_ignoring_eos(model, prompt, max_new_tokens, lambda logits, position: int(
        sampling.choose(logits, [params], [position])[0, 0]))
