"""Serving as servers are judged: closed-loop clients against the gRPC methods (and llama.cpp's
server on the same GGUF file, batchspec_tools.bench.llamacpp).

At each concurrency C, C clients share the prompt set, each sending its next request as soon as
its last answer ended. Every method gets a fresh coordinator over the same running services
(warmed with an untimed short request per client, so its first plans are not what is timed);
before the first round every method serves one untimed run at the largest concurrency (a request
per client, answered in full), so no timed run pays for what fresh services do once (a first
timed run at 32 clients spent 10.9 s of its target's time realigning where later ones spent 4.1
to 4.6: its first copies of a full batch took over a second each). The methods are taken in
turn, and the whole sweep `repeat` times, the methods' order reversed every other round, so a
machine whose speed drifts moves every method alike. Each row is a method at a concurrency: the
median run's throughput with every run's figure, medians of TTFT and ITL p50/p99, exactness
against the target alone, and its speed over `grpc_target_only` (the same server without
drafts): the ratio of the medians, and the spread of the per-round ratios. Sampled runs
(--temperature) seed request i with i, so every method is asked the same requests, and their
exactness is against the plain server's answers (a seeded request's tokens are the target's
whatever was drafted). Each run also records
the CPU seconds every process used while it was timed (target, drafts, its coordinator, the
clients): the target's over the run's seconds is how many cores it kept busy, and what it left
idle is time spent waiting on the coordinator, the drafts or the round trips.
"""
import contextlib
import pathlib
import statistics
import time

from batchspec_tools.bench import arrivals, llamacpp

WARM_UP_TOKENS = 8
PLAIN = "grpc_target_only"


def methods_of(config, grpc_drafts: dict) -> list[str]:
    """The methods to serve (gRPC ones and llama.cpp's), the plain server always among them
    (the yardstick)."""
    chosen = [m for m in config.methods if m in grpc_drafts or m in llamacpp.METHODS]
    return chosen + [PLAIN] if PLAIN not in chosen else chosen


def sweep(stack, workload, config, reference, grpc_drafts: dict,
          grpc_flags: dict) -> list[dict]:
    """One row per (method, concurrency); [] without --concurrency. `reference`: the target
    alone's greedy answers (not used for sampled runs)."""
    from tqdm import tqdm

    if not config.concurrency:
        return []
    methods = methods_of(config, grpc_drafts)
    warm_up(stack, workload, config, methods, grpc_drafts, grpc_flags)
    rounds = turns(config.repeat, config.concurrency, methods)
    runs: dict[tuple[str, int], list[dict]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}  # each setting's first run's answers
    for round_, concurrency, method in tqdm(rounds, desc="closed-loop clients", unit="run"):
        extra = grpc_flags.get(method, ()) + step_log(config, f"{method}-c{concurrency}-r{round_}")
        row, answers = one_run(stack, workload, config, method, concurrency,
                               grpc_drafts.get(method), None if workload.sampling else reference,
                               extra)
        runs.setdefault((method, concurrency), []).append(row)
        outputs.setdefault((method, concurrency), answers)
    if workload.sampling:
        for (method, concurrency), found in runs.items():
            if method in llamacpp.METHODS:
                continue  # its tokens are not reported, and not the float32 model's
            plain = outputs[(PLAIN, concurrency)]
            for row in found:
                row["exact_match"] = arrivals.exact_share(outputs[(method, concurrency)], plain)
    rows = [summarise(method, concurrency, found) for (method, concurrency), found in runs.items()]
    add_plain_ratios(rows, runs)
    return rows


def turns(repeat: int, concurrency: list[int], methods: list[str]) -> list[tuple]:
    """(round, clients, method) in the order they run: every method in turn at each client
    count, the order reversed every other round (A B, B A, A B, ...), so neither server always
    runs first after a change of setting, and a machine that speeds up or slows down through
    a round moves the two alike over the rounds."""
    return [(r, c, m) for r in range(repeat) for c in concurrency
            for m in (methods if r % 2 == 0 else methods[::-1])]


def warm_up(stack, workload, config, methods: list[str], grpc_drafts: dict,
            grpc_flags: dict) -> None:
    """One untimed run of each method, in the first round's order, at the largest
    concurrency: a request per client, each answered in full (its step log, where kept,
    is METHOD-cC-warm.jsonl)."""
    clients = max(config.concurrency)
    prompts = workload.prompts[:clients]
    for method in methods:
        extra = grpc_flags.get(method, ()) + step_log(config, f"{method}-c{clients}-warm")
        with served(stack, workload, config, method, grpc_drafts.get(method), extra) as stub:
            arrivals.run_closed_loop(stub, prompts, workload.max_new_tokens, clients,
                                     workload.request_fields)


@contextlib.contextmanager
def served(stack, workload, config, method: str, drafts, extra=()):
    """A stub of a fresh coordinator over the stack's services (`drafts` its draft kinds),
    or of a fresh llama.cpp server for its methods."""
    import grpc

    from batchspec.v1 import generate_pb2_grpc

    if method in llamacpp.METHODS:
        import torch

        with llamacpp.served(workload, method, max(config.concurrency),
                             torch.get_num_threads()) as stub:
            yield stub
        return
    with stack.coordinator(workload, config.load_batch_size, config.ks[-1], drafts,
                           extra) as (port, _):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield generate_pb2_grpc.CoordinatorStub(channel)


def step_log(config, name: str, category: str | None = None) -> tuple[str, ...]:
    """The coordinator flags that keep a gRPC run's per-step log, NAME[-CATEGORY].jsonl under
    --step-logs (none without it)."""
    if not config.step_logs:
        return ()
    folder = pathlib.Path(config.step_logs)
    folder.mkdir(parents=True, exist_ok=True)
    return "--step-log", str(folder / f"{name}{'-' + category if category else ''}.jsonl")


def one_run(stack, workload, config, method: str, concurrency: int, drafts, reference,
            extra=()) -> tuple[dict, list[list[int]]]:
    """The run's row and its answers, in prompt order."""
    k = config.ks[-1]
    ours = method not in llamacpp.METHODS  # llama.cpp: in this process, its tokens unreported
    with served(stack, workload, config, method, drafts, extra) as stub:
        arrivals.run_closed_loop(stub, workload.prompts[:concurrency], WARM_UP_TOKENS,
                                 concurrency, workload.request_fields)
        before = cpu_now(stack)
        traces, seconds = arrivals.run_closed_loop(stub, workload.prompts,
                                                   workload.max_new_tokens, concurrency,
                                                   workload.request_fields)
        spent = cpu_spent(before, cpu_now(stack)) if ours else {}
    row = {"method": method, "concurrency": concurrency, "batch_size": config.load_batch_size,
           "k": k if drafts else None, **arrivals.summarise(traces, seconds),
           "steady_tokens_per_s": arrivals.steady_tokens_per_s(traces), "cpu_s": spent}
    if reference and ours:
        row["exact_match"] = arrivals.exact_share(traces, reference)
    return row, [t.token_ids for t in traces]


def cpu_now(stack) -> dict[str, float | None]:
    """CPU seconds used so far by each process of the stack and by this one (the clients)."""
    return {**stack.cpu_seconds(), "clients": time.process_time()}


def cpu_spent(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds each process used between two cpu_now readings (those read both times)."""
    return {role: round(after[role] - before[role], 2) for role in after
            if after[role] is not None and before.get(role) is not None}


def summarise(method: str, concurrency: int, runs: list[dict]) -> dict:
    """The median run by throughput, with every run's throughput and the medians of the
    latency percentiles; exact only if every run was."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    for key in ("steady_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                "itl_p99_ms"):
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = round(statistics.median(values), 1) if values else None
    if all("exact_match" in r for r in runs):
        row["exact_match"] = min(r["exact_match"] for r in runs)
    return row


def add_plain_ratios(rows: list[dict], runs: dict) -> None:
    """vs_plain: the row's median throughput over the plain server's at its concurrency;
    vs_plain_runs: the ratio within each round (the two runs taken one after the other)."""
    plain = {r["concurrency"]: r for r in rows if r["method"] == PLAIN}
    for row in rows:
        base = plain.get(row["concurrency"])
        if base is None or row["method"] == PLAIN:
            continue
        row["vs_plain"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        if row.get("steady_tokens_per_s") and base.get("steady_tokens_per_s"):
            row["steady_vs_plain"] = round(row["steady_tokens_per_s"]
                                           / base["steady_tokens_per_s"], 3)
        pairs = zip(runs[(row["method"], row["concurrency"])], runs[(PLAIN, row["concurrency"])])
        row["vs_plain_runs"] = [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in pairs]


def markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["## Closed-loop clients", "",
             "C clients each send their next request as soon as their last one ends. "
             f"`{PLAIN}` is the same server without drafts (`batchspec serve --draft-model "
             "none`); \"vs plain\" is the ratio of the median runs, its range the ratios "
             "within each round. \"Steady\" counts only the time while every client is busy "
             "(until the last request is sent), leaving out the final drain.", "",
             "| method | clients | tok/s (median) | runs | vs plain | range | steady tok/s "
             "| steady vs plain | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | drafted / token "
             "| accepted | exact |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | --- | --- | ---: | ---: "
             "| ---: |"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["method"] != PLAIN, r["method"])):
        spread = r.get("vs_plain_runs")
        ratio = f"{r['vs_plain']:.2f}x" if "vs_plain" in r else ""
        within = f"{min(spread):.2f}-{max(spread):.2f}" if spread else ""
        runs = " / ".join(f"{v:.1f}" for v in r["tokens_per_s_runs"])
        steady = r.get("steady_tokens_per_s") or ""
        steady_ratio = f"{r['steady_vs_plain']:.2f}x" if "steady_vs_plain" in r else ""
        accepted = f"{r['acceptance_rate']:.0%}" if r.get("acceptance_rate") is not None else ""
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {runs} "
                     f"| {ratio} | {within} | {steady} | {steady_ratio} | "
                     f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
                     f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | {drafted_per_token(r)} | "
                     f"{accepted} | {exact(r)} |")
    return lines + [""] + cpu_markdown(rows)


def exact(row: dict) -> str:
    """The share of exact answers ('-' for llama.cpp, which is not the float32 model)."""
    return "-" if row["method"] in llamacpp.METHODS else f"{row.get('exact_match', 0):.0%}"


def drafted_per_token(row: dict) -> str:
    """Draft tokens verified per generated token in the median run ('' for the plain server)."""
    if not row.get("num_drafted") or not row.get("num_tokens"):
        return ""
    return f"{row['num_drafted'] / row['num_tokens']:.2f}"


# the coordinator's time includes the n-gram draft's lookups (it runs them itself)
CPU_ROLES = (("target", "target"), ("model", "model draft"), ("coordinator", "coordinator"),
             ("clients", "clients"))


def cpu_markdown(rows: list[dict]) -> list[str]:
    """Where the CPU time of each median run went, per process, and how many cores the target
    kept busy on average (its CPU seconds over the run's): what it did not is time the
    services waited on each other, on the coordinator or on the clients."""
    rows = [r for r in rows if r.get("cpu_s")]
    if not rows:
        return []
    lines = ["CPU seconds of each median run, per process (the services are shared by every "
             "method; each method has its own coordinator), and the cores the target kept "
             "busy on average:", "",
             "| method | clients | " + " | ".join(name for _, name in CPU_ROLES)
             + " | target cores busy |",
             "| --- | ---: |" + " ---: |" * (len(CPU_ROLES) + 1)]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["method"] != PLAIN, r["method"])):
        spent = r["cpu_s"]
        cells = [f"{spent[role]:.2f}" if role in spent else "" for role, _ in CPU_ROLES]
        busy = f"{spent['target'] / r['seconds']:.2f}" if "target" in spent else ""
        lines.append(f"| {r['method']} | {r['concurrency']} | " + " | ".join(cells)
                     + f" | {busy} |")
    return lines + [""]
