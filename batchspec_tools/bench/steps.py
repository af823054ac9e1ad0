"""Where a served run's time went, from the step logs `batchspec bench --step-logs DIR` writes
(one JSON line per step, a file per method, client count and round: METHOD-cC-rR.jsonl).

For each method and client count, medians over rounds: tokens per second of step time for
drafted and for plain steps (prefills left out), the share of steps drafted, what drafting
cost net (the seconds drafted steps took beyond what the same run's plain steps of about as
many rows take for the tokens they committed; negative: drafting saved time), and the target's
prefill seconds against the run's span. Rounds of a shared machine move by a tenth and more;
the net cost compares steps of one run, so it shows what drafting did where the tok/s of two
runs cannot. With --rows N, the steps of N rows that prefilled nothing, plain ones and drafted
ones by draft kind: how many, the tokens a step committed, and the median milliseconds of the
step and of each of its stages (STAGES):

- coordinator: the step less its round trips (scheduling, bookkeeping, streaming);
- draft / verify RPC: a command's round trip less the service's own account of it;
- draft / verify service: the service's time beside its forwards (decoding the command,
  checks, cache bookkeeping, sampling, encoding the answer);
- draft / verify forwards: the forwards themselves.

    batchspec steps STEPS --rows 16

A log that holds an earlier run too (a reused directory) is cut at its last pause of more
than 300 s: only the latest run counts.
"""
import argparse
import collections
import json
import pathlib
import re
import statistics

from batchspec import cliargs
from coordinator.evidence import bucket_of

NAME = re.compile(r"^(?P<method>.+)-c(?P<clients>\d+)-r(?P<round>\d+)\.jsonl$")
# (column, how it is found from a step-log line), in a step's order
STAGES = (
    ("coordinator", lambda s: s["step_s"] - s["draft_s"] - s["verify_s"]),
    ("draft RPC", lambda s: s["draft_s"] - s["draft_compute_s"]),
    ("draft service", lambda s: s["draft_compute_s"] - s["draft_forward_s"]),
    ("draft forwards", lambda s: s["draft_forward_s"]),
    ("verify RPC", lambda s: s["verify_s"] - s["verify_compute_s"]),
    ("verify service", lambda s: s["verify_compute_s"] - s["verify_forward_s"]),
    ("verify forward", lambda s: s["verify_forward_s"]),
)


# What every step of a log holds that the table reads (the coordinator's --step-log lines).
FIELDS = ("t", "step_s", "committed", "rows", "drafts", "prefill_target_s")


def latest_run(path: pathlib.Path) -> list[dict]:
    """The steps of the log's latest run; ValueError where a line is no step of a step log."""
    steps = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}, line {number}: not JSON") from None
        missing = [f for f in FIELDS if f not in step] if isinstance(step, dict) else FIELDS
        if missing:
            raise ValueError(f"{path}, line {number}: not a step (no {', '.join(missing)})")
        steps.append(step)
    for i in range(len(steps) - 1, 0, -1):
        if steps[i]["t"] - steps[i - 1]["t"] > 300:
            return steps[i:]
    return steps


def rate(steps: list[dict]) -> float | None:
    seconds = sum(s["step_s"] for s in steps)
    return sum(s["committed"] for s in steps) / seconds if seconds else None


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def drafting_net_s(steps: list[dict]) -> float | None:
    """Seconds the drafted steps of a run took beyond what its plain steps of about as many
    rows (the batch-size bucket the step-aside evidence uses, or the nearest one measured)
    take per committed token; None without drafted steps, or without plain steps to compare
    them with."""
    per_token: dict[int, list[float]] = collections.defaultdict(list)
    drafted = []
    for s in steps:
        if any(s["drafts"]):
            drafted.append(s)
        else:
            per_token[bucket_of(s["rows"])].append(s["step_s"] / s["committed"])
    if not (drafted and per_token):
        return None
    typical = {bucket: statistics.median(values) for bucket, values in per_token.items()}
    net = 0.0
    for s in drafted:
        bucket = bucket_of(s["rows"])
        nearest = min(typical, key=lambda b: (abs(b - bucket), b))
        net += s["step_s"] - s["committed"] * typical[nearest]
    return net


def run_summary(steps: list[dict]) -> dict:
    drafted = [s for s in steps if any(s["drafts"])]
    plain = [s for s in steps if not any(s["drafts"])]
    return {"drafted": rate(drafted), "plain": rate(plain),
            "share": len(drafted) / len(steps) if steps else None,
            "net": drafting_net_s(steps),
            "prefill": sum(s["prefill_target_s"] for s in steps),
            "span": steps[-1]["t"] - steps[0]["t"] if steps else None}


def step_kind(step: dict) -> str:
    """"plain", or the draft kind of the step's drafted rows ("kind i": the i-th --draft),
    or "mixed"."""
    if not any(step["drafts"]):
        return "plain"
    kinds = {k for k, d in zip(step.get("kinds") or [], step["drafts"]) if d}
    return f"kind {kinds.pop()}" if len(kinds) == 1 else "mixed"


def breakdown(steps: list[dict], rows: int) -> dict[str, dict]:
    """Per step kind (step_kind), over the steps of `rows` rows that prefilled nothing: how
    many, the mean tokens a step committed, the ms a token (their steps' time over their
    tokens), the median ms of the step and of each stage."""
    chosen = collections.defaultdict(list)
    for s in steps:
        if s["rows"] == rows and not s["prefill_target_s"] and not s.get("prefill_draft_s"):
            chosen[step_kind(s)].append(s)
    return {kind: {"count": len(group),
                   "committed": statistics.mean(s["committed"] for s in group),
                   "per_token": 1000 * sum(s["step_s"] for s in group)
                   / sum(s["committed"] for s in group),
                   "step": statistics.median(1000 * s["step_s"] for s in group),
                   "stages": {name: statistics.median(1000 * stage(s) for s in group)
                              for name, stage in STAGES}}
            for kind, group in sorted(chosen.items())}


def print_breakdown(runs: dict, rows: int) -> None:
    names = [name for name, _ in STAGES]
    print(f"\nsteps of {rows} rows (no prefill), median ms:\n")
    print("| method | clients | step | steps | tokens a step | step ms | ms a token | "
          + " | ".join(names) + " |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names)
          + " |")
    for (method, clients), rounds in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for kind, b in breakdown([s for steps in rounds for s in steps], rows).items():
            print(f"| {method} | {clients} | {kind} | {b['count']} | {b['committed']:.2f} | "
                  f"{b['step']:.2f} | {b['per_token']:.2f} | "
                  + " | ".join(f"{b['stages'][n]:.2f}" for n in names) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="batchspec steps",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("logs", type=pathlib.Path, help="the --step-logs directory")
    parser.add_argument("--rows", type=cliargs.positive_int,
                        help="also break down the steps of this many rows, plain and drafted "
                             "by draft kind, stage by stage")
    args = parser.parse_args(argv)
    if not args.logs.is_dir():
        parser.error(f"{args.logs} is not a directory")
    runs = collections.defaultdict(list)
    for path in sorted(args.logs.iterdir()):
        match = NAME.match(path.name)
        if match:
            try:
                runs[(match["method"], int(match["clients"]))].append(latest_run(path))
            except (OSError, ValueError) as error:
                parser.error(str(error))
    if not runs:
        parser.error(f"no step logs (METHOD-cC-rR.jsonl) in {args.logs}")
    print("| method | clients | drafted steps tok/s | plain steps tok/s | share drafted | "
          "drafting's net s | target prefill s / span s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for (method, clients), rounds in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        got = [run_summary(steps) for steps in rounds if steps]
        if not got:  # logs of a run still starting: no step yet
            continue
        m = {key: median(g[key] for g in got) for key in got[0]}
        print(f"| {method} | {clients} | {fmt(m['drafted'], '.0f')} | {fmt(m['plain'], '.0f')} | "
              f"{fmt(m['share'], '.2f')} | {fmt(m['net'], '+.2f')} | "
              f"{fmt(m['prefill'], '.1f')} / {fmt(m['span'], '.0f')} |")
    if args.rows:
        print_breakdown(runs, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
