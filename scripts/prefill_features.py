"""What returning features costs a target's prefill, in one process: the same prompts
prefilled in turn with and without the features a feature head is fed, medians in ms.

    python3 scripts/prefill_features.py --num-prompts 16 --rounds 6
"""
import argparse
import statistics
import time

from batchspec import cliargs
from batchspec.runtime import models
from batchspec.runtime.service import ServiceConfig, build_runner, warm_up
from batchspec_tools.data import bench_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="docs/bench/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=cliargs.positive_int, default=16)
    parser.add_argument("--rounds", type=cliargs.positive_int, default=6)
    args = parser.parse_args()
    runner = build_runner(ServiceConfig(model=models.model_path("smollm2")))
    warm_up(runner)
    tokenizer = models.load_tokenizer("smollm2")
    prompts = [models.chat_ids(tokenizer, p["prompt"])
               for p in bench_prompts(args.num_prompts, args.prompts)]
    seconds = {"with features": [], "plain": []}
    next_id = 0
    for _ in range(args.rounds):
        for kind in seconds:
            entries = [(next_id + i, p) for i, p in enumerate(prompts)]
            next_id += len(entries)
            started = time.perf_counter()
            if kind == "plain":
                runner.prefill(entries)
            else:
                runner.prefill_features(entries, keep=True)
            seconds[kind].append(time.perf_counter() - started)
            runner.release([seq_id for seq_id, _ in entries])
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions, {args.rounds} rounds")
    for kind, values in seconds.items():
        print(f"{kind}: median {1000 * statistics.median(values):.1f} ms "
              f"({', '.join(f'{1000 * v:.0f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
