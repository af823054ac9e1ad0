"""Load the way serving systems are judged, over gRPC: open-loop (requests arrive as a Poisson
process at a given rate) or closed-loop (C clients, each sending its next request as soon as
its last one ends). Each request streams its tokens, and a run reports throughput, time to
first token (TTFT) and inter-token latency (ITL) at p50 and p99.

ITL is measured per token: a streamed message carrying n tokens, t seconds after the previous
one, counts n gaps of t / n (speculation delivers several tokens at once).
"""
import concurrent.futures
import dataclasses
import math
import random
import threading
import time


def poisson_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of `count` requests at `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclasses.dataclass
class Trace:
    """One request's timeline (time.perf_counter values)."""

    arrival: float
    token_ids: list[int] = dataclasses.field(default_factory=list)
    first_token: float | None = None
    gaps: list[float] = dataclasses.field(default_factory=list)  # per token, after the first
    finished: float | None = None
    arrived_at: list[float] = dataclasses.field(default_factory=list)  # when each token came
    # from the request's closing stats: draft tokens verified for it, and accepted
    num_drafted: int = 0
    num_accepted: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def stream(stub, prompt: list[int], max_new_tokens: int, trace: Trace,
           fields: dict | None = None) -> None:
    """One request, streamed into `trace` (its arrival set by the caller); `fields`: more
    GenerateRequest fields (sampling settings and seed)."""
    from batchspec.v1 import generate_pb2

    last = None
    for response in stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=max_new_tokens, **(fields or {})),
            timeout=3600):
        now = time.perf_counter()
        n = len(response.token_ids)
        if n and trace.first_token is None:
            trace.first_token = now  # tokens delivered with the first count in TTFT only
        elif n:
            trace.gaps += [(now - last) / n] * n
        if n:
            last = now
        trace.token_ids += response.token_ids
        trace.arrived_at += [now] * n
        if response.HasField("stats"):
            trace.num_drafted = response.stats.num_drafted_tokens
            trace.num_accepted = response.stats.num_accepted_tokens
    trace.finished = time.perf_counter()


def run_load(stub, prompts: list[list[int]], max_new_tokens: int,
             offsets: list[float]) -> tuple[list[Trace], float]:
    """Send prompts[i] at offsets[i] seconds from now (one thread per request, started at its
    arrival); returns the traces and the seconds from the first arrival to the last finish."""
    start = time.perf_counter()
    traces = [Trace(start + o) for o in offsets]
    stop = threading.Event()

    def one(i: int) -> None:
        trace = traces[i]
        delay = trace.arrival - time.perf_counter()
        if delay > 0 and stop.wait(delay):
            return
        trace.arrival = time.perf_counter()
        stream(stub, prompts[i], max_new_tokens, trace)

    _run_all(one, len(prompts), len(prompts), stop)
    return traces, _span(traces)


def run_closed_loop(stub, prompts: list[list[int]], max_new_tokens: int,
                    concurrency: int, fields=None) -> tuple[list[Trace], float]:
    """`concurrency` clients share the prompts in order: each sends the next one as soon as
    its last answer ended, until every prompt is answered. fields: prompt index -> more
    GenerateRequest fields (None: greedy). Returns the traces (in prompt order) and the
    seconds from the first request to the last answer."""
    traces = [Trace(0.0) for _ in prompts]
    order = iter(range(len(prompts)))
    lock, stop = threading.Lock(), threading.Event()

    def client(_: int) -> None:
        while not stop.is_set():
            with lock:
                i = next(order, None)
            if i is None:
                return
            traces[i].arrival = time.perf_counter()
            stream(stub, prompts[i], max_new_tokens, traces[i], fields(i) if fields else None)

    _run_all(client, min(concurrency, len(prompts)), min(concurrency, len(prompts)), stop)
    return traces, _span(traces)


def _run_all(work, count: int, threads: int, stop: threading.Event) -> None:
    """work(0) .. work(count - 1) on `threads` threads; the first error stops the rest."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(work, i) for i in range(count)]
        try:
            for future in futures:
                future.result()
        finally:
            stop.set()


def _span(traces: list[Trace]) -> float:
    return max(t.finished for t in traces) - min(t.arrival for t in traces)


def exact_share(outputs: list, reference: list[list[int]]) -> float:
    """The share of requests whose tokens (traces, or token lists) equal the reference
    outputs, in order."""
    tokens = [o.token_ids if isinstance(o, Trace) else o for o in outputs]
    return round(sum(t == r for t, r in zip(tokens, reference)) / len(reference), 4)


def steady_tokens_per_s(traces: list[Trace]) -> float | None:
    """Closed-loop throughput while every client is busy: tokens delivered from the first
    request until the last one is sent (after it, clients run out of work one by one and the
    run drains), over that time. None when the last request is sent at once."""
    start, end = min(t.arrival for t in traces), max(t.arrival for t in traces)
    if end - start <= 0:
        return None
    tokens = sum(1 for t in traces for at in t.arrived_at if at <= end)
    return round(tokens / (end - start), 2)


def summarise(traces: list[Trace], seconds: float) -> dict:
    ttft = [t.first_token - t.arrival for t in traces if t.first_token is not None]
    gaps = [g for t in traces for g in t.gaps]
    tokens = sum(len(t.token_ids) for t in traces)
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    drafted, accepted = sum(t.num_drafted for t in traces), sum(t.num_accepted for t in traces)
    return {"num_requests": len(traces), "num_tokens": tokens, "seconds": round(seconds, 3),
            "num_drafted": drafted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_s": round(tokens / seconds, 2),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p99_ms": ms(percentile(gaps, 99))}
