"""Greedy agreement and decode-step cost of two drafts batchspec does not offer, against the
float32 target, on the first N benchmark prompts (teacher-forced on the target's answers):

    int8  the given draft with its linears dynamically quantized to int8
          (torch.ao.quantization.quantize_dynamic)
    bf16  a bfloat16 copy of the target itself

    python3 scripts/draft_variants_probe.py --draft smollm2-draft --num-prompts 24

Figures quoted in README ("Draft") came from this command; cost figures need a quiet CPU.
"""
import argparse
import copy

import torch

from batchspec import fastlinear, models
from batchspec.distill import load_tokenizer
from batchspec.draft_eval import agreement, bench_prompts, decode_step_seconds, target_answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default="smollm2-draft")
    parser.add_argument("--num-prompts", type=int, default=24)
    args = parser.parse_args()
    target = models.load_causal_lm(args.target)
    draft = models.load_causal_lm(args.draft)
    int8 = copy.deepcopy(draft)
    int8.model = torch.ao.quantization.quantize_dynamic(int8.model, {torch.nn.Linear},
                                                        dtype=torch.qint8)
    bf16 = models.load_causal_lm(args.target, dtype="bfloat16")
    variants = {"float32 draft": draft, "int8 draft": int8, "bf16 target": bf16}
    for model in (target, draft, bf16):
        fastlinear.tune(model)
    prompts = [r["prompt"] for r in bench_prompts(args.num_prompts)]
    pairs = target_answers(target, load_tokenizer(args.target), prompts, 64)
    target_s = decode_step_seconds(target)
    print(f"{args.num_prompts} prompts, {sum(len(a) for _, a in pairs)} positions; target step "
          f"{target_s * 1000:.2f} ms")
    for name, model in variants.items():
        cost = decode_step_seconds(model) / target_s
        print(f"{name:14s} agreement {agreement(model, pairs):.1%}  cost {cost:.1%}")


if __name__ == "__main__":
    main()
