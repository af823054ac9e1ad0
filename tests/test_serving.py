"""The public server under load and attack: admission and refusals, health under load,
failure isolation, streamed text, one log line per ended request, TLS, mutual TLS, API keys,
and the load benchmark."""
import concurrent.futures
import datetime
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM

from batchspec import security
from batchspec.runtime import service
from batchspec.v1 import cache_pb2, draft_pb2_grpc, generate_pb2, generate_pb2_grpc, target_pb2_grpc
from batchspec_tools.bench import loadtest
from coordinator import __main__ as coordinator_main
from coordinator import scheduler
from coordinator.config import CoordinatorConfig, EngineConfig
from coordinator.sequence import Finish, Sequence
from coordinator.text import TextCodec, TextStream
from draft_service.servicer import SERVICE_NAME as DRAFT_NAME
from draft_service.servicer import DraftServicer
from target_service.servicer import SERVICE_NAME as TARGET_NAME
from target_service.servicer import TargetServicer

import tiny_models
from conftest import running_stack, wait_for

# ---- streamed text -------------------------------------------------------------------------------
CORPUS = ["Hello wörld! 日本語のテキスト 😀 emoji,  spaces   and\nnewlines.",
          "The quick brown fox jumps over the lazy dog. END of story.",
          "Ça va? Naïve café — déjà vu; 中文字符 and more text here."] * 20


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    """A byte-level BPE tokenizer (as GPT-2's and SmolLM2's) with one special token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return TextCodec(str(path))


def stream_text(codec, ids, chunk, **kwargs):
    text = TextStream(codec, **kwargs)
    pieces = [text.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces, text


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_text_equals_the_full_decode_and_never_shows_half_a_character(codec, chunk):
    ids = codec.encode(" ".join(CORPUS[:3]))
    pieces, text = stream_text(codec, ids, chunk)
    assert "".join(pieces) + text.flush() == codec.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_special_tokens_give_no_text_unless_asked(codec):
    end = codec.tokenizer.token_to_id("<|end|>")
    ids = codec.encode("Hello wörld!") + [end]
    pieces, text = stream_text(codec, ids, 1)
    assert "".join(pieces) + text.flush() == "Hello wörld!"
    pieces, text = stream_text(codec, ids, 1, skip_special_tokens=False)
    assert "".join(pieces) + text.flush() == "Hello wörld!<|end|>"


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_no_part_of_a_stop_string_is_ever_streamed(codec, chunk):
    ids = codec.encode(CORPUS[1])
    pieces, text = stream_text(codec, ids, chunk, stop=["END of", "zzz"])
    assert text.stopped
    assert "".join(pieces) == "The quick brown fox jumps over the lazy dog. "
    assert not any("E" in piece for piece in pieces)
    assert text.feed(codec.encode(" more")) == "" and text.flush() == ""


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_a_stop_string_ends_the_tokens_where_it_ends_the_text(codec, chunk):
    """The tokens a stop string lets through are those the target alone (one token a step)
    would have given: up to the one that completes it, however many one step committed. The
    sequence, its event and its log-probabilities end there, and the finish says why."""
    from coordinator import commit
    from coordinator.clients import VerifyOutcome
    from coordinator.requests import RequestHandle
    from coordinator.telemetry import Telemetry

    ids = codec.encode(CORPUS[1])
    stop_at = next(n for n in range(1, len(ids) + 1) if "END of" in codec.decode(ids[:n]))
    assert stop_at < len(ids) - 2  # tokens past the stop string's end to be cut
    seq = Sequence(1, [0], max_new_tokens=100, stop_token_ids=frozenset())
    seq.text = TextStream(codec, stop=["END of"])
    handle = RequestHandle(seq, deadline=None)
    events, done = [], False
    for start in range(0, len(ids), chunk):
        outputs = ids[start:start + chunk]
        outcome = VerifyOutcome(1, len(outputs) - 1, outputs,
                                seq.committed_len - 1 + len(outputs) - 1,
                                logprobs=[f"lp{t}" for t in outputs])
        done = commit.commit(handle, outcome, len(outputs) - 1, 0, Telemetry())
        events.append(handle.events.get_nowait())
        if done:
            break
    assert done and seq.finish is Finish.STOP_STRING
    assert seq.generated_token_ids == ids[:stop_at]
    assert [t for e in events for t in e.token_ids] == ids[:stop_at]
    assert [lp for e in events for lp in e.logprobs] == [f"lp{t}" for t in ids[:stop_at]]
    assert "".join(e.text for e in events) == "The quick brown fox jumps over the lazy dog. "


def test_each_tokens_bytes_join_into_the_text_where_its_own_text_is_half_a_character(
        codec, tmp_path):
    """Log-probabilities' `bytes`: a token holding part of a character gives its own bytes
    (its text alone is U+FFFD), so a client joins them into the character."""
    text = "Hello 🦜 wörld 𝄞"  # the parrot and the clef are not in the corpus: byte tokens
    ids = codec.encode(text)
    assert any(codec.token_text(i) == "\ufffd" for i in ids)
    assert b"".join(codec.token_bytes(i) for i in ids) == text.encode()
    end = codec.tokenizer.token_to_id("<|end|>")
    assert codec.token_bytes(end) == b"<|end|>"
    # SentencePiece style (Llama, Mistral): "▁" for a space, <0xNN> for a byte it falls back to
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁Hello": 257, "▁w": 258}
    piece = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    piece.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                       decoders.Fuse()])
    piece.save(str(tmp_path / "tokenizer.json"))
    spm = TextCodec(str(tmp_path))
    ids = [257, 258, 1 + 0xC3, 1 + 0xB6]  # " Hello w" then ö in two bytes
    assert [spm.token_bytes(i) for i in ids] == [b" Hello", b" w", b"\xc3", b"\xb6"]
    assert spm.decode(ids) == " Hello wö"


def test_detokenising_costs_the_new_tokens_only(codec):
    """Each step decodes a bounded window, however long the text already is."""
    decoded = []
    real_decode = codec.decode

    def counting_decode(ids, skip_special_tokens=True):
        decoded.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    ids = codec.encode(" ".join(CORPUS))  # some thousand tokens
    assert len(ids) > 500
    text = TextStream(codec, stop=["never appears"])
    text.codec = type("Counting", (), {"decode": staticmethod(counting_decode)})()
    out = "".join(text.feed([t]) for t in ids) + text.flush()
    assert out == real_decode(ids)
    assert max(decoded) <= 16


# ---- admission, health and isolation -------------------------------------------------------------
def health_check(port, timeout=2.0):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="batchspec.v1.Coordinator"),
            timeout=timeout).status


def generate(stub, prompt, max_new, timeout=120, **fields):
    responses = list(stub.Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new, ignore_eos=True, **fields),
        timeout=timeout))
    return [t for r in responses for t in r.token_ids]


def test_beyond_pool_and_queue_requests_are_refused_and_health_answers_meanwhile(model_dirs):
    target_dir, draft_dir = model_dirs["gpt2"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = [[4 + (7 * i + j) % 90 for j in range(1 + i % 5)] for i in range(150)]
    with running_stack(target_dir, draft_dir, batch_size=8, num_draft_tokens=2,
                       max_num_seqs=8, max_queue=16) as stack:
        stub = stack.stub()
        running, health = [], []

        def one(prompt):
            try:
                return generate(stub, prompt, 24, timeout=120)
            except grpc.RpcError as error:
                return error.code()

        with concurrent.futures.ThreadPoolExecutor(150) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            while not all(f.done() for f in futures):
                running.append(stack.router.num_running())
                health.append(health_check(stack.port))  # raises if it takes 2 s
            outcomes = [f.result() for f in futures]
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
    refused = [o for o in outcomes if isinstance(o, grpc.StatusCode)]
    assert refused and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert max(running) == 8  # the pool filled, and never overflowed
    assert set(health) == {health_pb2.HealthCheckResponse.SERVING}
    for prompt, tokens in zip(prompts, outcomes):
        if not isinstance(tokens, grpc.StatusCode):
            assert tokens == tiny_models.reference_greedy(model, prompt, 24, ignore_eos=True)


def test_a_failing_step_fails_only_the_requests_it_touched(model_dirs, caplog):
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    with running_stack(target_dir, draft_dir, batch_size=1, num_draft_tokens=2) as stack:
        target = stack.router.engines[0].peers.target
        real_verify = target.verify
        poisoned = {}

        def verify(realign, specs, **kwargs):
            if any(s.seq_id == poisoned.get("id") for s in specs):
                raise RuntimeError("injected: a bug in one step")
            return real_verify(realign, specs, **kwargs)

        target.verify = verify
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            victim = stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=[20, 21], max_new_tokens=100, ignore_eos=True))
            first = next(victim)
            assert first.token_ids
            poisoned["id"] = max(stack.router.engines[0].pool.active)  # the victim's sequence
            others = [pool.submit(generate, stub, p, 40) for p in prompts]
            with pytest.raises(grpc.RpcError) as caught:
                list(victim)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            outputs = [f.result(timeout=120) for f in others]
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == tiny_models.reference_greedy(model, prompt, 40, ignore_eos=True)


def test_a_cohort_waits_for_its_last_deadline_not_its_first():
    from coordinator.engine import cohort_timeout
    from coordinator.requests import RequestHandle
    from coordinator.sequence import Sequence

    seq = Sequence(1, [5], 4, frozenset())
    soon, later = RequestHandle(seq, 10.0), RequestHandle(seq, 1e12)
    assert cohort_timeout([soon, RequestHandle(seq, None)]) is None
    assert cohort_timeout([soon, later]) > 1e6


def test_every_ended_request_leaves_one_log_line_with_its_reason(model_dirs, caplog):
    target_dir, draft_dir = model_dirs["llama"]
    caplog.set_level(logging.INFO, logger="coordinator.requests")
    with running_stack(target_dir, draft_dir, batch_size=1, max_num_seqs=1,
                       max_queue=1) as stack:
        stub = stack.stub()
        generate(stub, [5, 6], 5, request_id="done")
        with pytest.raises(grpc.RpcError):
            generate(stub, [], 5, request_id="bad")
        # "done" is released (its stream may end before the engine's release reaches the
        # target, which would then wait on the lock below and hold up the engine)
        assert wait_for(lambda: not stack.target_runner.caches)
        with stack.target_runner.lock:  # the target takes no command: nothing advances
            with pytest.raises(grpc.RpcError) as caught:
                generate(stub, [5, 6], 20, timeout=0.3, request_id="late")
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # the server ends it on its own clock: until then it holds the one queue place
            assert wait_for(lambda: "request late" in caplog.text
                            and stack.router.num_waiting() == 0, timeout=10)
            gone = stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=[5, 6], max_new_tokens=20, request_id="gone"))
            assert wait_for(lambda: stack.router.num_waiting() == 1)  # the queue is full
            with pytest.raises(grpc.RpcError) as caught:
                generate(stub, [8], 5, request_id="full")
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            gone.cancel()
            assert wait_for(lambda: "request gone" in caplog.text, timeout=5)
        assert wait_for(lambda: stack.router.num_waiting() == 0)
        assert len(generate(stub, [7], 5, request_id="after")) == 5
    lines = {line.split()[1]: line for line in caplog.messages if line.startswith("request ")}
    assert "ended=finished (length)" in lines["done"] and "tokens=5" in lines["done"]
    assert "ended=invalid" in lines["bad"] and "INVALID_ARGUMENT" in lines["bad"]
    assert "ended=deadline" in lines["late"]
    assert "ended=cancelled" in lines["gone"]
    assert "ended=refused" in lines["full"] and "RESOURCE_EXHAUSTED" in lines["full"]
    assert "ended=finished (length)" in lines["after"]
    assert len([m for m in caplog.messages if m.startswith("request ")]) == 6


# ---- TLS, mutual TLS, API keys -------------------------------------------------------------------
def make_certificates(root, server_names=None):
    """A CA, a server certificate for 127.0.0.1/localhost (or for `server_names` alone) and a
    client certificate, all signed by the CA, plus a client certificate from a CA nobody
    trusts."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    def issue(subject, issuer_name, issuer_key, *, ca=False, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(subject))
                   .issuer_name(issuer_name or name(subject))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)),
                                            critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return cert, key

    def save(stem, cert, key):
        (root / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    ca, ca_key = issue("batchspec test CA", None, None, ca=True)
    save("ca", ca, ca_key)
    sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))) \
        if server_names is None else tuple(x509.DNSName(name) for name in server_names)
    save("server", *issue("127.0.0.1", ca.subject, ca_key, sans=sans))
    save("client", *issue("coordinator", ca.subject, ca_key))
    rogue_ca, rogue_key = issue("rogue CA", None, None, ca=True)
    save("rogue", *issue("rogue", rogue_ca.subject, rogue_key))
    return {stem: str(root / stem) for stem in ("ca", "server", "client", "rogue")}


def describe(port, credentials):
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Describe(
            cache_pb2.DescribeRequest(), timeout=5)


def test_tls_mutual_tls_and_api_key(model_dirs, tmp_path):
    target_dir, draft_dir = model_dirs["llama"]
    certs = make_certificates(tmp_path)
    server_tls = security.ServerTls(certs["server"] + ".pem", certs["server"] + ".key",
                                    client_ca=certs["ca"] + ".pem")
    target_server, target_port, _, _ = service.start_model_service(
        service.ServiceConfig(model=target_dir, tls=server_tls), TargetServicer,
        target_pb2_grpc.add_TargetServiceServicer_to_server, TARGET_NAME)
    draft_server, draft_port, _, _ = service.start_model_service(
        service.ServiceConfig(model=draft_dir, tls=server_tls), DraftServicer,
        draft_pb2_grpc.add_DraftServiceServicer_to_server, DRAFT_NAME)
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret\n")
    peer = security.ClientTls(certs["ca"] + ".pem", certs["client"] + ".pem",
                              certs["client"] + ".key")
    config = CoordinatorConfig(
        targets=(f"127.0.0.1:{target_port}",), drafts=(f"127.0.0.1:{draft_port}",), port=0,
        engine=EngineConfig(num_draft_tokens=2, cohort_policy=scheduler.CohortPolicy(batch_size=2)),
        connect_timeout_s=10, peer_tls=peer, api_key_file=str(key_file),
        tls=security.ServerTls(certs["server"] + ".pem", certs["server"] + ".key"))
    running = coordinator_main.start(config)
    ca = (tmp_path / "ca.pem").read_bytes()
    try:
        # the model service: a valid client certificate gets in, others do not
        assert describe(target_port, peer.credentials()).vocab_size == tiny_models.VOCAB
        for credentials in (grpc.ssl_channel_credentials(ca),
                            security.ClientTls(certs["ca"] + ".pem", certs["rogue"] + ".pem",
                                               certs["rogue"] + ".key").credentials()):
            with pytest.raises(grpc.RpcError) as caught:
                describe(target_port, credentials)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        # the public API: TLS, and the key in the metadata
        with grpc.secure_channel(f"127.0.0.1:{running.port}",
                                 grpc.ssl_channel_credentials(ca)) as channel:
            stub = generate_pb2_grpc.CoordinatorStub(channel)
            request = generate_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                                   max_new_tokens=12, ignore_eos=True)
            for metadata in ((), (("authorization", "Bearer wrong"),),
                             (("authorization", "s3cret"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Generate(request, metadata=metadata, timeout=10))
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            tokens = [t for r in stub.Generate(
                request, metadata=(("authorization", "Bearer s3cret"),), timeout=60)
                for t in r.token_ids]
            model = AutoModelForCausalLM.from_pretrained(target_dir)
            assert tokens == tiny_models.reference_greedy(model, [5, 6, 7], 12,
                                                          ignore_eos=True)
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="batchspec.v1.Coordinator"), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING  # no key needed
        with pytest.raises(grpc.RpcError) as caught:  # plaintext to a TLS port
            health_check(running.port)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(0)
        target_server.stop(0)
        draft_server.stop(0)


def test_half_given_tls_settings_are_refused():
    with pytest.raises(ValueError):
        security.server_tls("cert.pem", None)
    with pytest.raises(ValueError):
        security.server_tls(None, None, client_ca="ca.pem")
    with pytest.raises(ValueError):
        security.ServerTls("/nonexistent.pem", "/nonexistent.key")
    with pytest.raises(ValueError):
        security.ClientTls("/nonexistent-ca.pem")


# ---- the load benchmark --------------------------------------------------------------------------
def test_loadtest_refuses_beyond_pool_and_queue_and_leaves_nothing_behind():
    report = loadtest.run(loadtest.LoadConfig(streams=150, max_num_seqs=8, max_queue=16,
                                              max_new_tokens=8, num_prompts=8, channels=2,
                                              batch_size=8, num_draft_tokens=2))
    # at least the queue and what the engine admitted before the flood ended (how much that
    # is depends on how fast the engine steps meanwhile)
    assert report["refused"] > 0 and report["completed"] > 16
    assert report["completed"] + report["refused"] == 150 and not report["other_errors"]
    assert report["max_running"] == 8
    assert report["caches_left"] == {"target": 0, "draft": 0}
    assert report["exact"] == report["completed"]
    assert report["health_checks"] > 0 and report["health_failures"] == 0
    assert report["reflection_failures"] == 0
    assert "refused" in loadtest.summary(report)


def test_the_health_the_http_edge_reads_is_the_grpc_health():
    """GET /health reads what the gRPC health says (NOT_SERVING from start-up, SERVING once
    set, NOT_SERVING again while the server drains)."""
    from batchspec import server as server_lib

    server = server_lib.LoopServer("127.0.0.1:0", [])
    try:
        server.start()
        assert not server.health.serving()
        for serving in (True, False):
            server_lib.set_serving(server.health, [], serving)
            assert server.health.serving() is serving
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=5).status
            assert (status == health_pb2.HealthCheckResponse.SERVING) is serving
    finally:
        server.stop(0).wait(10)


def test_a_port_in_use_is_refused_not_shared():
    """A second server on a port another one serves is refused at start (gRPC's default,
    SO_REUSEPORT, let it share the port: the kernel split new connections between the two)."""
    from batchspec import server as server_lib

    first = server_lib.LoopServer("127.0.0.1:0", [])
    try:
        with pytest.raises((OSError, RuntimeError)):
            server_lib.LoopServer(f"127.0.0.1:{first.port}", [])
        with pytest.raises((OSError, RuntimeError)):
            server_lib.create_server(f"127.0.0.1:{first.port}", [])
    finally:
        first.stop(0).wait(10)


def test_an_http_or_metrics_port_in_use_is_named_in_the_refusal():
    """The coordinator's HTTP edge and any process's metrics say which address they could
    not take (a bare "Address already in use" left an operator guessing which of three)."""
    import asyncio
    import socket

    from batchspec import metrics
    from coordinator import http

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.serve_metrics(None, port)
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            asyncio.run(http.start(None, "127.0.0.1", port))
    finally:
        taken.close()
