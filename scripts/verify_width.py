"""What a verify costs as rows start drafting: target verifies of B rows of different cached
lengths, with 0, 1, a few or all rows drafting K tokens (picked at random each step) and the
others decoding one, run the way the target service runs them (its runner, packed positions,
its kernels). The rows keep what they accept, as in serving: random drafts are rejected, so
their positions become holes the next verifies mask, until the batch is compacted. Prints the
median milliseconds of a verify for each count, medians over rounds taken in turn.

    python3 scripts/verify_width.py --rows 16 --k 4 --drafting 0,1,4,8,16
    python3 scripts/verify_width.py --attention-runs off   # attention in one call per layer
    python3 scripts/verify_width.py --rows 8 --k 1 --drafting 1,4,7 --min-padding 1,1000000
        # packed always against never, step by step in turn (default: packing.MIN_PADDING)

The first drafting row costs the most: the verify feeds K + 1 positions per row from then on
(where at least batchspec.packing.MIN_PADDING positions are padding, linear layers skip it and
attention runs rows by their own query counts, but the norms, rotary embeddings and output
logits still see the padded width).
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchspec import cliargs, packing  # noqa: E402
from batchspec.params import SamplingParams  # noqa: E402
from batchspec.runtime import attention, fastlinear, models, service  # noqa: E402
from target_service import verifier  # noqa: E402


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"negative value in {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=cliargs.positive_int, default=16)
    parser.add_argument("--k", type=cliargs.positive_int, default=4)
    parser.add_argument("--drafting", type=int_list, default=[0, 1, 4, 8, 16])
    parser.add_argument("--context", type=cliargs.int_span, default=(100, 250),
                        help="cached lengths drawn from MIN,MAX")
    parser.add_argument("--steps", type=cliargs.positive_int, default=20,
                        help="verifies per count and round")
    parser.add_argument("--rounds", type=cliargs.positive_int, default=3)
    parser.add_argument("--attention-runs", choices=("on", "off"), default="on",
                        help="off: attention over the whole batch in one call per layer")
    parser.add_argument("--min-padding", type=int_list, default=[packing.MIN_PADDING],
                        help="padded positions from which a verify is packed; several: each "
                             "count is run under each, step by step in turn")
    args = parser.parse_args()
    if max(args.drafting) > args.rows:
        parser.error(f"--drafting counts are at most --rows ({args.rows})")
    if args.attention_runs == "off":
        attention.MAX_SPLIT_ROWS = 0
    runner = service.build_runner(service.ServiceConfig(model=args.model))
    fastlinear.tune(runner.model, models.kernel_plans_file())
    rng = random.Random(0)
    greedy = SamplingParams()
    vocab = runner.vocab_size

    def median_verify(drafting: int, seed: int) -> dict[int, float]:
        """For each --min-padding value, the median ms of `args.steps` verifies of fresh
        sequences of its own (the first 3 warm up), the values taken in turn step by step."""
        batches = {}
        for n, min_padding in enumerate(args.min_padding):
            ids = [(seed * len(args.min_padding) + n) * args.rows + i + 1
                   for i in range(args.rows)]
            lengths = [rng.randint(*args.context) for _ in ids]
            runner.prefill([(i, [rng.randrange(vocab) for _ in range(m)])
                            for i, m in zip(ids, lengths)])
            batches[min_padding] = (ids, lengths)
        times = {m: [] for m in args.min_padding}
        for _ in range(args.steps + 3):
            wide = set(rng.sample(range(args.rows), drafting))
            drafts = [[rng.randrange(vocab) for _ in range(args.k)] if j in wide else []
                      for j in range(args.rows)]
            for min_padding, (ids, lengths) in batches.items():
                packing.MIN_PADDING = min_padding
                rows = [verifier.VerifyRow(i, n, [rng.randrange(vocab)], d, greedy)
                        for i, n, d in zip(ids, lengths, drafts)]
                started = time.perf_counter()
                outcomes, _ = verifier.verify(runner, rows, realign=True)
                times[min_padding].append((time.perf_counter() - started) * 1000)
                batches[min_padding] = (ids, [o.cache_len for o in outcomes])
        for ids, _ in batches.values():
            runner.release(ids)
        return {m: statistics.median(t[3:]) for m, t in times.items()}

    print(f"{args.model}: verifies of {args.rows} rows ({args.context[0]} to {args.context[1]} "
          f"cached positions at the start, {args.steps} steps), K = {args.k}, attention runs "
          f"{args.attention_runs}; median of {args.rounds} rounds")
    results = {(d, m): [] for d in args.drafting for m in args.min_padding}
    seed = 0
    for _ in range(args.rounds):
        for drafting in args.drafting:
            seed += 1
            for min_padding, ms in median_verify(drafting, seed).items():
                results[drafting, min_padding].append(ms)
    for (drafting, min_padding), values in results.items():
        print(f"  {drafting:3d} rows drafting, packed from {min_padding} padded positions: "
              f"{statistics.median(values):7.1f} ms ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
