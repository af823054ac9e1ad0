"""What a verify costs as rows start drafting: one target verify of B rows of different cached
lengths (a realigned batch, as serving has), with 0, 1, a few or all rows drafting K tokens
and the others decoding one, run the way the target service runs it (its runner, packed
positions, its kernels). Prints the median milliseconds of each.

    python3 scripts/verify_width.py --rows 16 --k 4 --drafting 0,1,4,8,16

The first drafting row costs the most: every row attends with K + 1 queries from then on.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchspec.params import SamplingParams  # noqa: E402
from batchspec.runtime import fastlinear, models, service  # noqa: E402
from target_service import verifier  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--drafting", default="0,1,4,8,16")
    parser.add_argument("--context", default="100,250", help="cached lengths drawn from MIN,MAX")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runner = service.build_runner(service.ServiceConfig(model=args.model))
    fastlinear.tune(runner.model, models.kernel_plans_file())
    low, high = map(int, args.context.split(","))
    random.seed(0)
    lengths = [random.randint(low, high) for _ in range(args.rows)]
    runner.prefill([(i, list(range(1, n + 1))) for i, n in enumerate(lengths)])
    greedy = SamplingParams()

    def verify(drafting: int) -> float:
        rows = [verifier.VerifyRow(i, n, [5], [7] * args.k if i < drafting else [], None,
                                   greedy) for i, n in enumerate(lengths)]
        started = time.perf_counter()
        outcomes, _ = verifier.verify(runner, rows, realign=True)
        seconds = time.perf_counter() - started
        runner.trim([(o.seq_id, o.cache_len, n) for o, n in zip(outcomes, lengths)])
        return seconds * 1000

    print(f"{args.model}: a verify of {args.rows} rows ({low} to {high} cached positions), "
          f"K = {args.k}; median of {args.repeats}")
    for drafting in map(int, args.drafting.split(",")):
        verify(drafting)  # warm
        ms = statistics.median(verify(drafting) for _ in range(args.repeats))
        print(f"  {drafting:3d} rows drafting: {ms:7.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
