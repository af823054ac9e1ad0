"""Property-based fuzzing of the public and internal APIs: every malformed input gets the right
status code, and the services keep serving."""
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchspec import errors
from batchspec.params import SamplingParams
from batchspec.v1 import generate_pb2
from coordinator.clients import ProposeSpec, VerifySpec

import tiny_models
from conftest import running_stack

FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@pytest.fixture(scope="module")
def stack(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=4, num_draft_tokens=2) as running:
        yield running


requests = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=50),
    "prompt_token_ids": st.lists(INT32 | st.integers(0, tiny_models.VOCAB - 1), max_size=300),
    "max_new_tokens": st.integers(0, 2**32 - 1) | st.integers(0, 8),
    "temperature": FLOATS,
    "top_k": INT32,
    "top_p": FLOATS,
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=5), max_size=3),
    "ignore_eos": st.booleans(),
    "request_id": st.text(max_size=20),
})


@FUZZ
@given(fields=requests)
def test_public_api_answers_every_request_with_tokens_or_invalid_argument(stack, fields):
    try:
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(**fields),
                                               timeout=30))
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error.details()
    else:
        last = responses[-1]
        assert last.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        assert 1 <= last.stats.num_generated_tokens <= fields["max_new_tokens"]
    # and the coordinator keeps serving
    ok = list(stack.stub().Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=[5, 6], max_new_tokens=2, ignore_eos=True), timeout=30))
    assert sum(len(r.token_ids) for r in ok) == 2


commands = st.one_of(
    st.tuples(st.just("prefill"), st.integers(0, 5), st.lists(st.integers(-3, 200), max_size=8)),
    st.tuples(st.just("trim"), st.integers(0, 5), st.integers(0, 10), st.integers(0, 10)),
    st.tuples(st.just("release"), st.lists(st.integers(0, 5), max_size=3)),
    st.tuples(st.just("verify"), st.integers(0, 5), st.integers(0, 10),
              st.lists(st.integers(-3, 200), min_size=1, max_size=2),
              st.lists(st.integers(-3, 200), max_size=3), st.booleans()),
)
EXPECTED = (errors.InvalidArgument, errors.NotFound, errors.AlreadyExists,
            errors.FailedPrecondition)


@FUZZ
@given(sequence=st.lists(commands, min_size=1, max_size=8))
def test_internal_api_refuses_malformed_commands_with_the_right_code(stack, sequence):
    from coordinator.clients import TargetClient

    client = TargetClient(f"127.0.0.1:{stack.target_port}")
    try:
        for command in sequence:
            try:
                run(client, command)
            except EXPECTED:
                pass  # a refusal with one of the codes the contract names
        # state is consistent: describe answers, and every cached id can be released
        held = list(stack.target_runner.caches)
        if held:
            client.release(held)
        assert client.describe().num_sequences == 0
    finally:
        client.close()


def run(client, command):
    kind, *args = command
    if kind == "prefill":
        client.prefill([(args[0], args[1])])
    elif kind == "trim":
        client.trim([tuple(args)])
    elif kind == "release":
        client.release(args[0])
    else:
        seq_id, expected, append, drafts, realign = args
        client.verify(realign, [VerifySpec(seq_id, expected, append, drafts,
                                           SamplingParams())])


def test_draft_refuses_unknown_ids_and_bad_k(stack):
    from coordinator.clients import DraftClient

    client = DraftClient(f"127.0.0.1:{stack.draft_port}")
    try:
        with pytest.raises(errors.NotFound):
            client.propose(2, False, [ProposeSpec(12345, 0, 0, [5], SamplingParams())])
        client.prefill([(77, [5, 6])])
        with pytest.raises(errors.InvalidArgument):
            client.propose(0, False, [ProposeSpec(77, 2, 2, [7], SamplingParams())])
        with pytest.raises(errors.InvalidArgument):
            client.propose(2, False, [ProposeSpec(77, 2, 3, [7], SamplingParams())])
        assert client.release([77]) == 0
    finally:
        client.close()


@FUZZ
@given(raw=st.binary(max_size=200))
def test_raw_bytes_on_the_wire_are_answered_and_harm_nobody(stack, raw):
    """Bytes that are not a GenerateRequest are refused with INVALID_ARGUMENT, saying so;
    bytes that happen to decode are answered like any request."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.port}") as channel:
        generate = channel.unary_stream("/batchspec.v1.Coordinator/Generate",
                                        request_serializer=None, response_deserializer=None)
        try:
            list(generate(raw, timeout=30))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert error.details()
    ok = list(stack.stub().Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=[5, 6], max_new_tokens=2, ignore_eos=True), timeout=30))
    assert sum(len(r.token_ids) for r in ok) == 2
