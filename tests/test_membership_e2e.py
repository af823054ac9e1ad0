"""Replicas that come and go while the coordinator serves, with real service processes on
loopback: added through file: and dns: sources, drained on SIGTERM, killed; restarted one at a
time under load; two coordinators sharing services that enforce their capacity. Every request
completes with the target's own greedy output, and no cache is left behind."""
import concurrent.futures
import contextlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from transformers import AutoModelForCausalLM

from batchspec import errors
from batchspec.v1 import generate_pb2, generate_pb2_grpc
from batchspec_tools.processes import free_port, wait_healthy
from coordinator import __main__ as coordinator_main
from coordinator import scheduler
from coordinator.clients import DraftClient, TargetClient
from coordinator.config import CoordinatorConfig, EngineConfig

import tiny_models
from conftest import start_target, wait_for

pytestmark = pytest.mark.slow  # every test here starts processes

TARGET, DRAFT = "batchspec.v1.TargetService", "batchspec.v1.DraftService"
MAX_NEW = 24


def start_service(role, model, host, port, log_dir, *flags):
    """`python -m target_service|draft_service`, as a deployment starts it."""
    log = open(log_dir / f"{role}-{host}-{port}.log", "a")
    return subprocess.Popen([sys.executable, "-m", f"{role}_service", "--model", model,
                             "--host", host, "--port", str(port), "--grace", "60", *flags],
                            stdout=log, stderr=subprocess.STDOUT)


def wait_all(children):
    for child, address, name in children:
        wait_healthy(address, name, 120, [child])


def held(client_type, address) -> int:
    """Sequences the service at `address` caches now (-1 when it does not answer)."""
    client = client_type(address)
    try:
        return client.describe(timeout=2).num_sequences
    except errors.Unavailable:
        return -1
    finally:
        client.close()


def prompt_of(i):
    return [4 + (5 * i + j) % 90 for j in range(2 + i % 7)]


class Load:
    """Closed-loop clients: each sends its next request as soon as its last one ends, until
    stopped; every answer (or error) is kept."""

    def __init__(self, ports, clients):
        self.stop = threading.Event()
        self.results = []  # (prompt, tokens or the error)
        self.by_port = {port: 0 for port in ports}  # answers each coordinator gave
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(clients)
        self._futures = [self._pool.submit(self._client, ports[c % len(ports)], c)
                         for c in range(clients)]

    def _client(self, port, c):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.CoordinatorStub(channel)
            i = c
            while not self.stop.is_set():
                prompt = prompt_of(i)
                try:
                    answer = [t for r in stub.Generate(generate_pb2.GenerateRequest(
                        prompt_token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True),
                        timeout=120) for t in r.token_ids]
                except grpc.RpcError as error:
                    answer = f"{error.code().name}: {error.details()}"
                with self._lock:
                    self.results.append((prompt, answer))
                    self.by_port[port] += not isinstance(answer, str)
                i += 7

    def count(self):
        with self._lock:
            return len(self.results)

    def finish(self):
        self.stop.set()
        for future in self._futures:
            future.result(timeout=180)
        self._pool.shutdown()
        return self.results


def assert_exact(model, results):
    failed = [answer for _, answer in results if isinstance(answer, str)]
    assert not failed, failed[:3]
    reference = {}
    for prompt, tokens in results:
        key = tuple(prompt)
        if key not in reference:
            reference[key] = tiny_models.reference_greedy(model, prompt, MAX_NEW,
                                                          ignore_eos=True)
        assert tokens == reference[key]


def coordinator_config(targets, drafts, **engine):
    return CoordinatorConfig(
        targets=tuple(targets), drafts=tuple(drafts), port=0, connect_timeout_s=60,
        membership_interval_s=0.3, engine=EngineConfig(
            num_draft_tokens=3, draft_policy="fixed", min_draft_confidence=0.0,
            cohort_policy=scheduler.CohortPolicy(batch_size=4),
            reconnect_backoff_s=(0.05, 0.5), **engine))


@contextlib.contextmanager
def processes():
    children = []
    try:
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_replicas_join_drain_and_die_under_load(model_dirs, tmp_path):
    """One target and one draft; under load a second target joins through a file and a
    second draft through DNS; the first target drains on SIGTERM and leaves the file; the
    second draft is killed -9. Nothing fails, every output is exact, no cache is left."""
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    targets_file = tmp_path / "targets"
    draft_port = free_port()
    ips = ["127.0.0.2"]  # what the test's DNS answers for drafts.test
    target_a, target_b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    draft_1, draft_2 = f"127.0.0.2:{draft_port}", f"127.0.0.3:{draft_port}"
    with processes() as children:
        for role, model_dir, address, name in (("target", target_dir, target_a, TARGET),
                                               ("target", target_dir, target_b, TARGET),
                                               ("draft", draft_dir, draft_1, DRAFT),
                                               ("draft", draft_dir, draft_2, DRAFT)):
            host, port = address.split(":")
            children.append(start_service(role, model_dir, host, port, tmp_path))
        wait_all(zip(children, [target_a, target_b, draft_1, draft_2],
                     [TARGET, TARGET, DRAFT, DRAFT]))
        proc_a, _, _, proc_d2 = children
        targets_file.write_text(f"{target_a}\n")
        running = coordinator_main.start(
            coordinator_config([f"file:{targets_file}"], [f"dns:drafts.test:{draft_port}"]),
            resolve=lambda name: list(ips) if name == "drafts.test" else [])
        try:
            load = Load([running.port], clients=6)
            assert wait_for(lambda: load.count() >= 6, timeout=60)
            assert held(TargetClient, target_b) == 0

            # a second target (file:) and a second draft (dns:) join
            targets_file.write_text(f"{target_a}\n{target_b}\n")
            ips.append("127.0.0.3")
            joined = time.monotonic()
            assert wait_for(lambda: held(TargetClient, target_b) > 0, timeout=5)
            assert time.monotonic() - joined < 5
            assert wait_for(lambda: held(DraftClient, draft_2) > 0, timeout=10)

            # the first target drains: its sequences move, then it exits on its own
            served = load.count()
            proc_a.send_signal(signal.SIGTERM)
            targets_file.write_text(f"{target_b}\n")
            proc_a.wait(timeout=30)  # well inside its 60 s grace: nothing was left there
            assert proc_a.returncode == 0
            assert wait_for(lambda: load.count() > served + 6, timeout=60)

            # the second draft dies without a word
            served = load.count()
            proc_d2.kill()
            proc_d2.wait()
            assert wait_for(lambda: load.count() > served + 12, timeout=60)
            results = load.finish()
            assert len(running.router.engines) == 1  # the first target's engine ended
            stats = running.router.stats
            assert stats.num_steps > stats.num_draft_fallback_steps  # drafts were used
        finally:
            running.stop(0)
        assert wait_for(lambda: held(TargetClient, target_b) == 0
                        and held(DraftClient, draft_1) == 0)
    assert_exact(model, results)
    assert len(results) > 30


def test_rolling_restart_with_two_coordinators_and_capacity(model_dirs, tmp_path):
    """Two targets that take at most 5 sequences each, an n-gram draft, and two coordinators
    sharing them under 16 closed-loop clients; each target in turn is drained (SIGTERM) and
    started again at its address. Nothing fails, every output is exact, the coordinators'
    sequences never collide, and capacity refusals were met and waited out."""
    target_dir, _ = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    ngram = f"127.0.0.1:{free_port()}"
    capacity = ("--max-sequences", "5")
    with processes() as children:
        for address in addresses:
            children.append(start_service("target", target_dir, *address.split(":"), tmp_path,
                                          *capacity))
        children.append(start_service("draft", "ngram", *ngram.split(":"), tmp_path))
        wait_all(zip(children, addresses + [ngram], [TARGET, TARGET, DRAFT]))
        config = coordinator_config(addresses, [ngram], max_num_seqs=8)
        coordinators = [coordinator_main.start(config) for _ in range(2)]
        try:
            load = Load([c.port for c in coordinators], clients=16)
            assert wait_for(lambda: load.count() >= 16, timeout=60)
            for i, address in enumerate(addresses):
                served = load.count()
                children[i].send_signal(signal.SIGTERM)
                children[i].wait(timeout=45)
                assert children[i].returncode == 0
                children[i] = start_service("target", target_dir, *address.split(":"),
                                            tmp_path, *capacity)
                wait_healthy(address, TARGET, 120, [children[i]])
                assert wait_for(lambda: load.count() > served + 16, timeout=60)
                # the restarted instance takes sequences again
                assert wait_for(lambda: held(TargetClient, address) > 0, timeout=30)
            results = load.finish()
            full = sum(c.router.stats.num_capacity_waits for c in coordinators)
            served = list(load.by_port.values())
        finally:
            for c in coordinators:
                c.stop(0)
        assert all(n > 0 for n in served)  # both coordinators served
        assert full > 0  # 16 clients over 2 x 5 places: refusals were met, and waited out
        assert wait_for(lambda: all(held(TargetClient, a) == 0 for a in addresses))
    assert_exact(model, results)


def test_a_stream_for_a_lost_instance_is_refused(model_dirs):
    """A service restarted at the same address is another instance: a command stream opened
    for the old one is refused, so caches it lost are never trusted."""
    target_dir, _ = model_dirs["llama"]
    server, port, _, runner = start_target(target_dir)
    try:
        client = TargetClient(f"127.0.0.1:{port}")
        info = client.describe()
        assert info.instance_id and not info.draining
        client.instance = "an-instance-that-is-gone"
        with pytest.raises(errors.Unavailable, match="FAILED_PRECONDITION"):
            client.prefill([(1, [4, 5, 6])])
        client.reset()
        client.instance = info.instance_id
        assert client.prefill([(1, [4, 5, 6])]) == [3]
        client.release([1])
        client.close()
    finally:
        server.stop(0)
