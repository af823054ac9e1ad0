"""Replay the n-gram draft over the target's own greedy answers: what a lookup in each
sequence's own tokens proposes, and what a shared index over earlier sequences (a suffix store
across requests) would add. Greedy decoding makes this exact without serving anything: a
proposal is accepted up to its first token that differs from the answer.

    python3 scripts/lookup_replay.py --prompts docs/bench/heldout_prompts.jsonl --num-prompts 32

Prints, per variant, target passes per token, the share of steps that verify a proposal, the
share of proposed tokens accepted, and the speed-up over plain decoding under a batch-1 cost
model (a verify of T tokens costs --step-ms + --token-ms x (T - 1); defaults from a 2-core
CPU). --min-n 3 proposes only after a match of 3 tokens or more.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draft_service.ngram import NgramConfig, NgramIndex  # noqa: E402


def answers(prompts_file: str, count: int, max_new_tokens: int):
    import torch

    from batchspec.runtime import fastlinear, models
    from batchspec_tools.data import bench_prompts

    tokenizer = models.load_tokenizer("smollm2")
    model = models.load_causal_lm("smollm2")
    fastlinear.tune(model, models.kernel_plans_file())
    eos = models.eos_token_ids(model)
    out = []
    with torch.inference_mode():
        for row in bench_prompts(count, prompts_file):
            ids = models.chat_ids(tokenizer, row["prompt"])
            done = model.generate(input_ids=torch.tensor([ids]), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos[0])
            out.append((ids, done[0, len(ids):].tolist()))
    return out


def replay(pairs, k: int, shared: str | None, shared_n=(3, 6), step_ms=32.0, token_ms=3.25,
           min_n: int = NgramConfig.min_n):
    """shared: None (own tokens only), "all" (earlier prompts and answers) or "answers".
    Returns (passes per token, share of steps proposing, share of proposed tokens accepted,
    modelled speed-up)."""
    config = NgramConfig(min_n=min_n, max_n=max(min_n, NgramConfig.max_n))
    index: dict[tuple, tuple[list[int], int]] = {}  # n-gram -> (tokens, end), latest wins
    tokens = passes = proposing = drafted = taken = 0
    ms = 0.0
    for prompt, answer in pairs:
        own = NgramIndex(config.min_n, config.max_n)
        own.extend(prompt)
        t = 0
        while t < len(answer):
            proposal = own.propose(k)
            for n in range(shared_n[1], shared_n[0] - 1, -1):
                if proposal or shared is None:
                    break
                hit = index.get(tuple(own.tokens[-n:]))
                if hit:
                    proposal = hit[0][hit[1]:hit[1] + k]
            accepted = 0
            while (accepted < len(proposal) and t + accepted < len(answer)
                   and proposal[accepted] == answer[t + accepted]):
                accepted += 1
            step = min(accepted + 1, len(answer) - t)
            own.extend(answer[t:t + step])
            t += step
            tokens, passes = tokens + step, passes + 1
            proposing += bool(proposal)
            drafted, taken = drafted + len(proposal), taken + accepted
            ms += step_ms + token_ms * len(proposal)
        seen = prompt + answer if shared == "all" else answer
        for end in range(1, len(seen) + 1):
            for n in range(shared_n[0], min(shared_n[1], end) + 1):
                index[tuple(seen[end - n:end])] = (seen, end)
    return passes / tokens, proposing / passes, taken / max(drafted, 1), tokens * step_ms / ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=NgramConfig.min_n,
                        help="the shortest suffix match that proposes")
    parser.add_argument("--step-ms", type=float, default=32.0)
    parser.add_argument("--token-ms", type=float, default=3.25)
    args = parser.parse_args()
    if not Path(args.prompts).is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    if min(args.num_prompts, args.max_new_tokens, args.k, args.min_n) < 1:
        parser.error("--num-prompts, --max-new-tokens, -k and --min-n must be >= 1")
    pairs = answers(args.prompts, args.num_prompts, args.max_new_tokens)
    for shared in (None, "all", "answers"):
        per_token, share, accepted, speedup = replay(pairs, args.k, shared,
                                                     step_ms=args.step_ms,
                                                     token_ms=args.token_ms, min_n=args.min_n)
        print(f"shared index {shared or 'none':8s} passes/token {per_token:.3f}  "
              f"steps verifying a proposal {share:.0%}  drafts accepted {accepted:.0%}  "
              f"modelled speed-up {speedup:.2f}x")


if __name__ == "__main__":
    main()
