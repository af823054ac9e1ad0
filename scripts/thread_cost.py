"""What it costs to run torch on a second thread: the median time of one decode step (batch 1,
200 cached positions) when the model is loaded and run on the compute thread only (what the
services do), against loaded and warmed up on the main thread and run on the compute thread
(what they did before batchspec.runtime.compute). Each case runs in a fresh process.

    python3 scripts/thread_cost.py --model smollm2
"""
import argparse
import subprocess
import sys

CASES = {"one thread": "same", "warmed up on main, run on a second thread": "split"}


def load(name: str):
    from batchspec.runtime import fastlinear, models

    model = models.load_causal_lm(name)
    fastlinear.tune(model, models.kernel_plans_file())
    return model


def child(case: str, name: str, repeats: int) -> None:
    from batchspec.runtime import compute
    from batchspec_tools.drafting.evaluate import decode_step_seconds

    if case == "same":
        model = compute.run(load, name)
    else:  # loaded and warmed up on the main thread, as the services did: two OpenMP teams
        model = load(name)
        decode_step_seconds(model, repeats=2)
    print(f"{compute.run(decode_step_seconds, model, repeats=repeats) * 1000:.1f}")


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
        print(f"{label:>42}: {out}")


if __name__ == "__main__":
    main()
