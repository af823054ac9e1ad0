"""End to end: `batchspec serve` starts the three real processes, as a user would."""
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from transformers import AutoModelForCausalLM

from batchspec.v1 import generate_pb2_grpc
from batchspec_tools.processes import free_port, wait_healthy

import tiny_models
from test_exactness import generate_all, random_requests

pytestmark = pytest.mark.slow  # every test here starts processes


def batchspec_command() -> list[str]:
    installed = shutil.which("batchspec")
    return [installed] if installed else [sys.executable, "-m", "batchspec_tools"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_serve_three_processes_exact_on_32_concurrent_requests(model_dirs, arch, tmp_path):
    """Target, model draft and coordinator (running the n-gram draft itself), as `batchspec
    serve` starts them.
    With llama, `serve` also takes --tls-cert/--tls-key, an API key and --http-port: gRPC
    over TLS with the key, `batchspec health` against it (refused without the CA), and the
    official `openai` client streaming a chat completion over HTTPS (a wrong key: 401)."""
    import openai
    from test_http import make_chat_tokenizer
    from test_serving import make_certificates

    target_dir, draft_dir = model_dirs[arch]
    port, http_port = free_port(), free_port()
    tls = arch == "llama"
    flags = []
    if tls:
        certs = make_certificates(tmp_path)
        ca = certs["ca"] + ".pem"
        (tmp_path / "api-key").write_text("s3cret\n")
        flags = ["--tls-cert", certs["server"] + ".pem", "--tls-key", certs["server"] + ".key",
                 "--api-key-file", str(tmp_path / "api-key"), "--http-port", str(http_port),
                 "--tokenizer", make_chat_tokenizer(tmp_path)]
    server = subprocess.Popen(batchspec_command() + [
        "serve", "--target-model", target_dir, "--draft-model", f"{draft_dir},ngram",
        "--port", str(port), "--batch-size", "8", "-k", "4", "--startup-timeout", "120"]
        + flags)
    address = f"127.0.0.1:{port}"
    try:
        if tls:
            end = time.monotonic() + 120
            while run_cli("health", address, "batchspec.v1.Coordinator",
                          "--tls-ca", ca).returncode != 0:
                assert server.poll() is None and time.monotonic() < end
                time.sleep(0.5)
            assert run_cli("health", address, "batchspec.v1.Coordinator").returncode != 0
            channel = grpc.secure_channel(address, grpc.composite_channel_credentials(
                grpc.ssl_channel_credentials(pathlib.Path(ca).read_bytes()),
                grpc.access_token_call_credentials("s3cret")))
        else:
            wait_healthy(address, "batchspec.v1.Coordinator", 120, [server])
            channel = grpc.insecure_channel(address)
        with channel:
            requests = random_requests(seed=7, count=32)
            results = generate_all(generate_pb2_grpc.CoordinatorStub(channel), requests)
        if tls:
            client = https_client(f"https://127.0.0.1:{http_port}/v1", ca, "s3cret")
            chunks = list(client.chat.completions.create(
                model="batchspec", messages=[{"role": "user", "content": "hello robot"}],
                max_tokens=16, temperature=0, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].usage.completion_tokens >= 1
            [listed] = client.models.list().data  # both drafts serve, the lookup in process
            assert "ngram" in listed.model_extra["batchspec"]["drafts"]
            with pytest.raises(openai.AuthenticationError):
                https_client(f"https://127.0.0.1:{http_port}/v1", ca, "wrong").models.list()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
    assert code == 0


def https_client(base_url, ca, api_key):
    """The official OpenAI client over HTTPS, trusting `ca`."""
    import ssl

    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=ca)))


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(batchspec_command() + list(args), capture_output=True, text=True,
                          timeout=60)


def test_tls_wiring_through_the_real_cli(model_dirs, tmp_path):
    """As compose.tls.yaml runs them: target and draft with --tls-cert/--tls-key/--tls-ca
    (mutual TLS), the coordinator showing its own --tls-cert to them as client certificate,
    `batchspec health` against each TLS server as the healthchecks run it, `batchspec
    generate` over TLS with the API key, and HTTPS on the HTTP edge with the openai client."""
    from test_http import make_chat_tokenizer
    from test_serving import make_certificates

    target_dir, draft_dir = model_dirs["llama"]
    certs = {k: v for k, v in make_certificates(tmp_path).items()}
    ca, cert, key = certs["ca"] + ".pem", certs["server"] + ".pem", certs["server"] + ".key"
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
    (tmp_path / "api-key").write_text("s3cret\n")
    tokenizer = make_chat_tokenizer(tmp_path)
    ports = {name: free_port() for name in ("target", "draft", "coordinator", "http")}
    children = [subprocess.Popen(batchspec_command() + [
        role, "--model", model, "--port", str(ports[role])] + tls)
        for role, model in (("target", target_dir), ("draft", draft_dir))]
    try:
        client_cert = ["--client-cert", cert, "--client-key", key]
        for role, service in (("target", "TargetService"), ("draft", "DraftService")):
            address, name = f"127.0.0.1:{ports[role]}", f"batchspec.v1.{service}"
            end = time.monotonic() + 120
            while run_cli("health", address, name, "--tls-ca", ca, *client_cert).returncode:
                assert all(c.poll() is None for c in children) and time.monotonic() < end
                time.sleep(0.5)
            # mutual TLS: without a client certificate the service lets nobody in
            assert run_cli("health", address, name, "--tls-ca", ca).returncode != 0
        children.append(subprocess.Popen(batchspec_command() + [
            "coordinator", "--target", f"127.0.0.1:{ports['target']}",
            "--draft", f"127.0.0.1:{ports['draft']}", "--port", str(ports["coordinator"]),
            "--http-port", str(ports["http"]), "--tokenizer", tokenizer,
            "--api-key-file", str(tmp_path / "api-key")] + tls))
        address = f"127.0.0.1:{ports['coordinator']}"
        end = time.monotonic() + 120
        while run_cli("health", address, "batchspec.v1.Coordinator", "--tls-ca", ca).returncode:
            assert children[-1].poll() is None and time.monotonic() < end
            time.sleep(0.5)
        answer = run_cli("generate", "--address", address, "--tls-ca", ca, "--api-key-file",
                         str(tmp_path / "api-key"), "--max-new-tokens", "8", "hello robot")
        assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
        refused = run_cli("generate", "--address", address, "--tls-ca", ca,
                          "--max-new-tokens", "8", "hello robot")
        assert refused.returncode != 0 and "--api-key-file FILE" in refused.stderr
        client = https_client(f"https://127.0.0.1:{ports['http']}/v1", ca, "s3cret")
        reply = client.chat.completions.create(
            model="batchspec", messages=[{"role": "user", "content": "hello robot"}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    finally:
        for child in reversed(children):
            child.send_signal(signal.SIGTERM)
        codes = [child.wait(timeout=60) for child in children]
    assert codes == [0, 0, 0]
