"""What returning features costs the target, in one process, through its servicer: the same
prompts prefilled, and the same rows verified (one token each, nothing drafted: a plain
step), in turn with and without the features a feature head is fed; medians in ms.

    python3 scripts/features_cost.py --num-prompts 32 --rounds 20
"""
import argparse
import statistics
import time

from batchspec import cliargs
from batchspec.runtime import models
from batchspec.runtime.service import ServiceConfig, build_runner, warm_up
from batchspec.v1 import cache_pb2, target_pb2
from batchspec_tools.data import bench_prompts
from target_service.servicer import TargetServicer

KINDS = ("with features", "plain")


def prefill_seconds(servicer, prompts, rounds: int) -> dict[str, list[float]]:
    seconds = {kind: [] for kind in KINDS}
    next_id = 0
    for turn in range(rounds):
        for kind in KINDS if turn % 2 == 0 else KINDS[::-1]:
            ids = list(range(next_id, next_id + len(prompts)))
            next_id += len(prompts)
            command = cache_pb2.PrefillCommand(
                return_features=kind == KINDS[0], entries=[
                    cache_pb2.PrefillEntry(seq_id=i, token_ids=p) for i, p in zip(ids, prompts)])
            started = time.perf_counter()
            servicer.handle("prefill", command)
            seconds[kind].append(time.perf_counter() - started)
            servicer.runner.release(ids)
    return seconds


def verify_seconds(servicer, prompts, rounds: int) -> dict[str, list[float]]:
    """Plain steps of every prompt's row, alternating with and without features."""
    ids = list(range(len(prompts)))
    servicer.handle("prefill", cache_pb2.PrefillCommand(entries=[
        cache_pb2.PrefillEntry(seq_id=i, token_ids=p[:-1]) for i, p in zip(ids, prompts)]))
    rows = {i: (len(p) - 1, p[-1]) for i, p in zip(ids, prompts)}
    seconds = {kind: [] for kind in KINDS}
    for turn in range(rounds):
        for kind in KINDS if turn % 2 == 0 else KINDS[::-1]:
            command = target_pb2.VerifyCommand(realign=True, return_features=kind == KINDS[0],
                                               entries=[target_pb2.VerifyEntry(
                                                   seq_id=i, expected_cache_len=cached,
                                                   append_token_ids=[last])
                                                   for i, (cached, last) in rows.items()])
            started = time.perf_counter()
            _, result = servicer.handle("verify", command)
            seconds[kind].append(time.perf_counter() - started)
            rows.update({e.seq_id: (e.cache_len, e.output_token_ids[-1])
                         for e in result.entries})
    servicer.runner.release(ids)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="docs/bench/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=cliargs.positive_int, default=16)
    parser.add_argument("--rounds", type=cliargs.positive_int, default=6)
    args = parser.parse_args()
    runner = build_runner(ServiceConfig(model=models.model_path("smollm2")))
    warm_up(runner)
    servicer = TargetServicer(runner)
    tokenizer = models.load_tokenizer("smollm2")
    prompts = [models.chat_ids(tokenizer, p["prompt"])
               for p in bench_prompts(args.num_prompts, args.prompts)]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions, {args.rounds} rounds")
    for what, seconds in (("prefill", prefill_seconds(servicer, prompts, args.rounds)),
                          ("verify", verify_seconds(servicer, prompts, args.rounds))):
        for kind, values in seconds.items():
            print(f"{what} {kind}: median {1000 * statistics.median(values):.1f} ms "
                  f"({min(values) * 1000:.0f}-{max(values) * 1000:.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
