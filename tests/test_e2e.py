"""End to end: `batchspec serve` starts the three real processes, as a user would."""
import shutil
import signal
import subprocess
import sys

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
def test_serve_four_processes_exact_on_32_concurrent_requests(model_dirs, arch):
    """Target, model draft, n-gram draft and coordinator, as `batchspec serve` starts them."""
    target_dir, draft_dir = model_dirs[arch]
    port = free_port()
    server = subprocess.Popen(batchspec_command() + [
        "serve", "--target-model", target_dir, "--draft-model", f"{draft_dir},ngram",
        "--port", str(port),
        "--batch-size", "8", "-k", "4", "--startup-timeout", "120"])
    try:
        wait_healthy(f"127.0.0.1:{port}", "batchspec.v1.Coordinator", 120, [server])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            requests = random_requests(seed=7, count=32)
            results = generate_all(generate_pb2_grpc.CoordinatorStub(channel), requests)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
    assert code == 0


def test_serve_with_http_answers_an_openai_client(model_dirs, tmp_path):
    """`batchspec serve --http-port P`: the official client streams a chat completion with no
    other set-up than the base URL."""
    import openai
    from test_http import make_chat_tokenizer

    target_dir, draft_dir = model_dirs["llama"]
    tokenizer = make_chat_tokenizer(tmp_path)
    port, http_port = free_port(), free_port()
    server = subprocess.Popen(batchspec_command() + [
        "serve", "--target-model", target_dir, "--draft-model", f"{draft_dir},ngram",
        "--tokenizer", tokenizer, "--port", str(port), "--http-port", str(http_port),
        "--startup-timeout", "120"])
    try:
        wait_healthy(f"127.0.0.1:{port}", "batchspec.v1.Coordinator", 120, [server])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused")
        chunks = list(client.chat.completions.create(
            model="batchspec", messages=[{"role": "user", "content": "hello robot"}],
            max_tokens=16, temperature=0, stream=True))
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].usage.completion_tokens >= 1 and code == 0
