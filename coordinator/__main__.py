"""python -m coordinator --target HOST:P --draft HOST:P --port P"""
import argparse
import dataclasses
import logging
import time

from batchspec import cliargs, errors, security
from batchspec import server as server_lib
from batchspec.metrics import CoordinatorMetrics, serve_metrics
from coordinator import config, fleet, http, membership
from coordinator.clients import DraftClient, ModelInfo, TargetClient
from coordinator.config import CoordinatorConfig
from coordinator.fleet import Fleet
from coordinator.grammar import Grammars
from coordinator.local_draft import LOCAL_NGRAM, LocalNgram
from coordinator.membership import Membership
from coordinator.requests import Limits
from coordinator.router import Router
from coordinator.servicer import SERVICE_NAME, CoordinatorServicer, add_to_server
from coordinator.telemetry import Telemetry
from coordinator.text import TextCodec

log = logging.getLogger("coordinator")


def build_parser() -> argparse.ArgumentParser:
    parser = cliargs.parser("batchspec coordinator", "Serve the public Generate API.")
    parser.add_argument("--target", action="append", required=True,
                        help="target replicas: HOST:PORT, dns:NAME:PORT (every address NAME "
                             "resolves to, re-resolved), file:PATH (one HOST:PORT per line, "
                             "re-read when it changes) or k8s:NAMESPACE/SERVICE:PORT (the "
                             "Service's ready endpoints, watched); repeat or comma-separate")
    parser.add_argument("--draft", action="append", default=[],
                        help="draft replicas, in the same forms as --target. Services of one "
                             "model are replicas of one draft; different models (say the "
                             "model draft and the n-gram draft) are drafts chosen per sequence; "
                             "local:ngram runs the n-gram draft in this process, with no round "
                             "trip (omit for target-only decoding)")
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
    membership: Membership | None = None

    def stop(self, grace_s: float = 0.0) -> None:
        server_lib.set_serving(self.health, [SERVICE_NAME], serving=False)
        if self.membership is not None:
            self.membership.stop()
        self.router.stop(grace_s)
        if self.http_runner is not None:
            self.server.call(self.http_runner.cleanup())
        self.server.stop(grace_s).wait()


@dataclasses.dataclass(frozen=True)
class Services:
    """What the services said of themselves at start-up."""

    target: ModelInfo  # the first target replica's (all host the same model)
    targets: list[str]  # the target addresses found at start
    kinds: list[tuple[str, list[str]]]  # (model, draft addresses) per draft kind
    tls_names: dict[str, str | None]  # address -> the name its certificate carries
    local: LocalNgram | None = None  # the n-gram draft this process runs, if a kind names it

    @property
    def draft_models(self) -> list[str]:
        return [model for model, _ in self.kinds]


def initial_members(sources: list, timeout_s: float, what: str) -> dict[str, str | None]:
    """The addresses the sources name now (with their TLS names); for targets, waits (up to
    timeout_s) until a dynamic source names one."""
    end = time.monotonic() + timeout_s
    while True:
        addresses = Membership.resolve(sources)  # in the order the flags name them
        if addresses or what != "target" or time.monotonic() > end:
            break
        time.sleep(0.5)
    if what == "target" and not addresses:
        raise errors.Unavailable(f"no target replica found in {', '.join(map(str, sources))} "
                                 f"within {timeout_s:.0f} s")
    return addresses


def connect_all(config: CoordinatorConfig, target_sources: list,
                draft_sources: list) -> Services:
    """Describe every service the sources name at start; refuse targets of different models
    and drafts whose vocabulary the target's does not cover."""
    credentials = config.peer_credentials()
    targets = initial_members(target_sources, config.connect_timeout_s, "target")
    infos = [fleet.describe(TargetClient(a, credentials=credentials, tls_name=name),
                            config.connect_timeout_s) for a, name in targets.items()]
    for address, info in zip(targets, infos):
        fleet.check_target(info, infos[0], address)
    kinds: dict[str, list[str]] = {}
    drafts = initial_members(draft_sources, config.connect_timeout_s, "draft")
    local = LocalNgram() if LOCAL_NGRAM in drafts else None
    for address, name in drafts.items():
        client = local if address == LOCAL_NGRAM else \
            DraftClient(address, credentials=credentials, tls_name=name)
        draft_info = fleet.describe(client, config.connect_timeout_s)
        fleet.check_draft(draft_info, infos[0], address)
        kinds.setdefault(draft_info.model, []).append(address)
    return Services(infos[0], list(targets), list(kinds.items()), {**targets, **drafts}, local)


def build_fleet(config: CoordinatorConfig, services: Services, telemetry: Telemetry) -> Fleet:
    """One engine per target replica found at start. Drafts serving one model are replicas
    of one kind; engine i uses replica i of each kind first and fails over to the others in
    turn. Each engine has its own connections (its own command streams)."""
    router = Router(config.engine.max_queue, telemetry)
    built = Fleet(config, router, telemetry, services.target, services.kinds,
                  services.tls_names, services.local)
    for address in services.targets:
        built.build_engine(address, services.tls_names.get(address))
    return built


def start(config: CoordinatorConfig, resolve=None) -> Running:
    """Connect to the services, start the engines, the server and membership. Health is
    SERVING once every peer answered, then while a target takes requests (without a draft it
    still decodes). resolve(name) -> IPs: the DNS lookup of dns: sources (default the
    system's)."""
    target_sources = [membership.parse_source(s, resolve) for s in config.targets]
    draft_sources = [membership.parse_source(s, resolve) for s in config.drafts]
    services = connect_all(config, target_sources, draft_sources)
    codec = TextCodec(config.tokenizer) if config.tokenizer else None
    metrics = CoordinatorMetrics(services.target.model, config.engine.num_draft_tokens)
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = serve_metrics(metrics.registry, config.metrics_port,
                                     config.host).server_port
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    built = build_fleet(config, services, Telemetry(metrics))
    router = built.router
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
    members = Membership(built, target_sources, draft_sources, config.membership_interval_s)
    members.start()
    http_runner, http_port = start_http(config, server, router, limits, codec, services,
                                        grammars)
    server_lib.set_serving(server.health, [SERVICE_NAME])
    log.info("coordinator on %s:%d (%s%s): targets %s (%s), drafts %s, K=%d, batch %d, "
             "pool %d, queue %d", config.host, server.port, "TLS" if config.tls else
             "plaintext", ", API key" if interceptors else "", ",".join(services.targets),
             services.target.model, "; ".join(f"{m}: {','.join(k)}"
                                              for m, k in services.kinds) or "none",
             config.engine.num_draft_tokens, config.engine.cohort_policy.batch_size,
             config.engine.max_num_seqs, config.engine.max_queue)
    return Running(server, server.port, server.health, router,
                   metrics, metrics_port, http_port, http_runner, members)


def start_http(config: CoordinatorConfig, server, router: Router, limits: Limits,
               codec: TextCodec | None, services: Services, grammars: Grammars | None):
    """The HTTP edge on the public server's loop, if asked for: (runner, port), or Nones."""
    if config.http_port is None:
        return None, None
    edge = http.HttpEdge(router, limits, codec, http.ServedModels(
        services.target.model, services.target.model, tuple(services.draft_models)),
        security.read_api_key(config.api_key_file) if config.api_key_file else None, grammars,
        serving=lambda: server.health.serving(SERVICE_NAME))
    runner, port = server.call(http.start(edge, config.host, config.http_port,
                                          ssl=config.tls.ssl_context() if config.tls else None))
    log.info("OpenAI-compatible HTTP API and chat page on %s://%s:%d/",
             "https" if config.tls else "http", config.host, port)
    return runner, port


def main(argv=None):
    settings = server_lib.parse_config(build_parser(), argv, config.config_from_args)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    try:
        running = start(settings)
    except (errors.BatchspecError, OSError, RuntimeError) as error:  # no service, no port
        log.error("cannot start: %s", error)
        raise SystemExit(1) from None
    print(f"coordinator listening on {settings.host}:{running.port}", flush=True)
    server_lib.run_until_signalled(running.server, running.health, [SERVICE_NAME],
                                   grace_s=settings.grace_s, on_stop=running.router.stop)


if __name__ == "__main__":
    main()
