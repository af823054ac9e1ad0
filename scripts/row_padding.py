"""Decode and verify steps of the default target through the runner, with the weight-major
product's rows padded two ways, alternated step by step on the same sequences (so a machine
that speeds up or slows down moves both alike): zeros in one op (`fastlinear._product`, what
ships) against copies of the rows (`repeat`, the way before).

    python3 scripts/row_padding.py --steps 160

Prints each setting's median and lower quartile of step time. Two rows decode unpadded (the
plan multiplies them as they are), a control: both ways should measure alike there.
"""
import argparse
import statistics
import time

import torch

from batchspec import cliargs
from batchspec.params import SamplingParams
from batchspec.runtime import fastlinear, models
from batchspec.runtime.service import ServiceConfig, build_runner, warm_up
from target_service.verifier import VerifyRow, verify

SHIPPED = fastlinear._product


def by_copies(flat: torch.Tensor, weight: torch.Tensor, method: int) -> torch.Tensor:
    """The product as before: padding rows made by repeating the rows."""
    rows = flat.shape[0]
    if method <= rows:
        return SHIPPED(flat, weight, method)
    flat = flat.repeat(-(-method // rows), 1)[:method]
    return (weight @ flat.T).T[:rows].contiguous()


def alternate(runner, rows: int, k: int, steps: int) -> dict[str, list[float]]:
    prompt = list(range(300, 400))
    ids = list(range(1, rows + 1))
    runner.prefill([(i, prompt[:-1]) for i in ids])
    last = {i: prompt[-1] for i in ids}
    length = {i: len(prompt) - 1 for i in ids}
    seconds = {"zeros": [], "copies": []}
    try:
        for step in range(steps):
            name = ("zeros", "copies")[(step // 2) % 2 ^ step % 2]  # ABBA order
            fastlinear._product = SHIPPED if name == "zeros" else by_copies
            started = time.perf_counter()
            outcomes, _ = verify(runner, [VerifyRow(i, length[i], [last[i]], [7] * k,
                                                    SamplingParams()) for i in ids],
                                 realign=False)
            seconds[name].append(time.perf_counter() - started)
            for o in outcomes:
                last[o.seq_id], length[o.seq_id] = o.output_token_ids[-1], o.cache_len
    finally:
        fastlinear._product = SHIPPED
        runner.release(ids)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=cliargs.positive_int, default=160,
                        help="steps per setting, both ways together (at least 8)")
    args = parser.parse_args()
    if args.steps < 8:
        parser.error("--steps must be at least 8: each way needs four steps for its quartiles")
    runner = build_runner(ServiceConfig(model=models.model_path("smollm2")))
    warm_up(runner)
    for rows, k in ((1, 0), (1, 4), (2, 0)):
        seconds = alternate(runner, rows, k, args.steps)
        shown = ", ".join(f"{name} {1e3 * statistics.median(v):.2f} ms "
                          f"(p25 {1e3 * statistics.quantiles(v, n=4)[0]:.2f})"
                          for name, v in seconds.items())
        print(f"{rows} row(s), {k} drafts: {shown}", flush=True)


if __name__ == "__main__":
    main()
