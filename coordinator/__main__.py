"""python -m coordinator --target HOST:P --draft HOST:P --port P"""
import argparse
import dataclasses
import itertools
import logging

from batchspec import cliargs, errors, security
from batchspec import server as server_lib
from batchspec.metrics import CoordinatorMetrics, serve_metrics
from coordinator import config, http
from coordinator.clients import DraftClient, ModelInfo, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.drafts import group_by_model
from coordinator.engine import Engine
from coordinator.grammar import Grammars
from coordinator.requests import Limits
from coordinator.router import Router
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer, add_to_server
from coordinator.stats import StepLog
from coordinator.telemetry import Telemetry
from coordinator.text import TextCodec

log = logging.getLogger("coordinator")


def build_parser() -> argparse.ArgumentParser:
    parser = cliargs.parser("batchspec coordinator", "Serve the public Generate API.")
    parser.add_argument("--target", action="append", required=True,
                        help="target service HOST:PORT; repeat or comma-separate for replicas")
    parser.add_argument("--draft", action="append", default=[],
                        help="draft service HOST:PORT; repeat or comma-separate. Services of "
                             "one model are replicas of one draft; different models (say the "
                             "model draft and the n-gram draft) are drafts chosen per sequence "
                             "(omit for target-only decoding)")
    config.add_flags(parser, config.CONNECTION_FLAGS + config.PUBLIC_FLAGS
                     + config.ENGINE_FLAGS)
    security_flags = parser.add_argument_group("security (all off by default)")
    security_flags.add_argument("--tls-cert", default=None,
                                help="serve the public API over TLS with this certificate (PEM)")
    security_flags.add_argument("--tls-key", default=None, help="its private key (PEM)")
    security_flags.add_argument("--tls-ca", default=None,
                                help="reach the model services over TLS, trusting this CA")
    security_flags.add_argument("--client-cert", default=None,
                                help="mutual TLS: certificate shown to the model services "
                                     "(with --tls-ca; default --tls-cert)")
    security_flags.add_argument("--client-key", default=None,
                                help="its private key (default --tls-key)")
    return parser


@dataclasses.dataclass
class Running:
    """A started coordinator."""

    server: object
    port: int
    health: object
    router: Router
    metrics: CoordinatorMetrics
    metrics_port: int | None
    http_port: int | None = None
    http_runner: object = None

    def stop(self, grace_s: float = 0.0) -> None:
        server_lib.set_serving(self.health, [SERVICE_NAME], serving=False)
        self.router.stop(grace_s)
        if self.http_runner is not None:
            self.server.call(self.http_runner.cleanup())
        self.server.stop(grace_s).wait()


@dataclasses.dataclass(frozen=True)
class Services:
    """What the services said of themselves at start-up."""

    target: ModelInfo  # the first target replica's (all host the same model)
    draft_models: list[str]  # per draft address, the model it serves
    kinds: list[list[str]]  # draft addresses grouped by model: one list per draft kind


def connect(client, timeout_s: float) -> ModelInfo:
    """Wait for a service and describe it (then close this probe connection)."""
    try:
        client.wait_ready(timeout_s)
        return client.describe()
    finally:
        client.close()


def connect_all(config: CoordinatorConfig) -> Services:
    """Describe every service; refuse targets of different models and drafts whose
    vocabulary the target's does not cover."""
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
    return Services(info, draft_models, group_by_model(list(config.drafts), draft_models))


def build_router(config: CoordinatorConfig, eos_token_ids, telemetry: Telemetry,
                 kinds: list[list[str]]) -> Router:
    """One engine per target replica. kinds: draft addresses grouped by the model they
    serve; engine i uses replica i of each kind first and fails over to the others in turn.
    Each engine has its own connections (its own command streams)."""
    seq_ids = itertools.count(1)
    credentials = config.peer_credentials()
    router = Router(config.engine.max_queue, telemetry)
    step_log = StepLog(config.step_log) if config.step_log else None
    for i, address in enumerate(config.targets):
        drafts = [[DraftClient(kind[(i + j) % len(kind)], config.stall_timeout_s, credentials)
                   for j in range(len(kind))] for kind in kinds]
        router.add(Engine(TargetClient(address, config.stall_timeout_s, credentials), drafts,
                          config.engine, eos_token_ids, telemetry=telemetry, router=router,
                          seq_ids=seq_ids, step_log=step_log))
    return router


def start(config: CoordinatorConfig) -> Running:
    """Connect to the services, start the engines and the server. Health is SERVING once
    every peer answered, then while a target is reachable (without a draft it still
    decodes)."""
    services = connect_all(config)
    codec = TextCodec(config.tokenizer) if config.tokenizer else None
    metrics = CoordinatorMetrics(services.target.model, config.engine.num_draft_tokens)
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = serve_metrics(metrics.registry, config.metrics_port,
                                     config.host).server_port
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    router = build_router(config, services.target.eos_token_ids, Telemetry(metrics), services.kinds)
    limits = Limits(services.target.vocab_size, services.target.max_context_len,
                    config.max_new_tokens)
    grammars = (Grammars(codec.tokenizer.to_str(), limits.vocab_size,
                         list(services.target.eos_token_ids)) if codec else None)
    interceptors = ([security.ApiKeyInterceptor(security.read_api_key(config.api_key_file))]
                    if config.api_key_file else [])
    server = server_lib.LoopServer(
        f"{config.host}:{config.port}",
        [(add_to_server, CoordinatorServicer(router, limits, codec, grammars), SERVICE_NAME)],
        credentials=config.tls.credentials() if config.tls else None, interceptors=interceptors)
    router.start(on_health=lambda serving: server_lib.set_serving(
        server.health, [SERVICE_NAME], serving))
    server.start()
    http_runner, http_port = start_http(config, server, router, limits, codec, services,
                                        grammars)
    server_lib.set_serving(server.health, [SERVICE_NAME])
    log.info("coordinator on %s:%d (%s%s): targets %s (%s), drafts %s, K=%d, batch %d, "
             "pool %d, queue %d", config.host, server.port, "TLS" if config.tls else
             "plaintext", ", API key" if interceptors else "", ",".join(config.targets),
             services.target.model, "; ".join(f"{m}: {','.join(k)}" for m, k in zip(
                 dict.fromkeys(services.draft_models), services.kinds)) or "none",
             config.engine.num_draft_tokens, config.engine.cohort_policy.batch_size,
             config.engine.max_num_seqs, config.engine.max_queue)
    return Running(server, server.port, server.health, router,
                   metrics, metrics_port, http_port, http_runner)


def start_http(config: CoordinatorConfig, server, router: Router, limits: Limits,
               codec: TextCodec | None, services: Services, grammars: Grammars | None):
    """The HTTP edge on the public server's loop, if asked for: (runner, port), or Nones."""
    if config.http_port is None:
        return None, None
    edge = http.HttpEdge(router, limits, codec, http.ServedModels(
        services.target.model, services.target.model, tuple(dict.fromkeys(services.draft_models))),
        security.read_api_key(config.api_key_file) if config.api_key_file else None, grammars)
    runner, port = server.call(http.start(edge, config.host, config.http_port,
                                          ssl=config.tls.ssl_context() if config.tls else None))
    log.info("OpenAI-compatible HTTP API and chat page on %s://%s:%d/",
             "https" if config.tls else "http", config.host, port)
    return runner, port


def main(argv=None):
    settings = server_lib.parse_config(build_parser(), argv, config.config_from_args)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    running = start(settings)
    print(f"coordinator listening on {settings.host}:{running.port}", flush=True)
    server_lib.run_until_signalled(running.server, running.health, [SERVICE_NAME],
                                   grace_s=settings.grace_s, on_stop=running.router.stop)


if __name__ == "__main__":
    main()
