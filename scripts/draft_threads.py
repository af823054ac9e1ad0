"""What a draft service's proposal costs with every core against one thread, the way serving
calls it: a running `batchspec draft` asked for one proposal of K tokens for B rows, with a
pause between calls as a step's verify leaves (--gap-ms), once on otherwise idle cores and once
beside a process keeping one core busy (as the target, the coordinator and the clients do on a
small CPU). Prints the service's own compute time per proposal, the median of --calls.

    python3 scripts/draft_threads.py --model smollm2-eagle --rows 8 --ks 1,4
    python3 scripts/draft_threads.py --model smollm2-draft --rows 8 --ks 4
"""
import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchspec.params import SamplingParams  # noqa: E402
from batchspec_tools.processes import free_port  # noqa: E402
from coordinator.clients import DraftClient, ProposeSpec  # noqa: E402


@contextlib.contextmanager
def draft_service(model: str, threads: int):
    port = free_port()
    command = [sys.executable, "-m", "draft_service", "--model", model, "--port", str(port),
               "--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        for line in process.stdout:
            if "listening" in line:
                break
        client = DraftClient(f"127.0.0.1:{port}")
        client.wait_ready(120)
        yield client
        client.close()
    finally:
        process.terminate()
        process.wait(30)


@contextlib.contextmanager
def busy_core(on: bool):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()


def features(count: int, width: int):
    import numpy as np

    from batchspec.v1 import cache_pb2

    values = np.random.default_rng(count).standard_normal((count, width)).astype(np.float16)
    return cache_pb2.Features(num_positions=count, width=width, values_f16=values.tobytes())


def proposal_ms(client, lengths: list[int], k: int, width: int, calls: int,
                gap_s: float) -> float:
    """Median compute milliseconds of `calls` proposals, each rolled back after."""
    greedy, times = SamplingParams(), []
    for _ in range(calls):
        time.sleep(gap_s)
        specs = [ProposeSpec(i, n, n, [5], greedy, features(1, width) if width else None)
                 for i, n in enumerate(lengths)]
        proposals, timing = client.propose(k, True, specs)
        client.trim([(p.seq_id, p.cache_len, n) for p, n in zip(proposals, lengths)])
        times.append(timing.compute_seconds * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-eagle")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--gap-ms", type=float, default=60.0)
    args = parser.parse_args()
    random.seed(0)
    lengths = [random.randint(100, 200) for _ in range(args.rows)]
    print(f"{args.model}, {args.rows} rows, {os.cpu_count()} cores, {args.gap_ms:.0f} ms "
          "between calls: compute ms per proposal (median)")
    for threads in (os.cpu_count(), 1):
        with draft_service(args.model, threads) as client:
            width = client.describe().feature_width
            client.prefill([(i, list(range(1, n + 1))) for i, n in enumerate(lengths)],
                           features={i: features(n, width) for i, n in enumerate(lengths)}
                           if width else None)
            label = "one thread" if threads == 1 else f"{threads} threads"
            for k in map(int, args.ks.split(",")):
                for busy in (False, True):
                    with busy_core(busy):
                        ms = proposal_ms(client, lengths, k, width, args.calls,
                                         args.gap_ms / 1000)
                    print(f"  {label:10s} K={k}  {'one core busy' if busy else 'idle cores':14s}"
                          f"{ms:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
