import contextlib
import dataclasses
import os
import pathlib
import sys
import time

import grpc
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from batchspec.runtime import service  # noqa: E402
from batchspec.v1 import draft_pb2_grpc, generate_pb2_grpc, target_pb2_grpc  # noqa: E402
from coordinator import __main__ as coordinator_main  # noqa: E402
from coordinator import scheduler  # noqa: E402
from coordinator.config import CoordinatorConfig, EngineConfig  # noqa: E402
from draft_service.servicer import SERVICE_NAME as DRAFT_NAME  # noqa: E402
from draft_service.servicer import DraftServicer
from target_service.servicer import SERVICE_NAME as TARGET_NAME  # noqa: E402
from target_service.servicer import TargetServicer

import tiny_models  # noqa: E402

# The device the services in these tests compute on: the CPU, unless BATCHSPEC_TEST_DEVICE
# names another (`BATCHSPEC_TEST_DEVICE=cuda python3 -m pytest tests/test_exactness.py` checks
# exactness on a GPU; the references then run on that device too).
TEST_DEVICE = os.environ.get("BATCHSPEC_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """{arch: (target_dir, draft_dir)} for the tiny Llama-style and GPT-2-style pairs."""
    root = tmp_path_factory.mktemp("models")
    return {arch: tiny_models.save_pair(arch, root) for arch in tiny_models.BUILDERS}


@dataclasses.dataclass
class Stack:
    target_port: int
    draft_port: int
    port: int
    router: object  # coordinator.router.Router
    target_runner: object
    draft_runner: object
    target_server: object
    draft_server: object
    metrics_port: int | None
    drafts: list = dataclasses.field(default_factory=list)  # (server, port, runner) per draft
    http_port: int | None = None

    def stub(self):
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        return generate_pb2_grpc.CoordinatorStub(channel)


def start_target(model_dir, port=0, dtype="float32"):
    return service.start_model_service(service.ServiceConfig(model=model_dir, port=port,
                                                             device=TEST_DEVICE, dtype=dtype),
                                       TargetServicer,
                                       target_pb2_grpc.add_TargetServiceServicer_to_server,
                                       TARGET_NAME)


def start_hosting_target(model_dir, draft_dir, port=0, dtype="float32",
                         draft_dtype="float32"):
    """A target that hosts a draft, as `python -m target_service --model M --draft-model D`:
    (server, port, target runner, draft runner)."""
    from target_service.__main__ import host_draft

    config = service.ServiceConfig(model=model_dir, port=port, device=TEST_DEVICE, dtype=dtype,
                                   draft=service.ServiceConfig(model=draft_dir,
                                                               device=TEST_DEVICE,
                                                               dtype=draft_dtype))
    servicers = []

    def make_servicer(*args, **kwargs):
        servicers.append(TargetServicer(*args, **kwargs))
        return servicers[-1]

    server, port, _, runner = service.start_model_service(
        config, make_servicer, target_pb2_grpc.add_TargetServiceServicer_to_server,
        TARGET_NAME, host=host_draft)
    return server, port, runner, servicers[0].hosted_draft.runner


def start_draft(model_dir, port=0, dtype="float32"):
    return service.start_model_service(service.ServiceConfig(model=model_dir, port=port,
                                                             device=TEST_DEVICE, dtype=dtype),
                                       DraftServicer,
                                       draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                       DRAFT_NAME)


def start_translating(model_dir, target_tokenizer, port=0):
    """A draft of another tokenizer than the target's, proposing the target's tokens, as
    `python -m draft_service --model DIR --target-tokenizer T`."""
    from draft_service.__main__ import hosting

    config = service.ServiceConfig(model=model_dir, port=port, device=TEST_DEVICE,
                                   target_tokenizer=target_tokenizer)
    make_servicer, build, warm = hosting(config)
    return service.start_model_service(config, make_servicer,
                                       draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                       DRAFT_NAME, build=build, warm=warm)


def start_ngram(port=0):
    """The model-free n-gram draft service, as `python -m draft_service --model ngram`."""
    from draft_service.__main__ import hosting

    config = service.ServiceConfig(model="ngram", port=port)
    make_servicer, build, warm = hosting(config)
    return service.start_model_service(config, make_servicer,
                                       draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                       DRAFT_NAME, build=build, warm=warm)


def wait_for(predicate, timeout=10.0):
    """Poll until predicate() is true; False if it never was within timeout seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def running_stack(target_dir, draft_dir, *, batch_size=8, num_draft_tokens=4, metrics_port=None,
                  stall_timeout_s=120.0, drafts=("model",), tokenizer=None, http_port=None,
                  api_key_file=None, draft_dtype="float32", target_dtype="float32",
                  target_tokenizer=None, step_log=None, **engine_kwargs):
    """Target, drafts and coordinator servers in this process, on free loopback ports.
    drafts: the draft services, in order: "model" (the draft_dir model, in draft_dtype),
    "ngram", "local:ngram" (the n-gram draft in the coordinator's process: no service),
    "translating" (the draft_dir model of another tokenizer than the target's, whose
    tokenizer.json is target_tokenizer), or "hosted" (the draft_dir model hosted by the target
    service: the target's address). The Stack's draft fields are the first service's, or the
    hosted draft's."""
    if "hosted" in drafts:
        target_server, target_port, target_runner, hosted_runner = start_hosting_target(
            target_dir, draft_dir, dtype=target_dtype, draft_dtype=draft_dtype)
    else:
        target_server, target_port, _, target_runner = start_target(target_dir,
                                                                    dtype=target_dtype)
    started = [start_ngram() if kind == "ngram"
               else start_translating(draft_dir, target_tokenizer) if kind == "translating"
               else start_draft(draft_dir, dtype=draft_dtype) for kind in drafts
               if kind not in ("local:ngram", "hosted")]
    addresses = iter(f"127.0.0.1:{port}" for _, port, _, _ in started)
    draft_addresses = tuple(kind if kind == "local:ngram" else f"127.0.0.1:{target_port}"
                            if kind == "hosted" else next(addresses) for kind in drafts)
    draft_server, draft_port, _, draft_runner = started[0] if started else (None,) * 4
    if "hosted" in drafts:
        draft_server, draft_port, draft_runner = target_server, target_port, hosted_runner
    # fixed K unless a test asks for adaptive draft length: tiny drafts are rarely confident
    engine_kwargs.setdefault("min_draft_confidence", 0.0)
    # every step drafts K unless a test asks for the goodput policy: these tests check the
    # mechanics of drafting, which the policy could turn off for tiny models
    engine_kwargs.setdefault("draft_policy", "fixed")
    # the pipeline (drafting the next cohort while the target verifies) on, though the tiny
    # services share a CPU: every test through the services exercises it
    engine_kwargs.setdefault("overlap", "on")
    engine_config = EngineConfig(num_draft_tokens=num_draft_tokens,
                                 cohort_policy=scheduler.CohortPolicy(batch_size=batch_size),
                                 reconnect_backoff_s=(0.05, 0.5), **engine_kwargs)
    config = CoordinatorConfig(
        targets=(f"127.0.0.1:{target_port}",),
        drafts=draft_addresses, port=0,
        engine=engine_config, connect_timeout_s=10, metrics_port=metrics_port,
        stall_timeout_s=stall_timeout_s, tokenizer=tokenizer, http_port=http_port,
        api_key_file=api_key_file, step_log=step_log)
    running = coordinator_main.start(config)
    try:
        yield Stack(target_port, draft_port, running.port, running.router, target_runner,
                    draft_runner, target_server, draft_server, running.metrics_port,
                    [(server, port, runner) for server, port, _, runner in started],
                    running.http_port)
    finally:
        running.stop(0)
        target_server.stop(0)
        for server, _, _, _ in started:
            server.stop(0)
