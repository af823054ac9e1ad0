"""What it costs to run torch on a second thread: the median time of one decode step (batch 1,
200 cached positions) when the model is loaded and run on the compute thread only (what the
services do), against loaded on the main thread and run on the compute thread (what they did
before batchspec.compute). Each case runs in a fresh process.

    python3 scripts/thread_cost.py --model smollm2
"""
import argparse
import statistics
import subprocess
import sys
import time

CASES = {"one thread": "same", "loaded on main, run on a second thread": "split"}


def decode_step_ms(model, repeats: int) -> float:
    import torch

    times = []
    with torch.inference_mode():
        cache = model(torch.randint(0, 1000, (1, 200)), use_cache=True).past_key_values
        for _ in range(repeats + 5):
            started = time.perf_counter()
            model(input_ids=torch.randint(0, 1000, (1, 1)), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - started)
            cache.crop(-1)
    return statistics.median(times[5:]) * 1000


def load(name: str):
    from batchspec import fastlinear, models

    model = models.load_causal_lm(name)
    fastlinear.tune(model)
    return model


def child(case: str, name: str, repeats: int) -> None:
    from batchspec import compute

    model = compute.run(load, name) if case == "same" else load(name)
    print(f"{compute.run(decode_step_ms, model, repeats):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--case", choices=sorted(CASES.values()), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        return child(args.case, args.model, args.repeats)
    print(f"{args.model}: median ms per decode step (batch 1, 200 cached positions)")
    for label, case in CASES.items():
        out = subprocess.run([sys.executable, __file__, "--case", case, "--model", args.model,
                              "--repeats", str(args.repeats)], capture_output=True, text=True,
                             check=True).stdout.split()[-1]
        print(f"{label:>40}: {out}")


if __name__ == "__main__":
    main()
