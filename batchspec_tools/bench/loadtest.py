"""`batchspec loadtest`: many concurrent streams against a real coordinator on tiny models.

Starts the target, draft and coordinator as processes on loopback (tiny random models built
in a temporary directory, so it runs anywhere in seconds), opens N Generate streams at once
and reports what a serving system is judged by under overload: how many completed and how
many were refused (and how fast the refusal came), time to first token, the slowest health
answer while the streams ran, how full the pool was, the caches left in the services
afterwards, and whether every completed output equals the target alone.
"""
import argparse
import asyncio
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

from batchspec import cliargs

HEALTH_EVERY_S = 0.02
COORDINATOR = "batchspec.v1.Coordinator"


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    streams: int = 1000
    max_num_seqs: int = 64
    max_queue: int = 256
    max_new_tokens: int = 16
    batch_size: int = 16
    num_draft_tokens: int = 3
    arch: str = "llama"
    num_prompts: int = 16  # distinct prompts, cycled over the streams
    channels: int = 8  # client connections the streams are spread over
    timeout_s: float = 300.0  # per stream

    def __post_init__(self):
        if min(self.streams, self.max_num_seqs, self.max_new_tokens, self.batch_size,
               self.num_draft_tokens, self.num_prompts, self.channels) < 1:
            raise ValueError("every count must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.arch not in ("llama", "gpt2"):
            raise ValueError("arch must be llama or gpt2")


@dataclasses.dataclass
class Outcome:
    prompt: int  # index into the prompts
    code: str = "OK"  # grpc status name
    tokens: list = dataclasses.field(default_factory=list)
    first_token_s: float | None = None
    ended_s: float = 0.0  # from the stream's start


def prompts(count: int) -> list[list[int]]:
    return [[4 + (11 * i + 5 * j) % 90 for j in range(2 + i % 7)] for i in range(count)]


def build_parser() -> argparse.ArgumentParser:
    d = LoadConfig()
    parser = cliargs.parser("batchspec loadtest", __doc__.split("\n\n")[1])
    parser.add_argument("--streams", type=int, default=d.streams, help="concurrent streams")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                        help="the coordinator's pool")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help="the coordinator's queue")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="tokens per stream")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help="the coordinator's batch size")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=d.num_draft_tokens,
                        help="the most a step drafts")
    parser.add_argument("--arch", default=d.arch, choices=("llama", "gpt2"),
                        help="tiny model family")
    parser.add_argument("--channels", type=int, default=d.channels,
                        help="client connections the streams are spread over")
    parser.add_argument("--out", default=None, help="also write the report here (JSON)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = LoadConfig(streams=args.streams, max_num_seqs=args.max_num_seqs,
                            max_queue=args.max_queue, max_new_tokens=args.max_new_tokens,
                            batch_size=args.batch_size, num_draft_tokens=args.num_draft_tokens,
                            arch=args.arch, channels=args.channels)
    except ValueError as error:
        parser.error(str(error))
    out = pathlib.Path(args.out) if args.out else None
    if out is not None and (out.is_dir() or not cliargs.writable_dir(str(out.parent))):
        parser.error(f"--out {out}: cannot write a report file there")
    result = run(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(summary(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return 0 if result["checks_passed"] else 1


def run(config: LoadConfig, progress=lambda line: None) -> dict:
    """Start the three processes, run the load, stop them; the report as a dict."""
    from batchspec.runtime import tiny

    with tempfile.TemporaryDirectory(prefix="batchspec-load-") as scratch:
        target_dir, draft_dir = tiny.save_pair(config.arch, pathlib.Path(scratch))
        progress(f"tiny {config.arch} pair in {scratch}; starting the services")
        with Processes(config, target_dir, draft_dir) as procs:
            progress(f"running {config.streams} streams against pool {config.max_num_seqs} "
                     f"+ queue {config.max_queue}")
            result = asyncio.run(load(config, procs))
        expected = reference(target_dir, prompts(config.num_prompts), config.max_new_tokens)
    return report(config, result, expected)


class Processes:
    """Target, draft and coordinator as processes on free loopback ports."""

    def __init__(self, config: LoadConfig, target_dir: str, draft_dir: str):
        from batchspec_tools.processes import free_port

        self.config = config
        self.models = {"target": target_dir, "draft": draft_dir}
        self.ports = {role: free_port() for role in ("target", "draft", "coordinator")}
        self.metrics_port = free_port()
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        from batchspec_tools.processes import wait_healthy

        try:
            for role, name in (("target", "TargetService"), ("draft", "DraftService")):
                self._spawn([f"{role}_service", "--model", self.models[role]], role)
                wait_healthy(self.address(role), f"batchspec.v1.{name}", 120, self.procs)
            c = self.config
            self._spawn(["coordinator", "--target", self.address("target"), "--draft",
                         self.address("draft"), "--batch-size", str(c.batch_size), "-k",
                         str(c.num_draft_tokens), "--min-draft-confidence", "0",
                         "--max-num-seqs", str(c.max_num_seqs), "--max-queue",
                         str(c.max_queue), "--metrics-port", str(self.metrics_port)],
                        "coordinator")
            wait_healthy(self.address("coordinator"), COORDINATOR, 60, self.procs)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _spawn(self, module_args: list[str], role: str) -> None:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", *module_args, "--port", str(self.ports[role])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role]}"

    def __exit__(self, *_exc):
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def load(config: LoadConfig, procs: Processes) -> dict:
    """Open every stream at once; watch health and the pool meanwhile; then count caches."""
    import grpc

    channels = [grpc.aio.insecure_channel(procs.address("coordinator"))
                for _ in range(config.channels)]
    done = asyncio.Event()
    watch = {"running": [], "waiting": []}
    prober = HealthProber(procs.address("coordinator"))
    pool_watcher = asyncio.create_task(watch_pool(procs.metrics_port, done, watch))
    started = time.perf_counter()
    outcomes = await asyncio.gather(*[
        one_stream(channels[i % len(channels)], i % config.num_prompts, config)
        for i in range(config.streams)])
    wall_s = time.perf_counter() - started
    done.set()
    await pool_watcher
    watch.update(await asyncio.to_thread(prober.stop))
    caches = await caches_left(procs)
    for channel in channels:
        await channel.close()
    return {"outcomes": outcomes, "wall_s": wall_s, "caches_left": caches, **watch}


async def one_stream(channel, prompt: int, config: LoadConfig) -> Outcome:
    import grpc

    from batchspec.v1 import generate_pb2, generate_pb2_grpc

    outcome = Outcome(prompt)
    stub = generate_pb2_grpc.CoordinatorStub(channel)
    started = time.perf_counter()
    try:
        call = stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompts(config.num_prompts)[prompt],
            max_new_tokens=config.max_new_tokens, ignore_eos=True), timeout=config.timeout_s)
        async for response in call:
            if outcome.first_token_s is None and response.token_ids:
                outcome.first_token_s = time.perf_counter() - started
            outcome.tokens += response.token_ids
    except grpc.aio.AioRpcError as error:
        outcome.code = error.code().name
    outcome.ended_s = time.perf_counter() - started
    return outcome


class HealthProber:
    """A process of its own that asks grpc.health.v1 every HEALTH_EVERY_S, as a load
    balancer would, so that the client's own load does not delay its clock. `stop` returns
    each answer's time and how many checks failed (or said anything but SERVING)."""

    def __init__(self, address: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from batchspec_tools.bench.loadtest import probe_health; "
                                   f"probe_health({address!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def stop(self) -> dict:
        out, _ = self.proc.communicate(b"", timeout=30)
        return json.loads(out)


def probe_health(address: str) -> None:
    """The prober's loop: a health check, then a reflection query (list the services), until
    standard input closes; then print JSON."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    out = {"health_s": [], "health_failures": 0, "reflection_s": [], "reflection_failures": 0}
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        while not closed.wait(HEALTH_EVERY_S):
            started = time.perf_counter()
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(service=COORDINATOR),
                                      timeout=5)
                out["health_failures"] += answer.status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                out["health_failures"] += 1
            out["health_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            try:
                [answer] = reflection.ServerReflectionInfo(iter(
                    [reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                names = {s.name for s in answer.list_services_response.service}
                out["reflection_failures"] += COORDINATOR not in names
            except grpc.RpcError:
                out["reflection_failures"] += 1
            out["reflection_s"].append(time.perf_counter() - started)
    print(json.dumps(out))


async def watch_pool(metrics_port: int, done: asyncio.Event, watch: dict) -> None:
    """The coordinator's running and waiting gauges, every 50 ms."""
    while not done.is_set():
        gauges = await asyncio.to_thread(scrape_gauges, metrics_port)
        watch["running"].append(gauges.get("vllm:num_requests_running", 0))
        watch["waiting"].append(gauges.get("vllm:num_requests_waiting", 0))
        await asyncio.sleep(0.05)


def scrape_gauges(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return {s.name: s.value for family in text_string_to_metric_families(body.decode())
            if family.type == "gauge" for s in family.samples}


async def caches_left(procs: Processes, settle_s: float = 5.0) -> dict[str, int]:
    """Sequences each service still holds; waits up to settle_s for the last releases (a
    sequence is released right after its last tokens are streamed)."""
    import grpc

    from batchspec.v1 import cache_pb2, draft_pb2_grpc, target_pb2_grpc

    left = {}
    for role, stub_type in (("target", target_pb2_grpc.TargetServiceStub),
                            ("draft", draft_pb2_grpc.DraftServiceStub)):
        async with grpc.aio.insecure_channel(procs.address(role)) as channel:
            stub = stub_type(channel)
            end = time.monotonic() + settle_s
            while True:
                info = await stub.Describe(cache_pb2.DescribeRequest(), timeout=5)
                if info.num_sequences == 0 or time.monotonic() > end:
                    break
                await asyncio.sleep(0.05)
            left[role] = info.num_sequences
    return left


def reference(target_dir: str, prompt_list: list[list[int]], max_new_tokens: int) -> list:
    """The target alone, batch 1, greedy, end-of-sequence ignored (as the streams ask)."""
    from transformers import AutoModelForCausalLM

    from batchspec.runtime.tiny import greedy_ignoring_eos

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    return [greedy_ignoring_eos(model, prompt, max_new_tokens) for prompt in prompt_list]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def report(config: LoadConfig, result: dict, expected: list) -> dict:
    outcomes = result["outcomes"]
    completed = [o for o in outcomes if o.code == "OK"]
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    other = sorted({o.code for o in outcomes} - {"OK", "RESOURCE_EXHAUSTED"})
    ttft = [o.first_token_s for o in completed if o.first_token_s is not None]
    exact = sum(o.tokens == expected[o.prompt] for o in completed)
    out = {
        "config": dataclasses.asdict(config),
        "wall_s": round(result["wall_s"], 3),
        "completed": len(completed), "refused": len(refused),
        "other_errors": {c: sum(o.code == c for o in outcomes) for c in other},
        "slowest_refusal_s": max((o.ended_s for o in refused), default=None),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "health_checks": len(result["health_s"]),
        "health_failures": result["health_failures"],
        "slowest_health_s": max(result["health_s"], default=None),
        "reflection_failures": result["reflection_failures"],
        "slowest_reflection_s": max(result["reflection_s"], default=None),
        "max_running": max(result["running"], default=0),
        "max_waiting": max(result["waiting"], default=0),
        "caches_left": result["caches_left"],
        "exact": exact,
    }
    out["checks"] = {
        "every stream completed or was refused": not other,
        "refusals within 1 s": all(o.ended_s <= 1.0 for o in refused),
        "pool full": out["max_running"] == config.max_num_seqs,
        "health within 100 ms": out["slowest_health_s"] is not None
        and out["slowest_health_s"] <= 0.1 and not out["health_failures"],
        "reflection within 100 ms": out["slowest_reflection_s"] is not None
        and out["slowest_reflection_s"] <= 0.1 and not out["reflection_failures"],
        "no cache left": not any(result["caches_left"].values()),
        "completed outputs exact": exact == len(completed),
    }
    out["checks_passed"] = all(out["checks"].values())
    return out


def summary(report: dict) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1000:.0f} ms"  # noqa: E731
    c = report["config"]
    lines = [
        f"{c['streams']} streams, pool {c['max_num_seqs']}, queue {c['max_queue']}, "
        f"{c['max_new_tokens']} new tokens each, tiny {c['arch']} pair: {report['wall_s']} s",
        f"  completed {report['completed']}, refused {report['refused']} "
        f"(slowest refusal {ms(report['slowest_refusal_s'])}), other errors "
        f"{report['other_errors'] or 'none'}",
        f"  time to first token p50 {ms(report['ttft_p50_s'])}, p99 {ms(report['ttft_p99_s'])}",
        f"  health: {report['health_checks']} checks, slowest {ms(report['slowest_health_s'])}, "
        f"{report['health_failures']} failed; reflection: slowest "
        f"{ms(report['slowest_reflection_s'])}, {report['reflection_failures']} failed",
        f"  pool: at most {report['max_running']:.0f} running, {report['max_waiting']:.0f} "
        f"waiting; caches left {report['caches_left']}",
        f"  exact: {report['exact']} of {report['completed']} completed outputs",
    ]
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)
