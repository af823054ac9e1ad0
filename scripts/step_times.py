"""Median time of one forward step at batch 1 on CPU: N new tokens onto a cache of C positions,
with each way `batchspec.runtime.fastlinear` can compute the linear layers:

    usual  x @ W.T everywhere (plain nn.Linear)
    fixed  weight-major, fastlinear.DEFAULT_PLAN (one row computed as two)
    packed the oneDNN-packed weight everywhere (fastlinear.PACKED)
    tuned  the plan fastlinear.tune times on this machine (what the services use)

    python3 scripts/step_times.py --model smollm2 --context 200 --tokens 1,3,4

N = 1 is a decode step; N = K + 1 is a verify of K drafts.
"""
import argparse
import statistics
import time

import torch

from batchspec.runtime import fastlinear, kvcache, models

MODES = ("usual", "fixed", "packed", "tuned")


def linear_shapes(model) -> set[tuple]:
    return {(*m.weight.shape, m.weight.dtype) for m in model.modules()
            if isinstance(m, torch.nn.Linear) or getattr(m, "uses_weight_major", False)}


def use_mode(model, mode: str, tuned: dict) -> None:
    plans = {"usual": (fastlinear.USUAL,) * len(fastlinear.DEFAULT_PLAN),
             "packed": (fastlinear.PACKED,) * len(fastlinear.DEFAULT_PLAN),
             "fixed": fastlinear.DEFAULT_PLAN}
    for key in linear_shapes(model):
        fastlinear._PLANS[key] = tuned[key] if mode == "tuned" else plans[mode]


@torch.inference_mode()
def step_ms(model, context: int, num_tokens: int, repeats: int) -> float:
    prefix = kvcache.returned_cache(model(torch.randint(0, 1000, (1, context)), use_cache=True))
    layers = kvcache.from_model_cache(prefix)
    times = []
    for _ in range(repeats + 2):
        cache = kvcache.to_model_cache([(k[:, :, :context], v[:, :, :context]) for k, v in layers])
        ids = torch.randint(0, 1000, (1, num_tokens))
        positions = torch.arange(context, context + num_tokens)[None]
        started = time.perf_counter()
        out = model(input_ids=ids, position_ids=positions, use_cache=True,
                    logits_to_keep=num_tokens, **kvcache.with_cache(model, cache))
        out.logits.float().argmax(-1)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--tokens", default="1,3,4")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model = models.load_causal_lm(args.model)
    fastlinear._PLANS.clear()
    tuned = {key: fastlinear._timed_plan(*key) for key in linear_shapes(model)}
    counts = [int(n) for n in args.tokens.split(",")]
    print(f"{args.model}, batch 1, {args.context} cached positions, {torch.get_num_threads()} "
          "threads; median ms per step")
    print("tokens " + "".join(f"{mode:>9}" for mode in MODES))
    for n in counts:
        row = []
        for mode in MODES:
            use_mode(model, mode, tuned)
            row.append(step_ms(model, args.context, n, args.repeats))
        print(f"{n:>6} " + "".join(f"{ms:>9.1f}" for ms in row))


if __name__ == "__main__":
    main()
