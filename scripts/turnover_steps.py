"""What a batch pays as clients come and go: plain decoding steps of B rows run the way the
target service runs them (its runner, kernels and verify), where each sequence finishes after
its own number of new tokens and a newcomer takes its place a step or more later (prefilled
alone, as admission does), the batch seated in place (newcomers copied into the rows that
left, the rows vacant meanwhile) against the batch copied whole at each change of membership.
The two ways run the same sequences in turn, round after round; prints the median ms per step
(prefills left out) and the ms a step spent building its batch.

    python3 scripts/turnover_steps.py --rows 32 --steps 60 --rounds 3
    python3 scripts/turnover_steps.py --rows 8 --vacant-share 0.25   # another vacancy budget
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchspec import cliargs  # noqa: E402
from batchspec.params import SamplingParams  # noqa: E402
from batchspec.runtime import fastlinear, models, service  # noqa: E402
from batchspec.runtime import runner as runner_lib  # noqa: E402
from target_service import verifier  # noqa: E402


def run(runner, args, seed: int) -> tuple[list[float], list[float]]:
    """One pass: per step, (seconds of the verify, seconds it spent building its batch)."""
    rng = random.Random(seed)
    vocab, greedy = runner.vocab_size, SamplingParams()
    next_id = seed * 1_000_000

    def newcomer():
        nonlocal next_id
        next_id += 1
        return next_id, [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt))]

    rows = dict(newcomer() for _ in range(args.rows))
    runner.prefill(list(rows.items()))
    left = {i: rng.randint(1, args.new_tokens) for i in rows}
    arriving: list[int] = []  # steps until each awaited newcomer arrives
    times, builds = [], []
    for _ in range(args.steps):
        due = sum(1 for a in arriving if a == 0)
        arriving = [a - 1 for a in arriving if a > 0]
        if due:
            new = dict(newcomer() for _ in range(due))
            runner.prefill(list(new.items()))
            rows.update(new)
            left.update({i: args.new_tokens for i in new})
        specs = [verifier.VerifyRow(i, len(t), [rng.randrange(vocab)], [], greedy)
                 for i, t in rows.items()]
        started = time.perf_counter()
        _, group = verifier.verify(runner, specs, realign=True)
        times.append(time.perf_counter() - started)
        builds.append(group.stack_seconds)
        finished = []
        for spec in specs:
            rows[spec.seq_id] += spec.append_token_ids
            left[spec.seq_id] -= 1
            if left[spec.seq_id] == 0:
                finished.append(spec.seq_id)
        runner.release(finished)
        for i in finished:
            del rows[i], left[i]
        arriving += [args.lag] * len(finished)
    runner.release(list(rows))
    return times, builds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=cliargs.positive_int, default=32)
    parser.add_argument("--prompt", type=cliargs.int_span, default=(60, 200),
                        help="prompt lengths drawn from MIN,MAX")
    parser.add_argument("--new-tokens", type=cliargs.positive_int, default=64)
    parser.add_argument("--lag", type=cliargs.non_negative_int, default=1,
                        help="steps between a sequence's end and its successor's arrival")
    parser.add_argument("--steps", type=cliargs.positive_int, default=60)
    parser.add_argument("--rounds", type=cliargs.positive_int, default=3)
    parser.add_argument("--vacant-share", type=cliargs.share, default=None,
                        help="the share of a batch's rows it may keep vacant (default: the "
                             "runner's budget)")
    args = parser.parse_args()
    if args.vacant_share is not None:
        runner_lib.vacancy_budget = lambda rows: int(rows * args.vacant_share)
    runner = service.build_runner(service.ServiceConfig(model=args.model))
    fastlinear.tune(runner.model, models.kernel_plans_file())
    results = {True: [], False: []}
    for round_index in range(args.rounds):
        for seated in ((True, False) if round_index % 2 == 0 else (False, True)):
            runner.seats_in_place = seated
            times, builds = run(runner, args, seed=round_index + 1)
            results[seated].append((statistics.median(times) * 1000,
                                    statistics.mean(builds) * 1000, sum(times)))
    for seated, rounds in results.items():
        label = "seated in place" if seated else "copied whole"
        print(f"{label:16s} step ms (median, per round): "
              + " ".join(f"{m:.1f}" for m, _, _ in rounds)
              + " | batch building ms a step (mean): "
              + " ".join(f"{b:.1f}" for _, b, _ in rounds)
              + " | seconds a pass: " + " ".join(f"{s:.2f}" for _, _, s in rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
