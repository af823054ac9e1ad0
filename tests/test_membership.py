"""Live membership: replica sources (dns:, file:, k8s:), service instances, draining and
capacity, units first; the loopback tests with real service processes are in
test_membership_e2e.py."""
import json
import threading
import urllib.parse

import grpc
import pytest

from batchspec import errors
from batchspec.cachebook import CacheBook
from batchspec.runtime import service, wire
from coordinator import membership
from coordinator.config import CoordinatorConfig
from coordinator.fleet import sequence_ids

from conftest import wait_for


def test_sources_parse_and_refuse_malformed_specs():
    assert isinstance(membership.parse_source("10.0.0.1:50052"), membership.Static)
    dns = membership.parse_source("dns:targets.internal:50052")
    assert (dns.name, dns.port) == ("targets.internal", 50052)
    assert membership.parse_source("file:/etc/batchspec/targets").path == "/etc/batchspec/targets"
    k8s = membership.parse_source("k8s:serving/batchspec-target:50052")
    assert (k8s.namespace, k8s.service, k8s.port) == ("serving", "batchspec-target", 50052)
    assert membership.parse_source("local:ngram").addresses() == {"local:ngram"}
    for bad in ("dns:nameonly", "k8s:noslash:1", "k8s:ns/svc:port", "file:", "hostonly",
                "host:99999", "local:smollm2"):
        with pytest.raises(ValueError):
            membership.parse_source(bad)
    with pytest.raises(ValueError):  # the config refuses them at start, with the flag's error
        CoordinatorConfig(targets=("dns:nameonly",))
    with pytest.raises(ValueError, match="a target is a service"):
        CoordinatorConfig(targets=("local:ngram",))
    assert CoordinatorConfig(targets=("h:1",), drafts=("local:ngram",)).drafts == ("local:ngram",)


def test_a_file_source_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "targets"
    path.write_text("# replicas\n127.0.0.1:5001\n\n127.0.0.1:5002  # the second\n")
    source = membership.parse_source(f"file:{path}")
    assert source.addresses() == {"127.0.0.1:5001", "127.0.0.1:5002"}
    path.write_text("127.0.0.1:5002\n127.0.0.1:5003\n")
    assert source.addresses() == {"127.0.0.1:5002", "127.0.0.1:5003"}
    path.write_text("not an address\n")  # a bad rewrite keeps the last good answer
    assert source.addresses() == {"127.0.0.1:5002", "127.0.0.1:5003"}
    path.unlink()
    assert source.addresses() == {"127.0.0.1:5002", "127.0.0.1:5003"}


def test_a_dns_source_keeps_its_last_answer_when_resolution_fails():
    answers = {"drafts.test": ["127.0.0.2"]}

    def resolve(name):
        if name not in answers:
            raise OSError("temporary failure in name resolution")
        return answers[name]

    source = membership.parse_source("dns:drafts.test:7000", resolve)
    assert source.addresses() == {"127.0.0.2:7000"}
    answers["drafts.test"] = ["127.0.0.2", "127.0.0.3", "::1"]
    assert source.addresses() == {"127.0.0.2:7000", "127.0.0.3:7000", "[::1]:7000"}
    del answers["drafts.test"]
    assert source.addresses() == {"127.0.0.2:7000", "127.0.0.3:7000", "[::1]:7000"}


def endpoint_slice(name, endpoints, version="1"):
    """An EndpointSlice as the API sends it in a watch event (discovery.k8s.io/v1)."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "serving", "resourceVersion": version,
                         "labels": {"kubernetes.io/service-name": "batchspec-target"}},
            "ports": [{"name": "grpc", "port": 50052, "protocol": "TCP"}],
            "endpoints": endpoints}


def endpoint(ip, ready=True, terminating=False, serving=None):
    conditions = {"ready": ready, "terminating": terminating}
    if serving is not None:
        conditions["serving"] = serving
    return {"addresses": [ip] if ip else [], "conditions": conditions,
            "targetRef": {"kind": "Pod", "name": f"target-{ip}"}}


def test_the_k8s_source_follows_recorded_endpointslice_events():
    """Ready endpoints are replicas; not ready, terminating (still serving while it drains)
    and address-less ones are not; a deleted slice takes its endpoints with it."""
    source = membership.K8sSource("serving", "batchspec-target", 50052)
    source._thread = object()  # no API server here: feed the watch by hand
    events = [
        ("ADDED", endpoint_slice("target-abc", [endpoint("10.1.0.4"),
                                                endpoint("10.1.0.5", ready=False),
                                                endpoint(None)]),
         {"10.1.0.4:50052"}),
        ("MODIFIED", endpoint_slice("target-abc", [endpoint("10.1.0.4"), endpoint("10.1.0.5"),
                                                   endpoint("10.1.0.6")], "2"),
         {"10.1.0.4:50052", "10.1.0.5:50052", "10.1.0.6:50052"}),
        ("ADDED", endpoint_slice("target-def", [endpoint("10.1.1.7")]),
         {"10.1.0.4:50052", "10.1.0.5:50052", "10.1.0.6:50052", "10.1.1.7:50052"}),
        ("MODIFIED", endpoint_slice("target-abc", [
            endpoint("10.1.0.4", ready=False, terminating=True, serving=True),
            endpoint("10.1.0.5"), endpoint("10.1.0.6", ready=False)], "3"),
         {"10.1.0.5:50052", "10.1.1.7:50052"}),
        ("BOOKMARK", {"metadata": {"resourceVersion": "4"}},
         {"10.1.0.5:50052", "10.1.1.7:50052"}),
        ("DELETED", endpoint_slice("target-def", [endpoint("10.1.1.7")], "5"),
         {"10.1.0.5:50052"}),
    ]
    for kind, obj, expected in events:
        source.apply({"type": kind, "object": obj})
        assert source.addresses() == expected, kind


class FakeFleet:
    """What Membership changes: sets of addresses, and the calls it made."""

    def __init__(self, targets=(), drafts=()):
        self.targets, self.drafts, self.calls = set(targets), set(drafts), []

    def target_addresses(self):
        return set(self.targets)

    def draft_addresses(self):
        return set(self.drafts)

    def add_target(self, address, tls_name=None):
        self.calls.append(("add_target", address))
        self.targets.add(address)

    def remove_target(self, address):
        self.calls.append(("remove_target", address))
        self.targets.discard(address)

    def add_draft(self, address, tls_name=None):
        self.calls.append(("add_draft", address))
        if address != "127.0.0.9:1":  # one that does not answer yet: asked again next time
            self.drafts.add(address)

    def remove_draft(self, address):
        self.calls.append(("remove_draft", address))
        self.drafts.discard(address)


def test_membership_applies_what_appeared_and_what_left(tmp_path):
    path = tmp_path / "targets"
    path.write_text("127.0.0.1:1\n")
    ips = ["127.0.0.2"]
    fleet = FakeFleet({"127.0.0.1:1"}, {"127.0.0.2:1"})
    members = membership.Membership(fleet, [membership.parse_source(f"file:{path}")],
                                    [membership.parse_source("dns:d.test:1", lambda _: ips)])
    members.refresh()
    assert fleet.calls == []
    path.write_text("127.0.0.1:2\n127.0.0.1:1\n")
    ips[:] = ["127.0.0.3", "127.0.0.9"]
    members.refresh()
    assert fleet.calls == [("add_target", "127.0.0.1:2"), ("add_draft", "127.0.0.3:1"),
                           ("add_draft", "127.0.0.9:1"), ("remove_draft", "127.0.0.2:1")]
    fleet.calls.clear()
    path.write_text("127.0.0.1:2\n")
    members.refresh()
    assert fleet.calls == [("remove_target", "127.0.0.1:1"), ("add_draft", "127.0.0.9:1")]


class Book(CacheBook):
    def __init__(self):
        super().__init__(name="m", vocab_size=10, eos_token_ids=[1], max_context_len=100)


def test_the_gate_refuses_new_sequences_when_draining_or_full():
    book = Book()
    gate = service.Gate(max_sequences=2, max_cached_tokens=10)
    gate.admit(book, [(1, [2, 3, 4])])
    book.caches = {1: type("Entry", (), {"length": 3})()}
    with pytest.raises(errors.ResourceExhausted):
        gate.admit(book, [(2, [2]), (3, [2])])  # 3 sequences > 2
    with pytest.raises(errors.ResourceExhausted):
        gate.admit(book, [(2, [2] * 8)])  # 11 positions > 10
    gate.admit(book, [(2, [2] * 7)])
    gate.draining.set()
    with pytest.raises(errors.Draining) as refused:
        gate.admit(book, [(2, [2])])
    # the wire keeps what it is: UNAVAILABLE, reason DRAINING, rebuilt as Draining
    sent = wire.error(refused.value)
    rebuilt = errors.from_status_code(sent.code, sent.message, sent.reason)
    assert sent.reason == "DRAINING" and type(rebuilt) is errors.Draining
    assert isinstance(rebuilt, errors.Unavailable)
    assert type(errors.from_status_code(sent.code, sent.message)) is errors.Unavailable


def test_sequence_ids_of_two_coordinators_do_not_collide():
    first, second = sequence_ids(), sequence_ids()
    a, b = [next(first) for _ in range(1000)], [next(second) for _ in range(1000)]
    assert not set(a) & set(b) and a == sorted(a) and a[1] - a[0] == 1
    assert all(0 < i < 2**63 for i in a + b)  # uint64 on the wire, positive


class FakeApiServer:
    """The two EndpointSlice calls of the Kubernetes API the k8s: source makes, over HTTP:
    a list, then a watch that streams the events the test puts in `events` (None ends the
    stream, as the API server ends a watch after its timeout)."""

    def __init__(self, items):
        import http.server
        import queue

        self.items, self.events, self.paths = items, queue.Queue(), []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 (http.server's name)
                fake.paths.append(self.path)
                watching = "watch=true" in self.path.lower()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if not watching:
                    body = json.dumps({"kind": "EndpointSliceList",
                                       "apiVersion": "discovery.k8s.io/v1",
                                       "metadata": {"resourceVersion": "10"},
                                       "items": fake.items}).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while (event := fake.events.get()) is not None:
                    line = (json.dumps(event) + "\n").encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path):
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {
                "server": f"http://127.0.0.1:{self.server.server_port}"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            "users": [{"name": "test", "user": {"token": "unused"}}]}))
        return str(path)


def test_the_k8s_source_lists_then_watches_through_the_kubernetes_client(tmp_path,
                                                                           monkeypatch):
    """The real `kubernetes` client against a fake API server: the source lists the
    Service's EndpointSlices by label, then follows the watch from the list's version."""
    api = FakeApiServer([endpoint_slice("target-abc", [endpoint("10.1.0.4")])])
    monkeypatch.setenv("KUBECONFIG", api.kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    source = membership.parse_source("k8s:serving/batchspec-target:50052")
    try:
        source.addresses()  # starts the watch
        assert wait_for(lambda: source.addresses() == {"10.1.0.4:50052"})
        api.events.put({"type": "MODIFIED", "object": endpoint_slice(
            "target-abc", [endpoint("10.1.0.4", ready=False, terminating=True),
                           endpoint("10.1.0.5")], "11")})
        assert wait_for(lambda: source.addresses() == {"10.1.0.5:50052"})
        (list_path, listed), (_, watched) = [(urllib.parse.urlsplit(p).path,
                                               urllib.parse.parse_qs(urllib.parse.urlsplit(p).query))
                                              for p in api.paths[:2]]
        assert list_path == "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices"
        assert listed["labelSelector"] == ["kubernetes.io/service-name=batchspec-target"]
        assert watched["resourceVersion"] == ["10"] and watched["watch"][0].lower() == "true"
    finally:
        api.events.put(None)
        api.server.shutdown()


def test_replicas_found_by_dns_are_checked_against_the_name_over_tls(model_dirs, tmp_path):
    """Over mutual TLS a replica found by dns:NAME is dialled by IP and its certificate is
    checked against NAME: a certificate naming only NAME is accepted that way, and the same
    service named by its IP is refused (its certificate does not name the IP)."""
    from test_serving import make_certificates

    from batchspec import security
    from batchspec.v1 import generate_pb2, generate_pb2_grpc, target_pb2_grpc
    from coordinator import __main__ as coordinator_main
    from target_service.servicer import SERVICE_NAME, TargetServicer

    certs = make_certificates(tmp_path, server_names=("targets.test",))
    server_tls = security.ServerTls(certs["server"] + ".pem", certs["server"] + ".key",
                                    client_ca=certs["ca"] + ".pem")
    server, port, _, _ = service.start_model_service(
        service.ServiceConfig(model=model_dirs["llama"][0], tls=server_tls), TargetServicer,
        target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME)
    peer = security.ClientTls(certs["ca"] + ".pem", certs["client"] + ".pem",
                              certs["client"] + ".key")
    try:
        running = coordinator_main.start(
            CoordinatorConfig(targets=(f"dns:targets.test:{port}",), port=0, peer_tls=peer,
                              connect_timeout_s=10),
            resolve=lambda name: ["127.0.0.1"] if name == "targets.test" else [])
        try:
            with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                answer = list(generate_pb2_grpc.CoordinatorStub(channel).Generate(
                    generate_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=4,
                                                 ignore_eos=True), timeout=30))
            assert sum(len(r.token_ids) for r in answer) == 4
        finally:
            running.stop(0)
        with pytest.raises(errors.Unavailable):
            coordinator_main.start(CoordinatorConfig(
                targets=(f"127.0.0.1:{port}",), port=0, peer_tls=peer, connect_timeout_s=2))
    finally:
        server.stop(0)
