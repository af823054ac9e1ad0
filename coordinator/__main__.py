"""python -m coordinator --target HOST:P --draft HOST:P --port P"""
import argparse
import dataclasses
import itertools
import logging

from batchspec import cliargs, errors, security
from batchspec import server as server_lib
from batchspec.metrics import CoordinatorMetrics, serve_metrics
from coordinator import http, scheduler
from coordinator.clients import DraftClient, TargetClient
from coordinator.drafts import group_by_model
from coordinator.engine import Engine, EngineConfig
from coordinator.router import Router
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer, Limits, add_to_server
from coordinator.telemetry import Telemetry
from coordinator.text import TextCodec

log = logging.getLogger("coordinator")
DEFAULT_PORT = 50051


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    targets: tuple[str, ...]
    drafts: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tokenizer: str | None = None
    engine: EngineConfig = EngineConfig()
    max_new_tokens: int = 4096
    connect_timeout_s: float = 60.0
    # a service that leaves a command unanswered this long (whatever the request deadlines)
    # is taken for hung and dropped like a lost one
    stall_timeout_s: float = 120.0
    grace_s: float = 10.0
    metrics_port: int | None = None  # Prometheus /metrics; None: off, 0: a free port
    tls: security.ServerTls | None = None  # TLS on the public API
    peer_tls: security.ClientTls | None = None  # (mutual) TLS to the model services
    api_key_file: str | None = None  # clients must send `authorization: Bearer <key>`
    # the OpenAI-compatible HTTP edge and its chat page; None: off, 0: a free port
    http_port: int | None = None

    def __post_init__(self):
        if not self.targets:
            raise ValueError("at least one --target is needed")
        for name, port in (("port", self.port), ("http_port", self.http_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], not {port}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be > 0")
        if self.api_key_file is not None:
            security.read_api_key(self.api_key_file)

    def peer_credentials(self):
        return self.peer_tls.credentials() if self.peer_tls else None


def build_parser() -> argparse.ArgumentParser:
    parser = cliargs.parser("batchspec coordinator", "Serve the public Generate API.")
    parser.add_argument("--target", action="append", required=True,
                        help="target service HOST:PORT; repeat or comma-separate for replicas")
    parser.add_argument("--draft", action="append", default=[],
                        help="draft service HOST:PORT; repeat or comma-separate. Services of "
                             "one model are replicas of one draft; different models (say the "
                             "model draft and the n-gram draft) are drafts chosen per sequence "
                             "(omit for target-only decoding)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json or a directory holding it (enables text prompts)")
    parser.add_argument("--batch-size", type=int, default=scheduler.GroupPolicy.batch_size,
                        help="most sequences per step (default %(default)s)")
    parser.add_argument("--num-draft-tokens", "-k", type=int,
                        default=EngineConfig.num_draft_tokens,
                        help="most tokens a step drafts per sequence (K; default %(default)s)")
    parser.add_argument("--draft-policy", choices=("goodput", "fixed"),
                        default=EngineConfig.draft_policy,
                        help="goodput: per sequence and step the K (0 to -k) with the most "
                             "expected tokens per second, from measured costs and acceptance; "
                             "fixed: always -k (default %(default)s)")
    parser.add_argument("--overlap", choices=("auto", "on", "off"), default=EngineConfig.overlap,
                        help="draft for the next cohort while the target verifies this one; "
                             "auto: unless both services run on CPU (default %(default)s)")
    parser.add_argument("--min-draft-confidence", type=float,
                        default=EngineConfig.min_draft_confidence,
                        help="greedy groups stop drafting once every row's draft probability "
                             "falls below this (default %(default)s: off)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences in the pool")
    parser.add_argument("--max-queue", type=int, default=1024,
                        help="requests that may wait for the pool before RESOURCE_EXHAUSTED")
    parser.add_argument("--max-prefill-tokens", type=int, default=EngineConfig.max_prefill_tokens,
                        help="prompt tokens per prefill command (a longer prompt goes alone)")
    parser.add_argument("--max-new-tokens", type=int, default=4096,
                        help="largest max_new_tokens a request may ask for")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to wait for the services at start-up")
    parser.add_argument("--stall-timeout", type=float, default=120.0,
                        help="seconds a service may leave a command unanswered before it is "
                             "taken for hung and dropped")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds to finish in-flight requests on SIGTERM")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (0: a free one)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                             "/v1/completions, /v1/models) and a chat page (/) on this port "
                             "(0: a free one; HTTPS with --tls-cert, the same API key)")
    security_flags = parser.add_argument_group("security (all off by default)")
    security_flags.add_argument("--tls-cert", default=None,
                                help="serve the public API over TLS with this certificate (PEM)")
    security_flags.add_argument("--tls-key", default=None, help="its private key (PEM)")
    security_flags.add_argument("--api-key-file", default=None,
                                help="file holding the API key clients must send as "
                                     "'authorization: Bearer <key>' (health stays open)")
    security_flags.add_argument("--tls-ca", default=None,
                                help="reach the model services over TLS, trusting this CA")
    security_flags.add_argument("--client-cert", default=None,
                                help="mutual TLS: certificate shown to the model services "
                                     "(with --tls-ca; default --tls-cert)")
    security_flags.add_argument("--client-key", default=None,
                                help="its private key (default --tls-key)")
    return parser


def peer_tls_from_args(args) -> security.ClientTls | None:
    """The model services' CA and the certificate shown to them: --client-cert/--client-key,
    else the public --tls-cert/--tls-key."""
    if args.client_cert is None and args.client_key is None and args.tls_ca is not None:
        return security.client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    return security.client_tls(args.tls_ca, args.client_cert, args.client_key)


def config_from_args(args) -> CoordinatorConfig:
    engine = EngineConfig(num_draft_tokens=args.num_draft_tokens,
                          draft_policy=args.draft_policy, overlap=args.overlap,
                          min_draft_confidence=args.min_draft_confidence,
                          policy=scheduler.GroupPolicy(batch_size=args.batch_size),
                          max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                          max_prefill_tokens=args.max_prefill_tokens)
    return CoordinatorConfig(targets=split_addresses(args.target),
                             drafts=split_addresses(args.draft), host=args.host,
                             port=args.port, tokenizer=args.tokenizer, engine=engine,
                             max_new_tokens=args.max_new_tokens,
                             connect_timeout_s=args.connect_timeout,
                             stall_timeout_s=args.stall_timeout, grace_s=args.grace,
                             metrics_port=args.metrics_port, http_port=args.http_port,
                             tls=security.server_tls(args.tls_cert, args.tls_key),
                             peer_tls=peer_tls_from_args(args), api_key_file=args.api_key_file)


@dataclasses.dataclass
class Running:
    """A started coordinator."""

    server: object
    port: int
    health: object
    engine: Router
    metrics: CoordinatorMetrics
    metrics_port: int | None
    http_port: int | None = None
    http_runner: object = None

    def stop(self, grace_s: float = 0.0) -> None:
        server_lib.set_serving(self.health, [SERVICE_NAME], serving=False)
        self.engine.stop(grace_s)
        if self.http_runner is not None:
            self.server.call(self.http_runner.cleanup())
        self.server.stop(grace_s).wait()


def connect(client, timeout_s: float):
    """Wait for a service and describe it (then close this probe connection)."""
    try:
        client.wait_ready(timeout_s)
        return client.describe()
    finally:
        client.close()


def build_router(config: CoordinatorConfig, eos_token_ids, telemetry,
                 kinds: list[list[str]]) -> Router:
    """One engine per target replica. kinds: draft addresses grouped by the model they
    serve; engine i uses replica i of each kind first and fails over to the others in turn.
    Each engine has its own connections (its own command streams)."""
    seq_ids = itertools.count(1)
    engines = []
    credentials = config.peer_credentials()
    for i, address in enumerate(config.targets):
        drafts = [[DraftClient(kind[(i + j) % len(kind)], config.stall_timeout_s, credentials)
                   for j in range(len(kind))] for kind in kinds]
        engines.append(Engine(TargetClient(address, config.stall_timeout_s, credentials),
                              drafts, config.engine, eos_token_ids, telemetry, seq_ids=seq_ids))
    router = Router(engines, config.engine.max_queue)
    telemetry.source = router
    return router


def split_addresses(values: list[str]) -> tuple[str, ...]:
    return tuple(a.strip() for v in values for a in v.split(",") if a.strip())


def start(config: CoordinatorConfig) -> Running:
    """Connect to the services, start the engine and the server. Health is SERVING once both
    peers answered, then while a target is reachable (without the draft it still decodes)."""
    credentials = config.peer_credentials()
    infos = [connect(TargetClient(a, credentials=credentials), config.connect_timeout_s)
             for a in config.targets]
    info = infos[0]
    if len({(i.vocab_size, tuple(i.eos_token_ids)) for i in infos}) != 1:
        raise errors.FailedPrecondition("target replicas host different models")
    draft_models = []
    for address in config.drafts:
        draft_info = connect(DraftClient(address, credentials=credentials),
                             config.connect_timeout_s)
        if draft_info.vocab_size > info.vocab_size:
            raise errors.FailedPrecondition(
                f"the draft at {address} ({draft_info.model}) has a vocabulary of "
                f"{draft_info.vocab_size} tokens, larger than the target's "
                f"({info.vocab_size}): they do not share a tokenizer")
        draft_models.append(draft_info.model)
    kinds = group_by_model(list(config.drafts), draft_models)
    codec = TextCodec(config.tokenizer) if config.tokenizer else None
    metrics = CoordinatorMetrics(info.model, config.engine.num_draft_tokens)
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = serve_metrics(metrics.registry, config.metrics_port,
                                     config.host).server_port
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    engine = build_router(config, info.eos_token_ids, Telemetry(metrics), kinds)
    limits = Limits(info.vocab_size, info.max_context_len, config.max_new_tokens)
    servicer = CoordinatorServicer(engine, limits, codec)
    interceptors = ([security.ApiKeyInterceptor(security.read_api_key(config.api_key_file))]
                    if config.api_key_file else [])
    server = server_lib.LoopServer(
        f"{config.host}:{config.port}",
        [(add_to_server, servicer, SERVICE_NAME)],
        credentials=config.tls.credentials() if config.tls else None, interceptors=interceptors)
    port, health = server.port, server.health
    # SERVING while the target is reachable (a lost draft only slows decoding); the engine
    # says when that changes.
    engine.on_health = lambda serving: server_lib.set_serving(health, [SERVICE_NAME], serving)
    engine.start()
    server.start()
    http_runner, http_port = None, None
    if config.http_port is not None:
        edge = http.HttpEdge(engine, limits, codec, http.ServedModels(
            info.model, info.model, tuple(dict.fromkeys(draft_models))),
            security.read_api_key(config.api_key_file) if config.api_key_file else None)
        http_runner, http_port = server.call(http.start(
            edge, config.host, config.http_port,
            ssl=config.tls.ssl_context() if config.tls else None))
        log.info("OpenAI-compatible HTTP API and chat page on %s://%s:%d/",
                 "https" if config.tls else "http", config.host, http_port)
    server_lib.set_serving(health, [SERVICE_NAME])
    log.info("coordinator on %s:%d (%s%s): targets %s (%s), drafts %s, K=%d, batch %d, "
             "pool %d, queue %d", config.host, port, "TLS" if config.tls else "plaintext",
             ", API key" if interceptors else "", ",".join(config.targets), info.model,
             "; ".join(f"{m}: {','.join(k)}" for m, k in zip(dict.fromkeys(draft_models), kinds))
             or "none", config.engine.num_draft_tokens,
             config.engine.policy.batch_size, config.engine.max_num_seqs,
             config.engine.max_queue)
    return Running(server, port, health, engine, metrics, metrics_port, http_port, http_runner)


def main(argv=None):
    config = server_lib.parse_config(build_parser(), argv, config_from_args)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    running = start(config)
    print(f"coordinator listening on {config.host}:{running.port}", flush=True)
    server_lib.run_until_signalled(running.server, running.health, [SERVICE_NAME],
                                   grace_s=config.grace_s, on_stop=running.engine.stop)


if __name__ == "__main__":
    main()
