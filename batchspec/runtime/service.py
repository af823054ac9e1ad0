"""What both model services share: the command loop over a bidirectional stream and the
cache commands (prefill, trim, release) of `batchspec.v1.cache.proto`."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import pathlib
import threading
import time
import uuid
from typing import TYPE_CHECKING

from batchspec import cliargs, errors, security
from batchspec import server as server_lib
from batchspec.metrics import ServiceMetrics, serve_metrics
from batchspec.runtime import cache_dir, compute, models, wire
from batchspec.v1 import cache_pb2

if TYPE_CHECKING:  # the n-gram draft serves without torch
    from batchspec.cachebook import CacheBook
    from batchspec.runtime import runner as runner_lib

log = logging.getLogger(__name__)

class Gate:
    """Who may start new sequences here, over every client of the service: its instance id
    (new at each start), draining (after SIGTERM: no new sequence, those held still served)
    and capacity (sequences, cached positions; 0: unlimited). Checked before a prefill runs,
    under the runner's lock."""

    def __init__(self, max_sequences: int = 0, max_cached_tokens: int = 0):
        self.instance_id = uuid.uuid4().hex
        self.max_sequences = max_sequences
        self.max_cached_tokens = max_cached_tokens
        self.draining = threading.Event()

    def check_stream(self, context) -> None:
        """Refuse a command stream opened for another instance of this service: its client
        believes we hold caches that died with that instance."""
        expected = dict(context.invocation_metadata()).get(server_lib.INSTANCE_METADATA)
        if expected and expected != self.instance_id:
            errors.abort_with(context, errors.FailedPrecondition(
                f"this service restarted: it is instance {self.instance_id}, not {expected}, "
                "and holds none of that instance's caches"))

    def admit(self, runner: CacheBook, entries: list[tuple[int, list[int]]]) -> None:
        """Refuse a prefill of new sequences while draining or beyond capacity."""
        if not entries:
            return
        if self.draining.is_set():
            raise errors.Draining("this service is draining (shutting down): place new "
                                  "sequences on another replica")
        if self.max_sequences and len(runner.caches) + len(entries) > self.max_sequences:
            raise errors.ResourceExhausted(
                f"{len(runner.caches)} sequences cached here, at most {self.max_sequences}: "
                "place these elsewhere or retry later")
        tokens = sum(len(t) for _, t in entries)
        if self.max_cached_tokens and (runner.num_cached_tokens() + tokens
                                       > self.max_cached_tokens):
            raise errors.ResourceExhausted(
                f"{runner.num_cached_tokens()} positions cached here, {tokens} more asked, at "
                f"most {self.max_cached_tokens}: place these elsewhere or retry later")

    def drain(self, runner: CacheBook, grace_s: float) -> None:
        """Take no new sequence; wait until every held one was released (its client moved it
        or finished it) or grace_s passed."""
        self.draining.set()
        end = time.monotonic() + grace_s
        held = len(runner.caches)
        log.info("draining: %d sequences held, up to %.0f s for them to finish or move",
                 held, grace_s)
        while runner.caches and time.monotonic() < end:
            time.sleep(0.05)
        log.info("drained: %d sequences still held", len(runner.caches))


def serve_commands(commands, runner: CacheBook, handle, result_type, context,
                   metrics=None):
    """Run a stream of commands in order, one result each; a refused command answers with a
    CommandError and the stream stays open. `handle(kind, command)` returns (field, message)."""
    for command in commands:
        received = time.monotonic()
        kind = command.WhichOneof("command")
        try:
            if kind is None:
                raise errors.InvalidArgument("command has no body")
            with runner.lock:
                if not context.is_active():
                    return  # the client gave up while this command waited: do not run it
                waited = time.monotonic() - received
                if command.timeout_ms and waited * 1000 > command.timeout_ms:
                    raise errors.DeadlineExceeded(
                        f"{kind} waited {waited:.3f}s, past its {command.timeout_ms}ms timeout")
                field, payload = compute.run(handle, kind, getattr(command, kind))
                if metrics is not None:
                    metrics.observe(kind, time.monotonic() - received, runner)
            yield result_type(command_id=command.command_id, **{field: payload})
        except errors.BatchspecError as error:
            yield result_type(command_id=command.command_id, error=wire.error(error))
        except Exception as error:  # a bug: say so without killing the stream
            log.exception("command %s failed", kind)
            yield result_type(command_id=command.command_id, error=wire.error(error))
        if not context.is_active():
            return


def timing(groups, started: float) -> cache_pb2.CommandTiming:
    """How a command of one group forward, or a list of them, spent its time (started: its
    time.perf_counter() at receipt)."""
    groups = groups if isinstance(groups, list) else [groups]
    return wire.timing(time.perf_counter() - started, sum(g.realign_seconds for g in groups),
                       sum(g.forward_seconds for g in groups))


class ModelServicer:
    """What both services' servicers share: the command stream and Describe. A subclass sets
    `result_type` and implements `handle_own(kind, command)` for its own commands."""

    result_type = None

    def __init__(self, runner: CacheBook, dtype: str = "float32", metrics=None,
                 gate: Gate | None = None):
        self.runner = runner
        self.dtype = dtype
        self.metrics = metrics
        self.gate = gate or Gate()
        # seq_id -> the command stream that prefilled it (changed under the runner's lock)
        self.owners: dict[int, object] = {}

    def RunCommands(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        """One client's command stream. The sequences it prefills belong to it: when it ends
        (the client closed it, crashed, or was cut off) those it did not release are released,
        so a coordinator that dies leaves nothing behind. A client never uses a cache through
        another stream than the one that made it (after a break it prefills again)."""
        self.gate.check_stream(context)
        stream = object()
        context.add_callback(lambda: self._release_orphans(stream))

        def handle(kind, command):
            result = self.handle(kind, command)
            if kind == "prefill":
                for entry in command.entries:
                    self.owners[entry.seq_id] = stream
            elif kind == "release":
                for seq_id in command.seq_ids:
                    self.owners.pop(seq_id, None)
            return result

        yield from serve_commands(request_iterator, self.runner, handle, self.result_type,
                                  context, self.metrics)

    def _release_orphans(self, stream) -> None:
        """Release what the ended `stream` prefilled and still owns (see RunCommands)."""
        with self.runner.lock:
            owned = [s for s, owner in self.owners.items() if owner is stream]
            for seq_id in owned:
                del self.owners[seq_id]
            orphans = [s for s in owned if s in self.runner.caches]
            if orphans:
                compute.run(self.runner.release, orphans)
                log.info("a command stream ended: released the %d sequences it still held",
                         len(orphans))

    def Describe(self, request, context):  # noqa: N802 (gRPC method name)
        # under the runner's lock, as a command runs: a consistent snapshot, and an answer
        # means the service takes commands (the coordinator probes a lost service this way)
        with self.runner.lock:
            return wire.model_info(self.runner, self.dtype, self.gate, self.feature_width(),
                                   models.calibrated(getattr(self.runner, "model", None)))

    def feature_width(self) -> int:
        """ModelInfo.feature_width: what a target returns or a draft reads (0: none)."""
        return 0

    def handle(self, kind, command):
        if kind == "prefill":
            self.gate.admit(self.runner, wire.prefill_entries(command))
        handled = handle_cache_command(self.runner, kind, command)
        return handled if handled is not None else self.handle_own(kind, command)

    def handle_own(self, kind, command):
        raise NotImplementedError


def handle_cache_command(runner: CacheBook, kind: str, command):
    """The commands both services obey, or None for a kind that is the service's own."""
    if kind == "prefill":
        entries, copies = wire.prefill_entries(command), wire.prefill_copies(command)
        features = wire.prefill_features(command)
        if features and not getattr(runner, "reads_features", 0):
            raise errors.InvalidArgument(f"{runner.name} reads no features; send none")
        if copies and features:
            raise errors.InvalidArgument("copy_from cannot be sent with features")
        lens = runner.prefill_copies(entries, copies) if copies else \
            runner.prefill(entries, features) if features else runner.prefill(entries)
        return "prefill", wire.prefill_result(lens)
    if kind == "trim":
        return "trim", wire.trim_result(runner.trim(wire.trim_entries(command)))
    if kind == "release":
        return "release", wire.release_result(runner.release(list(command.seq_ids)))
    return None


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """How to start a model service; built once from CLI flags."""

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    num_layers: int | None = None
    grace_s: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics; None: off, 0: a free port
    tls: security.ServerTls | None = None  # with client_ca set: mutual TLS
    max_sequences: int = 0  # over every client; 0: unlimited
    max_cached_tokens: int = 0  # cached positions over every client; 0: unlimited
    threads: int = 0  # CPU threads torch computes with; 0: the role's default (see threads_for)
    # a draft of another tokenizer: the target's tokenizer.json, whose tokens it drafts
    target_tokenizer: str | None = None
    # a target's hosted draft (--draft-model): served beside it, on its server and compute thread
    draft: "ServiceConfig | None" = None

    def __post_init__(self):
        models.check_spec(self.model)
        models.check_device(self.device)
        cliargs.check_ports(("port", self.port), ("metrics_port", self.metrics_port))
        if self.dtype not in models.DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {models.DTYPE_CHOICES}, not {self.dtype!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")
        if self.max_sequences < 0 or self.max_cached_tokens < 0:
            raise ValueError("--max-sequences and --max-cached-tokens must be >= 0")
        if self.threads < 0:
            raise ValueError("--threads must be >= 0")


def threads_for(role: str, config: ServiceConfig) -> int | None:
    """The CPU threads a service computes with: --threads when given; else one for a draft on
    the CPU, torch's default (every core) otherwise (None). A draft's forwards are small: more
    threads gain it little alone, and where the services share cores (a CPU deployment) its
    parallel regions would wait for workers the other processes hold."""
    if config.threads:
        return config.threads
    return 1 if role == "draft" and config.device == "cpu" else None


def build_runner(config: ServiceConfig) -> runner_lib.ModelRunner:
    import torch

    from batchspec.runtime import runner as runner_lib

    try:
        models.check_present(config.device)
    except ValueError as error:  # found at start-up, as a failure to start
        raise RuntimeError(str(error)) from None
    model = models.load_causal_lm(config.model, dtype=config.dtype, device=config.device,
                                  num_layers=config.num_layers)
    runner = runner_lib.ModelRunner(model, name=config.model,
                                    device=torch.device(config.device),
                                    eos_token_ids=models.eos_token_ids(model),
                                    max_context_len=models.max_context_len(model))
    runner.vocabulary = models.vocabulary_digest(config.model)
    return runner


def add_service_arguments(parser: argparse.ArgumentParser, default_port: int,
                          role: str = "target") -> None:
    parser.add_argument("--model", default=models.SMOLLM2,
                        help="local Hugging Face model dir, .gguf file, hub id, or 'smollm2' "
                             "(the packaged SmolLM2-135M-Instruct; default); for the draft "
                             "also 'ngram': prompt lookup, no model")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=default_port, help="port; 0 picks a free one")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    if role == "draft":
        parser.add_argument("--dtype", default=models.AUTO, choices=models.DTYPE_CHOICES,
                            help="parameter dtype (default auto: on a CPU, a distilled draft "
                                 "directory's linear layers multiply by Q8_0 blocks of its "
                                 "weights made at load, or without the block kernels a "
                                 "feature head in bfloat16 where the CPU multiplies it "
                                 "natively; float32 otherwise; drafts never change the "
                                 "output)")
        parser.add_argument("--target-tokenizer", default=None, metavar="TOKENIZER_JSON",
                            help="for a draft of another tokenizer than the target's: the "
                                 "target's tokenizer.json (or its directory); the service "
                                 "then takes and proposes the target's tokens, translating "
                                 "through text (batchspec serve sets it where the two "
                                 "differ)")
    else:
        parser.add_argument("--dtype", default=models.AUTO, choices=models.DTYPE_CHOICES,
                            help="parameter dtype (default auto: float32, where a GGUF "
                                 "model's linear layers multiply by its Q4_1/Q8_0 blocks as "
                                 "stored on a CPU; float32: dequantized weights only)")
        parser.add_argument("--draft-model", default=None,
                            help="host this draft model too: its DraftService answers on the "
                                 "same port, and a verify may ask it to propose first, in one "
                                 "command (no round trip of its own); a draft of the target's "
                                 "vocabulary (default: none)")
        parser.add_argument("--draft-dtype", default=models.AUTO, choices=models.DTYPE_CHOICES,
                            help="the hosted draft's parameter dtype (default auto, as the "
                                 "draft service's --dtype)")
        parser.add_argument("--draft-num-layers", type=int, default=None,
                            help="keep only the hosted draft's first N layers")
    parser.set_defaults(role=role)
    parser.add_argument("--num-layers", type=cliargs.positive_int, default=None,
                        help="keep only the model's first N layers (a cheap draft)")
    parser.add_argument("--grace", type=cliargs.bounded(float, 0.0), default=30.0,
                        help="on SIGTERM: seconds to keep serving the sequences held (no new "
                             "ones) while clients move or finish them (default 30)")
    parser.add_argument("--max-sequences", type=int, default=0,
                        help="sequences cached at once, over every coordinator; beyond, new "
                             "ones are refused with RESOURCE_EXHAUSTED (default 0: no limit)")
    parser.add_argument("--max-cached-tokens", type=int, default=0,
                        help="positions cached at once (KV memory), over every coordinator "
                             "(default 0: no limit)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (0: a free one)")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads to compute with (default 0: one for a draft on the "
                             "CPU, every core otherwise)")
    parser.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--tls-ca", default=None,
                        help="mutual TLS: accept only clients whose certificate this CA signed")


def config_from_args(args) -> ServiceConfig:
    draft = getattr(args, "draft_model", None)
    if draft is not None:
        models.check_hostable_draft(draft, args.model)
        draft = ServiceConfig(model=draft, host=args.host, port=args.port, device=args.device,
                              dtype=models.served_draft_dtype(args.draft_dtype, draft,
                                                              args.device),
                              num_layers=args.draft_num_layers)
    return ServiceConfig(model=args.model, host=args.host, port=args.port, device=args.device,
                         dtype=models.served_draft_dtype(args.dtype, args.model, args.device)
                         if args.role == "draft" else args.dtype,
                         num_layers=args.num_layers, grace_s=args.grace,
                         metrics_port=args.metrics_port, max_sequences=args.max_sequences,
                         max_cached_tokens=args.max_cached_tokens, threads=args.threads,
                         target_tokenizer=getattr(args, "target_tokenizer", None),
                         tls=security.server_tls(args.tls_cert, args.tls_key, args.tls_ca),
                         draft=draft)


def start_model_service(config: ServiceConfig, make_servicer, add_to_server, service_name, *,
                        build=None, warm=None, gate: Gate | None = None,
                        threads: int | None = None, host=None):
    """Load the model, start serving; returns (server, port, health, runner). Health turns
    SERVING only after the model is loaded and has run one warm-up forward. The model is
    loaded, tuned and run on the compute thread only (see batchspec.runtime.compute).
    build(config) -> runner and warm(runner) default to a model runner's; gate: see Gate
    (default: one from the config's capacity); threads: torch's CPU threads (None: its
    default), set on the compute thread before anything runs there; host(config, runner,
    servicer, gate) -> [(add_to_server, servicer, service name)]: services hosted beside it
    (a target's draft), ready to serve."""
    if threads:
        compute.run(set_threads, threads)
        log.info("computing with %d CPU thread%s", threads, "s" * (threads > 1))
    runner = compute.run(build or build_runner, config)
    compute.run(warm or warm_up, runner)
    role = service_name.rsplit(".", 1)[-1]
    metrics = ServiceMetrics(role)
    if config.metrics_port is not None:
        http = serve_metrics(metrics.registry, config.metrics_port, config.host)
        log.info("%s metrics on http://%s:%d/metrics", role, config.host, http.server_port)
    gate = gate or Gate(config.max_sequences, config.max_cached_tokens)
    servicer = make_servicer(runner, dtype=config.dtype, metrics=metrics, gate=gate)
    services = [(add_to_server, servicer, service_name)]
    services += host(config, runner, servicer, gate) if host is not None else []
    server, port, health = server_lib.create_server(
        f"{config.host}:{config.port}", services,
        credentials=config.tls.credentials() if config.tls else None)
    server.start()
    server_lib.set_serving(health, [name for _, _, name in services])
    log.info("%s serving %s on %s:%d (%s, %s, %s)", service_name, config.model, config.host,
             port, config.device, config.dtype,
             "plaintext" if config.tls is None
             else "mutual TLS" if config.tls.client_ca else "TLS")
    return server, port, health, runner


def set_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def warm_up(runner: runner_lib.ModelRunner, proposes: bool = False) -> None:
    """Plan the CPU linear kernels (timing them takes a few seconds for SmolLM2, the first
    time on a machine), run one forward, and measure what forwards cost (for the
    coordinator's choice of draft lengths; up to 30 seconds on a CPU, the first time this
    build serves the model on a machine: calibration.kept_step_costs). On a CPU the C++
    kernels are loaded first (built where they are not yet): sampled choices run there.
    `proposes`: the runner drafts (its forwards are timed as proposals run them)."""
    from batchspec.runtime import calibration, fastlinear, gguf_blocks

    if runner.device.type == "cpu":
        gguf_blocks.load()
    started = time.perf_counter()
    store = cache_dir.kernel_plans_file()
    if fastlinear.tune(runner.model, store):
        log.info("timed the CPU linear kernels of %s in %.1f s (kept in %s)", runner.name,
                 time.perf_counter() - started, store)
    runner.prefill([(-1, [0, 0])], {-1: calibration.zero_features(runner, 2, 1)[:, 0]}
                   if runner.reads_features else None)
    runner.release([-1])
    started = time.perf_counter()
    store = cache_dir.step_costs_file()
    log.info("forward costs of %s: kept ones from %s, else measured (up to %.0f s)",
             runner.name, store, calibration.CALIBRATION_BUDGET_S)
    runner.step_costs, measured = calibration.kept_step_costs(runner, proposes, store)
    largest = runner.step_costs[-1] if runner.step_costs else None
    log.info("%s %d forward costs in %.1f s (up to %d rows: %.1f ms for 1 token each)%s",
             "read" if measured else "measured", len(runner.step_costs),
             time.perf_counter() - started, largest.rows if largest else 0,
             1000 * next((c.seconds for c in runner.step_costs
                          if largest and c.rows == largest.rows and c.tokens == 1), 0.0),
             f", measured {measured} (delete {store.name} to measure again)" if measured
             else "")
    widened = calibration.StepWidening.of(runner)
    if widened is not None:
        log.info("GGUF steps of %s run in one C++ call up to %d positions (measured)",
                 runner.name, widened.decoder.max_rows)
    resident = return_free_memory()
    if resident is not None:
        log.info("resident memory after start-up: %.0f MB", resident)


def return_free_memory() -> float | None:
    """Hand what the allocator holds free back to the system (glibc's malloc_trim: the
    calibration's batches leave hundreds of MB free in its arenas); the process's resident
    memory after it, in MB (None where this is not Linux with glibc)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        status = pathlib.Path("/proc/self/status").read_text()
    except (OSError, AttributeError):
        return None
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")),
              None)
    return None if kb is None else int(kb) / 1024


def model_hosting(make_servicer, proposes: bool = False):
    """A `hosting` for main: serve a model runner with make_servicer (`proposes`: a draft)."""
    return lambda config: (make_servicer, build_runner,
                           functools.partial(warm_up, proposes=True) if proposes else warm_up)


def main(role: str, default_port: int, hosting, add_to_server, service_name, argv=None):
    """hosting(config) -> (make_servicer, build, warm[, host]): what serves the configured model
    (host: see start_model_service)."""
    parser = cliargs.parser(f"batchspec {role}", f"Serve the {role} over gRPC.")
    add_service_arguments(parser, default_port, role)
    config = server_lib.parse_config(parser, argv, config_from_args)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    make_servicer, build, warm, *host = hosting(config)
    gate = Gate(config.max_sequences, config.max_cached_tokens)
    try:
        server, port, health, runner = start_model_service(
            config, make_servicer, add_to_server, service_name, build=build, warm=warm,
            gate=gate, threads=threads_for(role, config), host=host[0] if host else None)
    except (OSError, RuntimeError, ValueError) as error:  # a model or device not to be had
        log.error("cannot serve %s on %s: %s", config.model, config.device, error)
        raise SystemExit(1) from None
    print(f"{role} listening on {config.host}:{port}", flush=True)
    # SIGTERM: NOT_SERVING, then draining: the held sequences are served until released
    names = [service_name] + (["batchspec.v1.DraftService"] if config.draft else [])
    server_lib.run_until_signalled(server, health, names, grace_s=config.grace_s,
                                   on_stop=lambda grace_s: gate.drain(runner, grace_s))
