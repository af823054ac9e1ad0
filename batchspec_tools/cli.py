"""The `batchspec` command: serve, generate, and the three services as subcommands."""
import argparse
import logging
import signal
import subprocess
import sys
import time

from batchspec import cliargs, security
from batchspec_tools import processes

log = logging.getLogger("batchspec")
DEFAULT_DRAFT_LAYERS = 4  # without a distilled draft for the target: its first layers


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": serve, "generate": generate, "health": health,
                "distill": _module_main("batchspec_tools.drafting.distill"),
                "evaluate-draft": _module_main("batchspec_tools.drafting.evaluate"),
                "bench": _module_main("batchspec_tools.bench.run"),
                "loadtest": _module_main("batchspec_tools.bench.loadtest"),
                "steps": _module_main("batchspec_tools.bench.steps"),
                "target": _service("target_service"), "draft": _service("draft_service"),
                "coordinator": _service("coordinator")}
    if argv and argv[0] in ("-V", "--version"):
        print(f"batchspec {version()}")
        return 0
    if argv and argv[0] not in commands and argv[0] not in ("-h", "--help"):
        print(f"batchspec: unknown command {argv[0]!r}; `batchspec --help` lists the commands",
              file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: batchspec {serve,generate,health,distill,evaluate-draft,bench,loadtest,"
              "steps,target,draft,coordinator} [options]\n       batchspec --version\n\n"
              "  serve        start target, draft and coordinator on loopback and serve\n"
              "  generate     stream a completion from a running coordinator\n"
              "  health       exit 0 when a server's grpc.health.v1 says SERVING\n"
              "  distill      train a draft for a target by distillation\n"
              "  evaluate-draft  a draft's agreement (greedy, sampled) and cost, on "
              "held-out prompts\n"
              "  bench        compare batchspec with the alternatives, side by side\n"
              "  loadtest     many concurrent streams against a coordinator on tiny models\n"
              "  steps        where a served run's time went, from `bench --step-logs DIR`\n"
              "  target       run the target service   (python -m target_service)\n"
              "  draft        run the draft service    (python -m draft_service)\n"
              "  coordinator  run the coordinator      (python -m coordinator)\n\n"
              "`batchspec COMMAND --help` for each command's options.",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    return commands[argv[0]](argv[1:]) or 0


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("batchspec")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _module_main(module: str):
    def run(argv):
        import importlib

        return importlib.import_module(module).main(argv)
    return run


def _service(module: str):
    def run(argv):
        import importlib

        importlib.import_module(f"{module}.__main__").main(argv)
    return run


# ---- serve --------------------------------------------------------------------------------------
def serve_parser() -> argparse.ArgumentParser:
    from batchspec.runtime import models
    from coordinator import config

    parser = cliargs.parser("batchspec serve", (
        "Start the target and draft services and the coordinator on loopback; serve until "
        "stopped (Ctrl-C or SIGTERM)."))
    parser.add_argument("--target-model", default="smollm2",
                        help="target model: HF dir, .gguf file, hub id, or 'smollm2'")
    parser.add_argument("--draft-model", default="auto,ngram",
                        help="drafts, comma-separated, each chosen per sequence: a model "
                             "(HF dir, .gguf file, hub id; its own draft service), a shipped "
                             "draft ('smollm2-draft': layers, 'smollm2-eagle': a "
                             "feature head reading the target's features), 'auto' (the best "
                             "draft shipped for the target, else its first "
                             f"{DEFAULT_DRAFT_LAYERS} layers), 'ngram' (prompt lookup, no "
                             "model, run in the coordinator's process), or 'none' (the target "
                             "alone)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="keep only the draft models' first N layers")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json or dir (default: the target's own, if it has one)")
    parser.add_argument("--device", default="cpu", help="device of both models")
    parser.add_argument("--target-device", default=None, help="overrides --device for the target")
    parser.add_argument("--draft-device", default=None,
                        help="overrides --device for the draft models")
    parser.add_argument("--dtype", default=models.AUTO, choices=models.DTYPE_CHOICES,
                        help="parameter dtype of the models (default auto: float32, where a "
                             "GGUF target's linear layers multiply by its Q4_1/Q8_0 blocks as "
                             "stored on a CPU)")
    parser.add_argument("--draft-dtype", default=None, choices=models.DTYPE_CHOICES,
                        help="overrides --dtype for the draft models (default: auto where "
                             "--dtype is auto or float32: bfloat16 for a feature head on a "
                             "CPU that multiplies bfloat16 natively, float32 otherwise)")
    parser.add_argument("--draft-host", default="target", choices=("target", "own"),
                        help="where the first draft model runs: in the target's process "
                             "(default: its proposals ride in the verify, with no round "
                             "trip of their own), or in a draft service of its own (as "
                             "every further draft model, and a draft on another device or "
                             "of another tokenizer)")
    parser.add_argument("--startup-timeout", type=cliargs.positive_seconds, default=600.0,
                        help="seconds to wait for each service to become healthy")
    coordinator = parser.add_argument_group("coordinator (as `batchspec coordinator`)")
    config.add_flags(coordinator, serve_flags())
    coordinator.add_argument("--tls-cert", default=None,
                             help="serve the public API (gRPC and HTTP) over TLS with this "
                                  "certificate (PEM); the services stay on loopback")
    coordinator.add_argument("--tls-key", default=None, help="its private key (PEM)")
    return parser


def serve_flags():
    """The coordinator's flags that `serve` takes and passes on to the coordinator it starts."""
    from coordinator import config

    return config.PUBLIC_FLAGS + config.ENGINE_FLAGS


def serve(argv) -> int:
    from batchspec.runtime import models
    from coordinator import config
    from coordinator.local_draft import LOCAL_NGRAM

    parser = serve_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.draft_model.split(",") if n.strip()]
    if not names or ("none" in names and len(names) > 1) or len(set(names)) != len(names):
        parser.error("--draft-model: one or more distinct drafts, or 'none' alone")
    try:  # refused here, before any service starts, as the services would refuse them
        config.engine_config_from_args(args)
        check_models_and_devices(args, names)
        public_tls = security.server_tls(args.tls_cert, args.tls_key)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s %(message)s")
    # port 0 means a free one: pick it here, so that what is announced is what is served
    args.port = args.port or processes.free_port()
    if args.http_port == 0:
        args.http_port = processes.free_port()
    if args.metrics_port == 0:
        args.metrics_port = processes.free_port()
    services = serve_services(args, names)
    target = f"127.0.0.1:{services[0][1]}"
    coordinator_argv = ["--target", target]
    hosted = hosted_draft(args, names)
    ports = iter(port for _, port, _ in services[1:])
    for name in names if names != ["none"] else []:  # the drafts' order is the kinds'
        coordinator_argv += ["--draft", LOCAL_NGRAM if name == "ngram" else target
                            if name == hosted else f"127.0.0.1:{next(ports)}"]
    tokenizer = args.tokenizer or models.tokenizer_file(args.target_model)
    if tokenizer:
        coordinator_argv += ["--tokenizer", tokenizer]
    coordinator_argv += config.forward(args, serve_flags())
    if public_tls:
        coordinator_argv += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    try:  # what the coordinator would refuse, refused before the services take their minute
        coordinator_config(coordinator_argv)
    except ValueError as error:
        parser.error(str(error))
    return run_services(args, services, [sys.executable, "-m", "coordinator", *coordinator_argv],
                        public_tls)


def coordinator_config(argv: list[str]):
    """The CoordinatorConfig a coordinator started with `argv` would take (ValueError for
    what it would refuse)."""
    from coordinator import config
    from coordinator.__main__ import build_parser

    return config.config_from_args(build_parser().parse_args(argv))


def check_models_and_devices(args, names: list[str]) -> None:
    """ValueError for a model that cannot be named or a device that does not exist."""
    from batchspec.runtime import models

    for model in [args.target_model] + [n for n in names if n not in ("auto", "ngram", "none")]:
        models.check_spec(model)
    for device in (args.device, args.target_device, args.draft_device):
        if device is not None:
            models.check_device(device)


def serve_services(args, names: list[str]) -> list[tuple[list[str], int, str]]:
    """(command, port, gRPC service name) of the target, then of each draft model (the
    n-gram draft runs in the coordinator's process: no service)."""
    target_port = processes.free_port()
    target_cmd = [sys.executable, "-m", "target_service", "--model", args.target_model,
                  "--port", str(target_port), "--device", args.target_device or args.device,
                  "--dtype", args.dtype]
    hosted = hosted_draft(args, names)
    if hosted is not None:
        target_cmd += hosted_flags(args, hosted)
    services = [(target_cmd, target_port, "batchspec.v1.TargetService")]
    for name in [n for n in names if n not in ("none", "ngram", hosted)]:
        port = processes.free_port()
        services.append((draft_command(args, name, port), port, "batchspec.v1.DraftService"))
    return services


def hosted_draft(args, names: list[str]) -> str | None:
    """The draft model (its name in --draft-model) the target hosts: with --draft-host target,
    the first model draft, where it runs on the target's device and shares its vocabulary;
    None: each draft model has a service of its own."""
    from batchspec.runtime import models

    drafts = [n for n in names if n not in ("none", "ngram")]
    if args.draft_host != "target" or not drafts \
            or (args.draft_device or args.device) != (args.target_device or args.device):
        return None
    model, _ = pick_draft(args.target_model, None if drafts[0] == "auto" else drafts[0],
                          args.draft_layers)
    return drafts[0] if models.hostable_draft(model, args.target_model) else None


def hosted_flags(args, name: str) -> list[str]:
    """The target service's flags that host draft `name` (see hosted_draft)."""
    from batchspec.runtime import models

    model, layers = pick_draft(args.target_model, None if name == "auto" else name,
                               args.draft_layers)
    return (["--draft-model", model,
             "--draft-dtype", models.draft_service_dtype(args.dtype, args.draft_dtype)]
            + (["--draft-num-layers", str(layers)] if layers else []))


def run_services(args, services, coordinator_cmd: list[str], public_tls=None) -> int:
    """Start the services one after the other, then the coordinator; serve until a signal or
    a child's exit; stop them all. 1 when a child failed. public_tls: the coordinator's
    security.ServerTls, if it serves over TLS."""
    children = []
    stopping = []
    started = True
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        # one after the other: on CPU each times its linear kernels at start-up, and two
        # doing so at once on a small machine would time each other
        for cmd, port, name in services:
            children.append(subprocess.Popen(cmd))
            processes.wait_healthy(f"127.0.0.1:{port}", name, args.startup_timeout, children)
        children.append(subprocess.Popen(coordinator_cmd))
        if public_tls:  # its certificate's CA is not known here: wait for its port
            processes.wait_listening(f"127.0.0.1:{args.port}", args.startup_timeout, children)
        else:
            processes.wait_healthy(f"127.0.0.1:{args.port}", "batchspec.v1.Coordinator",
                                   args.startup_timeout, children)
        scheme = "https" if public_tls else "http"
        log.info("batchspec is serving gRPC%s on 127.0.0.1:%d%s; try: batchspec generate "
                 "--address 127.0.0.1:%d%s \"Hello\"", " (TLS)" if public_tls else "",
                 args.port,
                 f" and HTTP on {scheme}://127.0.0.1:{args.http_port}/" if args.http_port
                 else "", args.port, " --tls-ca CA.pem" if public_tls else "")
        if args.metrics_port:
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", args.metrics_port)
        while not stopping and all(c.poll() is None for c in children):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as error:  # a service died or never became healthy
        log.error("%s; stopping (its log is above)", error)
        started = False
    finally:
        processes.stop_children(children)
    failed = [c for c in children if c.returncode not in (0, -signal.SIGTERM, -signal.SIGINT)]
    return 0 if started and not failed else 1


def draft_command(args, name: str, port: int) -> list[str]:
    """The command line of one draft service of `batchspec serve`. A draft of another
    vocabulary than the target's is served as a draft of the target's tokens
    (--target-tokenizer)."""
    cmd = [sys.executable, "-m", "draft_service", "--port", str(port)]
    model, layers = pick_draft(args.target_model, None if name == "auto" else name,
                               args.draft_layers)
    from batchspec.runtime import models

    cmd += ["--model", model, "--device", args.draft_device or args.device,
            "--dtype", models.draft_service_dtype(args.dtype, args.draft_dtype)]
    cmd += models.translation_flags(model, args.target_model, args.tokenizer)
    return cmd + (["--num-layers", str(layers)] if layers else [])


def pick_draft(target: str, draft: str | None, layers: int | None):
    """(draft model, layers to keep): `draft` as given, else the best draft shipped for the
    target (models.BEST_SHIPPED), else the target's first layers."""
    from batchspec.runtime import models

    if draft is not None:
        return draft, layers
    shipped = models.best_shipped_draft(target)
    if shipped is not None and layers is None:
        return shipped, None
    return target, layers or DEFAULT_DRAFT_LAYERS


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", default=None,
                        help="connect over TLS, trusting this CA (PEM); default plaintext")
    parser.add_argument("--client-cert", default=None,
                        help="mutual TLS: the certificate to show (PEM, with --tls-ca)")
    parser.add_argument("--client-key", default=None, help="its private key (PEM)")


def client_credentials(parser: argparse.ArgumentParser, args):
    """Channel credentials from add_client_tls_arguments' flags (None: plaintext); a bad
    combination or a missing file is a usage error."""
    from batchspec import security

    try:
        tls = security.client_tls(args.tls_ca, args.client_cert, args.client_key)
    except ValueError as error:
        parser.error(str(error))
    return tls.credentials() if tls else None


# ---- health -------------------------------------------------------------------------------------
def health(argv) -> int:
    """A container healthcheck over the standard gRPC health protocol."""
    parser = cliargs.parser("batchspec health", health.__doc__)
    parser.add_argument("address", type=cliargs.address, help="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="service name ('' = server)")
    parser.add_argument("--timeout", type=cliargs.positive_seconds, default=3.0,
                        help="seconds to wait for SERVING")
    add_client_tls_arguments(parser)
    args = parser.parse_args(argv)
    try:
        processes.wait_healthy(args.address, args.service, args.timeout,
                               credentials=client_credentials(parser, args))
    except TimeoutError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


# ---- generate -----------------------------------------------------------------------------------
def generate_parser() -> argparse.ArgumentParser:
    from coordinator.config import DEFAULT_PORT

    parser = cliargs.parser("batchspec generate", "Stream an answer to the terminal.")
    parser.add_argument("prompt", nargs="?", default=None,
                        help="what to ask (sent as a chat message when the model has a chat "
                             "template)")
    parser.add_argument("--raw", action="store_true",
                        help="send the prompt as plain text to continue, not as a chat message")
    parser.add_argument("--token-ids", default=None, type=token_ids,
                        help="comma-separated prompt token ids instead of text")
    parser.add_argument("--address", type=cliargs.address, default=f"127.0.0.1:{DEFAULT_PORT}",
                        help="coordinator HOST:PORT")
    parser.add_argument("--max-new-tokens", type=cliargs.bounded(int, 1), default=128,
                        help="most tokens to generate")
    parser.add_argument("--temperature", type=cliargs.bounded(float, 0.0), default=None,
                        help="sampling temperature (default: greedy)")
    parser.add_argument("--top-k", type=cliargs.bounded(int, 0, 2**31), default=None,
                        help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample from the smallest set of tokens holding this much "
                             "probability, in (0, 1]")
    parser.add_argument("--seed", type=cliargs.bounded(int, 0, 2**64), default=None,
                        help="seed for sampling: the same seed gives the same answer")
    parser.add_argument("--presence-penalty", type=float, default=None,
                        help="OpenAI's presence penalty, in [-2, 2] (default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=None,
                        help="OpenAI's frequency penalty, in [-2, 2] (default 0)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=cliargs.positive_seconds, default=None,
                        help="deadline in seconds")
    parser.add_argument("--stats", action="store_true", help="print speculation stats at the end")
    parser.add_argument("--api-key-file", default=None,
                        help="send the API key in this file as 'authorization: Bearer <key>'")
    add_client_tls_arguments(parser)
    return parser


def token_ids(text: str) -> list[int]:
    """An argparse type: comma-separated non-negative token ids."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are comma-separated integers: {text!r}")
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are non-negative integers: {text!r}")
    return ids


def generate(argv) -> int:
    import grpc

    from batchspec import server as server_lib
    from batchspec.v1 import generate_pb2, generate_pb2_grpc

    parser = generate_parser()
    args = parser.parse_args(argv)
    credentials = client_credentials(parser, args)
    metadata = ()
    if args.api_key_file:
        from batchspec import security

        try:
            metadata = (("authorization", f"Bearer {security.read_api_key(args.api_key_file)}"),)
        except ValueError as error:
            parser.error(str(error))
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"argument --top-p: must be in (0, 1], not {args.top_p}")
    for flag in ("presence_penalty", "frequency_penalty"):
        value = getattr(args, flag)
        if value is not None and not abs(value) <= 2:
            parser.error(f"argument --{flag.replace('_', '-')}: must be in [-2, 2], not {value}")
    if (args.prompt is None) == (args.token_ids is None):
        parser.error("give a prompt, or --token-ids (not both)")
    request = generate_pb2.GenerateRequest(max_new_tokens=args.max_new_tokens, stop=args.stop)
    if args.token_ids:
        request.prompt_token_ids.extend(args.token_ids)
    else:
        request.prompt, request.chat = args.prompt, not args.raw
    for field in ("temperature", "top_k", "top_p", "seed", "presence_penalty",
                  "frequency_penalty"):
        if getattr(args, field) is not None:
            setattr(request, field, getattr(args, field))
    with server_lib.open_channel(args.address, credentials) as channel:
        stub = generate_pb2_grpc.CoordinatorStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                if args.token_ids:
                    sys.stdout.write("".join(f"{t} " for t in response.token_ids))
                else:
                    sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    last = response
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                print(f"no batchspec coordinator answers at {args.address}: start one with "
                      "`batchspec serve` (or pass --address HOST:PORT)", file=sys.stderr)
            elif error.code() == grpc.StatusCode.UNAUTHENTICATED:
                print(f"\nerror: {error.details()} (pass the server's key with "
                      "--api-key-file FILE)", file=sys.stderr)
            else:
                print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print()
    if args.stats:
        reason = generate_pb2.FinishReason.Name(last.finish_reason)
        print(f"[{reason}] {last.stats.num_generated_tokens} tokens, "
              f"{last.stats.num_accepted_tokens}/{last.stats.num_drafted_tokens} drafts "
              f"accepted, {last.stats.num_target_forward_passes} target passes",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
