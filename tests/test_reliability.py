"""Serving on bad days: lost services, cancellation, deadlines, load, shutdown, metrics."""
import concurrent.futures
import threading

import grpc
import pytest
from transformers import AutoModelForCausalLM

from batchspec import errors
from batchspec.metrics import scrape
from batchspec.v1 import generate_pb2

import tiny_models
from conftest import running_stack, start_draft, start_target, wait_for

LONG = 200  # tokens: long enough that a restart lands mid-run


def stream(stub, prompt, max_new, timeout=120, **fields):
    responses = stub.Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new, ignore_eos=True, **fields),
        timeout=timeout)
    return [t for r in responses for t in r.token_ids]


def prompts(count):
    return [[4 + (7 * i + j) % 90 for j in range(1 + i % 9)] for i in range(count)]


@pytest.fixture(scope="module")
def llama_model(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"][0])


def run_with_outage(stack, restart, count=8):
    """Start `count` long requests, call restart() once tokens flow, return the outputs."""
    stub = stack.stub()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(stream, stub, p, LONG) for p in prompts(count)]
        assert wait_for(lambda: stack.router.stats.num_steps > 5)
        restart()
        return [f.result(timeout=120) for f in futures]


def test_draft_loss_falls_back_to_the_target_and_recovers(model_dirs, llama_model):
    target_dir, draft_dir = model_dirs["llama"]
    # one token a command while the draft is down (plain steps of four would often finish
    # the requests before the restarted draft is reached, leaving no step to speculate in)
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=3,
                       plain_steps=1) as stack:
        restarted = {}

        def restart():
            stack.draft_server.stop(0).wait()
            assert wait_for(lambda: stack.router.stats.num_draft_fallback_steps > 3)
            restarted["speculative_steps"] = (stack.router.stats.num_steps
                                              - stack.router.stats.num_draft_fallback_steps)
            server, _, _, runner = start_draft(draft_dir, port=stack.draft_port)
            restarted["server"], restarted["runner"] = server, runner

        outputs = run_with_outage(stack, restart)
        stats = stack.router.stats
        speculative_after = stats.num_steps - stats.num_draft_fallback_steps
        assert speculative_after > restarted["speculative_steps"]  # speculating again
        # released right after the last tokens are streamed, so possibly just after the client
        # has them all
        assert wait_for(lambda: len(restarted["runner"].caches) == 0, timeout=5)
        restarted["server"].stop(0)
    for prompt, tokens in zip(prompts(8), outputs):
        assert tokens == tiny_models.reference_greedy(llama_model, prompt, LONG, ignore_eos=True)


def test_a_hung_draft_is_dropped_and_decoding_goes_on(model_dirs, llama_model):
    """The draft stops answering (its runner lock held, as a stuck kernel would): after the
    stall timeout the coordinator decodes with the target alone, probing the draft off the
    engine thread, and speculates again once it answers."""
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=3,
                       stall_timeout_s=0.5) as stack:
        seen = {}

        def hang():
            with stack.draft_runner.lock:
                fallback = stack.router.stats.num_draft_fallback_steps
                # target-only steps go on while the draft hangs (probes do not block them)
                assert wait_for(lambda: stack.router.stats.num_draft_fallback_steps
                                > fallback + 20, timeout=20)
                seen["speculative_steps"] = (stack.router.stats.num_steps
                                             - stack.router.stats.num_draft_fallback_steps)

        outputs = run_with_outage(stack, hang)
        stats = stack.router.stats
        assert stats.num_steps - stats.num_draft_fallback_steps > seen["speculative_steps"]
        assert wait_for(lambda: not stack.draft_runner.caches and not stack.target_runner.caches)
    for prompt, tokens in zip(prompts(8), outputs):
        assert tokens == tiny_models.reference_greedy(llama_model, prompt, LONG, ignore_eos=True)


def test_target_restart_loses_nothing_and_stays_exact(model_dirs, llama_model):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=3) as stack:
        restarted = {}

        def restart():
            stack.target_server.stop(0).wait()
            assert wait_for(lambda: not stack.router.healthy())  # the loss was seen
            server, _, _, runner = start_target(target_dir, port=stack.target_port)
            restarted["server"], restarted["runner"] = server, runner

        outputs = run_with_outage(stack, restart)
        assert wait_for(lambda: len(restarted["runner"].caches) == 0)
        restarted["server"].stop(0)
    for prompt, tokens in zip(prompts(8), outputs):
        assert tokens == tiny_models.reference_greedy(llama_model, prompt, LONG, ignore_eos=True)


def test_a_request_whose_deadline_passes_during_a_target_outage_fails_cleanly(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=2) as stack:
        stub = stack.stub()
        stack.target_server.stop(0).wait()
        with pytest.raises(grpc.RpcError) as caught:
            stream(stub, [5, 6, 7], 20, timeout=1.0)
        assert caught.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                       grpc.StatusCode.UNAVAILABLE)
        assert wait_for(lambda: not stack.router.healthy())
        with pytest.raises(grpc.RpcError) as caught:  # nothing new taken while no target is up
            stream(stub, [5, 6, 7], 20, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no target" in caught.value.details()
        server, _, _, runner = start_target(target_dir, port=stack.target_port)
        assert wait_for(stack.router.healthy)  # reconnected without any request to carry
        assert len(stream(stub, [5, 6, 7], 20)) == 20  # and the next one is served
        assert wait_for(lambda: not runner.caches)
        server.stop(0)


def test_a_request_ended_while_a_live_target_is_unreachable_is_released_later(model_dirs):
    """The stream to the target breaks but the target keeps running: the target releases
    what the ended stream held; a request cancelled while the coordinator cannot reach it
    is released there (already gone: nothing refused) once it answers again, and serving
    goes on."""
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=2) as stack:
        engine = stack.router.engines[0]
        target = engine.peers.target
        reachable = threading.Event()
        real_verify, real_describe = target.verify, target.describe

        def broken_verify(*args, **kwargs):
            target.verify = real_verify  # once
            raise errors.Unavailable("injected: stream broken")

        def describe(*args, **kwargs):
            if not reachable.is_set():
                raise errors.Unavailable("injected: not reachable yet")
            return real_describe(*args, **kwargs)

        stub = stack.stub()
        call = stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=[5, 6], max_new_tokens=240, ignore_eos=True))
        next(call)
        target.describe, target.verify = describe, broken_verify
        assert wait_for(lambda: not engine.target_up)
        call.cancel()
        assert wait_for(lambda: engine.pool.num_running() == 0)
        # the target never heard of the cancel, but the stream that prefilled it ended
        assert wait_for(lambda: not stack.target_runner.caches)
        reachable.set()
        assert wait_for(lambda: engine.target_up)  # reconnected (new requests taken again)
        assert len(stream(stub, [5, 6, 7], 10)) == 10  # served after the reconnection
        assert wait_for(lambda: not stack.target_runner.caches
                        and not stack.draft_runner.caches, timeout=5)


def test_cancelled_stream_is_released_from_both_services(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=2) as stack:
        call = stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=[5, 6], max_new_tokens=240, ignore_eos=True))
        next(call)
        assert stack.target_runner.caches and stack.draft_runner.caches
        call.cancel()
        assert wait_for(lambda: not stack.target_runner.caches
                        and not stack.draft_runner.caches, timeout=5)
        assert stack.router.num_running() == 0


def test_deadline_ends_the_request_and_frees_its_caches(model_dirs):
    target_dir, draft_dir = model_dirs["gpt2"]
    with running_stack(target_dir, draft_dir, batch_size=1, num_draft_tokens=1) as stack:
        with pytest.raises(grpc.RpcError) as caught:
            stream(stack.stub(), [5] * 10, 240, timeout=0.05)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: not stack.target_runner.caches
                        and not stack.draft_runner.caches, timeout=5)


def test_hundreds_of_streams_complete_or_are_refused_cleanly(model_dirs):
    target_dir, draft_dir = model_dirs["gpt2"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    requests = [(p, 6 + i % 5) for i, p in enumerate(prompts(300))]
    expected = {}
    with running_stack(target_dir, draft_dir, batch_size=16, num_draft_tokens=3,
                       max_num_seqs=32, max_queue=100) as stack:
        stub = stack.stub()

        def one(request):
            try:
                return stream(stub, *request, timeout=60)
            except grpc.RpcError as error:
                return error.code()

        with concurrent.futures.ThreadPoolExecutor(300) as pool:
            outcomes = list(pool.map(one, requests))
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
    refused = [o for o in outcomes if isinstance(o, grpc.StatusCode)]
    # 300 at once against 32 + 100 places: some must be turned away, and only that way
    assert refused and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    completed = [(r, o) for r, o in zip(requests, outcomes) if not isinstance(o, grpc.StatusCode)]
    assert len(completed) >= 100
    for (prompt, max_new), tokens in completed:
        key = (tuple(prompt), max_new)
        if key not in expected:
            expected[key] = tiny_models.reference_greedy(model, prompt, max_new, ignore_eos=True)
        assert tokens == expected[key]


def test_shutdown_finishes_in_flight_work_and_refuses_new(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=4) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, stub, p, 120) for p in prompts(4)]
            assert wait_for(lambda: stack.router.stats.num_steps > 2)
            stopper = threading.Thread(target=stack.router.stop, args=(30,))
            stopper.start()
            assert wait_for(lambda: stack.router.stopping)
            with pytest.raises(grpc.RpcError) as caught:
                stream(stub, [5, 6], 5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert all(len(f.result(timeout=60)) == 120 for f in futures)
            stopper.join(timeout=60)


def test_metrics_use_vllm_names_and_count_work(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=4, metrics_port=0) as stack:
        for p in prompts(4):
            stream(stack.stub(), p, 20)
        samples = scrape(f"http://127.0.0.1:{stack.metrics_port}/metrics")
    values = {}
    for name, _, value in samples:
        values[name] = values.get(name, 0) + value
    assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert values["vllm:generation_tokens_total"] == 80
    assert values["vllm:time_to_first_token_seconds_count"] == 4
    assert values["vllm:e2e_request_latency_seconds_count"] == 4
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in values
    assert values["batchspec:grouped_steps_total"] + values["batchspec:realigned_steps_total"] > 0
    assert "vllm:num_requests_running" in values and "batchspec:verify_seconds_count" in values
