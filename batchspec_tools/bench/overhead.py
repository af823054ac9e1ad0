"""`batchspec bench --overhead`: what a step costs beside the model's own work.

The served stack (target and model draft services, a coordinator per setting)
over a model that costs almost nothing: a 2-layer, 64-wide random Llama, the target and its
own draft, so every draft is accepted. Plain (no draft, a token a command), drafted (K drafts
for every row, `--draft-policy fixed --step-aside off --min-draft-confidence 0`, one propose
and verify a command), drafted rounds (the same, `--draft-rounds 4`: four of them a command)
and plain steps (no draft, `--plain-steps 4`: four tokens a row a command) steps at each
client count,
closed-loop clients asking for `max_new_tokens` each past any end-of-sequence, `--repeat`
rounds in turns. From the coordinator's step log, the median of each stage of a step
(prefills left out; the stages are `batchspec steps`', bench/steps.py STAGES).

Whatever a step costs here is what speculation must pay for on any model: with a real model,
add its forwards.
"""
import json
import pathlib
import random
import statistics
import tempfile

from batchspec_tools.bench.steps import STAGES

CLIENTS = (1, 16)
NUM_DRAFT_TOKENS = 4
PLAIN_STEPS = 4
DRAFT_ROUNDS = 4


def free_model(root: pathlib.Path) -> str:
    """The free model's directory: the tests' tiny Llama."""
    from batchspec.runtime import models, tiny

    path = root / "free-llama"
    models.save_model(tiny.llama(seed=0), path)
    return str(path)


def run(start, max_new_tokens: int = 96, clients=CLIENTS, requests_per_client: int = 2,
        rounds: int = 1) -> dict:
    """Serve the free model plain and drafted at each client count, `rounds` times in turns
    (plain first in even rounds, drafted first in odd ones); the report's rows, one per
    round, kind and client count. start(model_dir, prompts) -> (stack, workload): the
    benchmark's services over the model (bench.run.GrpcStack) and their workload."""
    import grpc

    from batchspec.runtime import tiny
    from batchspec.v1 import generate_pb2_grpc
    from batchspec_tools.bench import arrivals

    rng = random.Random(0)
    rows = []
    # (kind, drafts, plain steps, draft rounds): plain, one token a command; plain steps,
    # PLAIN_STEPS tokens a row a command; drafted rounds, DRAFT_ROUNDS proposes and verifies
    kinds = (("plain", (), 1, 1), ("drafted", ("model",), 1, 1),
             ("drafted rounds", ("model",), 1, DRAFT_ROUNDS), ("plain steps", (), PLAIN_STEPS, 1))
    with tempfile.TemporaryDirectory() as scratch:
        root = pathlib.Path(scratch)
        model = free_model(root)
        prompts = [[rng.randrange(4, tiny.VOCAB) for _ in range(12)]
                   for _ in range(max(clients) * requests_per_client)]
        stack, workload = start(model, prompts)
        try:
            for round_ in range(rounds):
                for kind, drafts, steps, draft_rounds in kinds if round_ % 2 == 0 \
                        else kinds[::-1]:
                    for count in clients:
                        log = root / f"{kind}-c{count}-r{round_}.jsonl".replace(" ", "-")
                        extra = ("--step-aside", "off", "--plain-steps", str(steps),
                                 "--draft-rounds", str(draft_rounds),
                                 "--step-log", str(log))
                        with stack.coordinator(workload, max(clients), NUM_DRAFT_TOKENS,
                                               drafts, extra) as (port, _), \
                                grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                            stub = generate_pb2_grpc.CoordinatorStub(channel)
                            ask = prompts[:count * requests_per_client]
                            fields = lambda i: {"ignore_eos": True}  # noqa: E731
                            arrivals.run_closed_loop(stub, ask[:count], 8, count, fields)
                            log.write_text("")  # the warm-up's steps are not timed
                            arrivals.run_closed_loop(stub, ask, max_new_tokens, count, fields)
                        rows.append(dict(summarise(kind, count, read_steps(log)),
                                         round=round_))
        finally:
            stack.close()
    return {"max_new_tokens": max_new_tokens, "num_draft_tokens": NUM_DRAFT_TOKENS,
            "rounds": rounds, "rows": rows}


def read_steps(path: pathlib.Path) -> list[dict]:
    """The logged steps that prefilled nothing."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [s for s in steps if not s["prefill_target_s"] and not s["prefill_draft_s"]]


def summarise(kind: str, clients: int, steps: list[dict]) -> dict:
    """Median milliseconds of a step and of each stage over the steps of a run's full cohort
    (the most rows a step of it had), and the tokens such a step committed (the median and
    the most)."""
    if not steps:
        raise RuntimeError(f"{kind} at {clients} clients logged no step without a prefill")
    rows = max(s["rows"] for s in steps)
    full = [s for s in steps if s["rows"] == rows]
    median_ms = lambda f: round(1000 * statistics.median(f(s) for s in full), 3)  # noqa: E731
    return {"kind": kind, "clients": clients, "rows": rows, "steps": len(full),
            "committed": statistics.median(s["committed"] for s in full),
            "most_committed": max(s["committed"] for s in full),
            "step_ms": median_ms(lambda s: s["step_s"]),
            "stages_ms": {name: median_ms(f) for name, f in STAGES}}


def markdown(report: dict) -> str:
    """The report's table: per kind and client count, the median over rounds of the step and
    of each stage, each round's step, and the step over the same round's plain one."""
    names = [name for name, _ in STAGES]
    rounds = report.get("rounds", 1)
    lines = [f"# batchspec bench --overhead ({report['date']})", "",
             f"A free model (2-layer, 64-wide random Llama, its own draft: every draft "
             f"accepted), K = {report['num_draft_tokens']}, {report['max_new_tokens']} new "
             f"tokens a request; median ms over the steps of a full cohort, then over "
             f"{rounds} round(s) in turns. Machine: {report['machine']['cpu']}, "
             f"{report['machine']['cpu_count']} cores, torch {report['machine']['torch']}.",
             "",
             "| step | clients | tokens a step | step ms | rounds | over plain (rounds) | "
             + " | ".join(names) + " |",
             "| --- | ---: | ---: | ---: | --- | --- | " + " | ".join("---:" for _ in names)
             + " |"]
    runs = {}  # (kind, clients) -> its rows, by round
    for row in report["rows"]:
        runs.setdefault((row["kind"], row["clients"]), []).append(row)
    plain = {(r["clients"], r.get("round", 0)): r["step_ms"] for r in report["rows"]
             if r["kind"] == "plain"}
    for (kind, clients), rows in runs.items():
        median = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
        ratios = [r["step_ms"] / plain[(clients, r.get("round", 0))] for r in rows
                  if plain.get((clients, r.get("round", 0)))]
        over = f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})" \
            if ratios else "-"
        lines.append(f"| {kind} | {clients} | {median(lambda r: r['committed']):g} | "
                     f"{median(lambda r: r['step_ms']):.2f} | "
                     f"{', '.join(format(r['step_ms'], '.2f') for r in rows)} | {over} | "
                     + " | ".join(f"{median(lambda r: r['stages_ms'][n]):.2f}" for n in names)
                     + " |")
    return "\n".join(lines) + "\n"
