"""Where batchspec over gRPC loses time against the engine in-process, at batch 1 with K = 1:

1. one verify of two tokens on a 200-token prompt, repeated: median time the target service
   computes (its own account) and the round trip, against the same verify in-process;
2. the benchmark's prompts through the three processes sent all at once, and one at a time
   (is it the streaming to many clients?).

    python3 scripts/grpc_overhead.py --num-prompts 16
"""
import argparse
import dataclasses
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from batchspec import bench, cli, fastlinear, models
from batchspec import runner as runner_lib
from batchspec.params import SamplingParams
from coordinator.clients import TargetClient, VerifySpec
from target_service import verifier

GREEDY = SamplingParams()
PROMPT = list(range(100, 300))


def median_ms(verify_once, repeats: int) -> tuple[float, float]:
    """(median wall ms, median computed ms) of verify_once(cache_len) -> (computed s, new len)."""
    walls, computed, length = [], [], len(PROMPT) - 1
    for _ in range(repeats + 5):
        started = time.perf_counter()
        seconds, length = verify_once(length)
        walls.append(time.perf_counter() - started)
        computed.append(seconds)
    return statistics.median(walls[5:]) * 1000, statistics.median(computed[5:]) * 1000


def in_service(repeats: int) -> tuple[float, float]:
    port = cli.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cli.wait_healthy(f"127.0.0.1:{port}", "batchspec.v1.TargetService", 600, [proc])
        client = TargetClient(f"127.0.0.1:{port}")
        client.prefill([(1, PROMPT[:-1])])

        def once(length):
            [outcome], timing = client.verify(False, [VerifySpec(1, length, [5], [6], [],
                                                                 GREEDY)])
            return timing.compute_seconds, outcome.cache_len

        result = median_ms(once, repeats)
        client.close()
        return result
    finally:
        proc.terminate()
        proc.wait()


def in_process(repeats: int) -> tuple[float, float]:
    model = models.load_causal_lm(models.SMOLLM2)
    fastlinear.tune(model, models.kernel_plans_file())  # the plans the service uses
    runner = runner_lib.ModelRunner(model, name="target", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=8192)
    runner.prefill([(1, PROMPT[:-1])])

    def once(length):
        started = time.perf_counter()
        [outcome], _ = verifier.verify(runner, [verifier.VerifyRow(1, length, [5], [6], None,
                                                                   GREEDY)], realign=False)
        return time.perf_counter() - started, outcome.cache_len

    return median_ms(once, repeats)


def concurrency(num_prompts: int) -> None:
    config = bench.config_from_args(bench.build_parser().parse_args(
        ["--num-prompts", str(num_prompts), "--max-new-tokens", "48"]))
    workload = bench.build_workload(config, pathlib.Path(tempfile.mkdtemp()))
    stack = bench.GrpcStack(workload)
    try:
        together = stack.run(workload, 1, 1)
        tokens = sum(len(o) for o in together.outputs)
        print(f"{num_prompts} prompts sent together: {tokens / together.seconds:.1f} tok/s")
        seconds = tokens = 0
        for prompt in workload.prompts:
            alone = stack.run(dataclasses.replace(workload, prompts=[prompt]), 1, 1)
            seconds += alone.seconds
            tokens += sum(len(o) for o in alone.outputs)
        print(f"{num_prompts} prompts sent one at a time: {tokens / seconds:.1f} tok/s")
    finally:
        stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    wall, computed = in_service(args.repeats)
    print(f"verify in the target service: {computed:.1f} ms computed, {wall:.1f} ms round trip")
    wall, _ = in_process(args.repeats)
    print(f"verify in-process: {wall:.1f} ms")
    concurrency(args.num_prompts)


if __name__ == "__main__":
    main()
