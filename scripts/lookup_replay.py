"""Replay the n-gram draft over the target's own greedy answers: what a lookup in each
sequence's own tokens proposes, and what a shared index over earlier sequences (a suffix store
across requests) would add. Greedy decoding makes this exact without serving anything: a
proposal is accepted up to its first token that differs from the answer.

    python3 scripts/lookup_replay.py --prompts docs/bench/heldout_prompts.jsonl --num-prompts 32

Prints, per variant, target passes per token, the share of steps that verify a proposal, the
share of proposed tokens accepted, and the speed-up over plain decoding under a cost model (a
row's verify of T tokens costs --step-ms + --token-ms x (T - 1); defaults: batch 1 on a 2-core
CPU; for a row of a batch, its share of a plain step and what a token more costs the step).
The last variant, "oracle", verifies only the drafts that will be accepted: a ceiling for any
policy drafting with this lookup. --prefill-share adds the whole run's speed-up where that
share of a plain run goes to prefilling prompts. --min-n 3 proposes only after a match of 3
tokens or more.
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
           min_n: int = NgramConfig.min_n, oracle: bool = False):
    """shared: None (own tokens only), "all" (earlier prompts and answers) or "answers".
    oracle: each proposal is verified only up to its last token that will be accepted (none
    when its first is rejected): the most any choice of what to verify could earn from
    these proposals. Returns (passes per token, share of steps proposing, share of proposed
    tokens accepted, modelled speed-up)."""
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
            if oracle:
                proposal = proposal[:accepted]
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
    parser.add_argument("--step-ms", type=float, default=32.0,
                        help="a plain step's cost per row (a batch-1 step by default)")
    parser.add_argument("--token-ms", type=float, default=3.25,
                        help="what one more verified token adds to a step")
    parser.add_argument("--prefill-share", type=float, default=0.0,
                        help="the share of a plain run spent prefilling prompts, which no "
                             "draft shortens: the whole run's speed-up is printed beside")
    args = parser.parse_args()
    if not Path(args.prompts).is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    if min(args.num_prompts, args.max_new_tokens, args.k, args.min_n) < 1:
        parser.error("--num-prompts, --max-new-tokens, -k and --min-n must be >= 1")
    if not 0 <= args.prefill_share < 1:
        parser.error("--prefill-share must be in [0, 1)")
    pairs = answers(args.prompts, args.num_prompts, args.max_new_tokens)
    variants = [(shared, False) for shared in (None, "all", "answers")] + [(None, True)]
    for shared, oracle in variants:
        per_token, share, accepted, speedup = replay(pairs, args.k, shared,
                                                     step_ms=args.step_ms,
                                                     token_ms=args.token_ms, min_n=args.min_n,
                                                     oracle=oracle)
        whole = 1 / (args.prefill_share + (1 - args.prefill_share) / speedup)
        print(f"{'oracle' if oracle else 'shared index ' + (shared or 'none'):21s} "
              f"passes/token {per_token:.3f}  steps verifying a proposal {share:.0%}  "
              f"drafts accepted {accepted:.0%}  modelled speed-up {speedup:.2f}x"
              + (f", {whole:.2f}x with prefills" if args.prefill_share else ""))


if __name__ == "__main__":
    main()
