"""Where the engine's model time goes, per method: every group forward of the benchmark's
in-process methods counted by service and group size (count, total and mean time, mean cache
width), plus what building the model's cache from a batch costs with and without a copy.

    python3 scripts/group_steps.py --num-prompts 16 --max-new-tokens 48 --batch-sizes 8 \
        --ks 1 --methods engine_realign,engine_grouped

Takes the `batchspec bench` flags; the report it would write goes to --out as usual.
"""
import collections
import pathlib
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from batchspec.runtime import kvcache
from batchspec.runtime import runner as runner_lib
from batchspec.server import parse_config
from batchspec_tools.bench import run as bench


def record_forwards(stats: dict, current: list) -> None:
    """Wrap GroupForward.step so that each forward adds to stats[(method, role, rows)]."""
    step = runner_lib.GroupForward.step
    run_one = bench.run_one

    def timed_step(group, input_ids, *, num_logits):
        started = time.perf_counter()
        logits = step(group, input_ids, num_logits=num_logits)
        role = "draft" if group.runner is current[1].get("draft") else "target"
        entry = stats[(current[0], role, input_ids.shape[0])]
        entry.append((time.perf_counter() - started, group.width))
        return logits

    def tagged_run_one(method, batch_size, k, hf, runners, *rest):
        current[:] = [method, runners]
        return run_one(method, batch_size, k, hf, runners, *rest)

    runner_lib.GroupForward.step = timed_step
    bench.run_one = tagged_run_one


def cache_build_ms(batch: int, width: int, layers: int = 30, heads: int = 3, dim: int = 64):
    """Median ms to wrap a [batch, heads, width, dim] cache per layer: (no copy, copy), the
    latter as DynamicCache(ddp_cache_data=...) does it."""
    tensors = [(torch.randn(batch, heads, width, dim), torch.randn(batch, heads, width, dim))
               for _ in range(layers)]
    times = {"wrap": [], "copy": []}
    for _ in range(12):
        for name, build in (("wrap", kvcache.to_model_cache),
                            ("copy", lambda t: DynamicCache(ddp_cache_data=t))):
            started = time.perf_counter()
            build(tensors)
            times[name].append((time.perf_counter() - started) * 1000)
    return statistics.median(times["wrap"][2:]), statistics.median(times["copy"][2:])


def main() -> None:
    config = parse_config(bench.build_parser(), sys.argv[1:], bench.config_from_args)
    stats, current = collections.defaultdict(list), ["warm-up", {}]
    record_forwards(stats, current)
    bench.write_report(bench.run(config), pathlib.Path(config.out))
    print("method          service  rows  forwards  total s  mean ms  mean width")
    for (method, role, rows), entries in sorted(stats.items()):
        if method.startswith("engine"):
            total = sum(t for t, _ in entries)
            width = sum(w for _, w in entries) / len(entries)
            print(f"{method:15s} {role:7s} {rows:5d} {len(entries):9d} {total:8.2f} "
                  f"{1000 * total / len(entries):8.1f} {width:11.0f}")
    for batch in sorted(config.batch_sizes):
        wrap, copy = cache_build_ms(batch, 160)
        print(f"model cache for batch {batch}, 160 columns, SmolLM2 shapes: {wrap:.1f} ms "
              f"without a copy, {copy:.1f} ms with DynamicCache(ddp_cache_data=...)")


if __name__ == "__main__":
    main()
