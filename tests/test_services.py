"""The internal services over real gRPC on port 0: cache commands, refusals, health, reflection."""
import pathlib
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchspec import errors
from batchspec.params import SamplingParams
from batchspec.runtime import compute, service
from batchspec.runtime.rows import ProposeRow, VerifyRow
from coordinator import clients
from coordinator.clients import DraftClient, ProposeSpec, TargetClient, VerifySpec
from draft_service import proposer

from conftest import start_draft, start_hosting_target, start_target

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(model_dirs):
    server, port, _, runner = start_target(model_dirs["llama"][0])
    client = TargetClient(f"127.0.0.1:{port}")
    yield client, runner, port
    client.close()
    server.stop(0)


@pytest.fixture(scope="module")
def draft(model_dirs):
    server, port, _, runner = start_draft(model_dirs["llama"][1])
    client = DraftClient(f"127.0.0.1:{port}")
    yield client, runner, port
    client.close()
    server.stop(0)


def test_verify_keeps_the_cache_at_committed_minus_one(target):
    client, runner, _ = target
    client.prefill([(1, [5, 6, 7])])
    [outcome], _ = client.verify(False, [VerifySpec(1, 3, [8], [9, 10], GREEDY)])
    assert 0 <= outcome.num_accepted <= 2
    assert len(outcome.output_token_ids) == outcome.num_accepted + 1
    assert outcome.cache_len == 4 + outcome.num_accepted == runner.caches[1].length
    client.release([1])


def test_length_mismatch_is_refused_and_the_stream_goes_on(target):
    client, runner, _ = target
    client.prefill([(2, [5, 6, 7])])
    with pytest.raises(errors.FailedPrecondition, match="expected cache length 2"):
        client.verify(False, [VerifySpec(2, 2, [8], [9], GREEDY)])
    assert runner.caches[2].length == 3  # nothing computed on the wrong cache
    with pytest.raises(errors.FailedPrecondition):
        client.trim([(2, 4, 1)])
    assert client.trim([(2, 3, 1)]) == [1]
    assert client.release([2]) == 0


def test_unknown_duplicate_and_released_ids_get_their_codes(target):
    client, _, _ = target
    with pytest.raises(errors.NotFound):
        client.verify(False, [VerifySpec(404, 0, [1], [], GREEDY)])
    client.prefill([(3, [5])])
    with pytest.raises(errors.AlreadyExists):
        client.prefill([(3, [5])])
    client.release([3])
    with pytest.raises(errors.NotFound):
        client.release([3])
    with pytest.raises(errors.InvalidArgument, match="vocabulary"):
        client.prefill([(4, [5, 10_000])])
    assert client.describe().num_sequences == 0


def test_mixed_lengths_need_an_explicit_realign(target):
    client, _, _ = target
    client.prefill([(5, [5, 6]), (6, [5, 6, 7, 8])])
    specs = [VerifySpec(5, 2, [7], [1], GREEDY), VerifySpec(6, 4, [9], [1], GREEDY)]
    with pytest.raises(errors.FailedPrecondition, match="realign"):
        client.verify(False, specs)
    outcomes, timing = client.verify(True, specs)
    assert timing.realign_seconds > 0 and timing.forward_seconds > 0
    assert [o.cache_len for o in outcomes] == [3 + outcomes[0].num_accepted,
                                               5 + outcomes[1].num_accepted]
    client.release([5, 6])


def test_draft_proposes_k_tokens_and_caches_k_minus_one(draft):
    client, runner, _ = draft
    client.prefill([(1, [5, 6, 7]), (2, [8, 9, 10])])
    proposals, timing = client.propose(3, False, [ProposeSpec(1, 3, 3, [11], GREEDY),
                                          ProposeSpec(2, 3, 3, [12], GREEDY)])
    assert [len(p.draft_token_ids) for p in proposals] == [3, 3]
    assert timing.realign_seconds == 0 and timing.forward_seconds > 0
    assert [p.cache_len for p in proposals] == [6, 6] == [runner.caches[s].length for s in (1, 2)]
    # roll back to the committed prefix plus one accepted draft, feeding two tokens
    again, _ = client.propose(2, False, [ProposeSpec(1, 6, 3, [11, 20], GREEDY)])
    assert again[0].cache_len == 3 + 2 + 1
    client.release([1, 2])
    assert client.describe().num_sequences == 0


def test_unsure_greedy_drafts_stop_early_and_sampled_ones_do_not(draft):
    client, runner, _ = draft
    client.prefill([(1, [5, 6, 7]), (2, [8, 9, 10])])
    specs = [ProposeSpec(1, 3, 3, [11], GREEDY), ProposeSpec(2, 3, 3, [12], GREEDY)]
    # every probability is below 1.0: both rows are cut before their first draft, after one
    # forward; the cache holds only what was fed
    proposals, _ = client.propose(4, False, specs, min_confidence=1.0)
    assert [p.draft_token_ids for p in proposals] == [[], []]
    assert [p.cache_len for p in proposals] == [4, 4] == [runner.caches[s].length for s in (1, 2)]
    # a sampled row is cut alike, by the draft's confidence at each position
    sampled = SamplingParams(temperature=1.0, seed=3)
    proposals, _ = client.propose(4, False, [ProposeSpec(1, 4, 3, [11], sampled)],
                                  min_confidence=1.0)
    assert proposals[0].draft_token_ids == [] and proposals[0].cache_len == 3 + 1
    proposals, _ = client.propose(3, False, [ProposeSpec(1, 4, 3, [11], sampled)])
    assert len(proposals[0].draft_token_ids) == 3 and proposals[0].cache_len == 3 + 1 + 2
    with pytest.raises(errors.InvalidArgument, match="min_draft_confidence"):
        client.propose(2, False, [ProposeSpec(2, 4, 3, [12], GREEDY)], min_confidence=1.5)
    client.release([1, 2])


def test_the_confidence_cut_is_per_row_and_weighs_the_whole_draft():
    rows = [ProposeRow(i, 3, 3, [11], GREEDY) for i in (1, 2)] + [
        ProposeRow(3, 3, 3, [11], SamplingParams(temperature=1.0, seed=3))]
    cut = proposer._Cut(rows, 4, 0.6)
    cut.after(0, torch.tensor([0.9, 0.5, 0.8]))  # row 2 is cut before its first draft
    assert cut.lengths[1] == 0 and not cut.done
    cut.after(1, torch.tensor([0.7, 0.99, 0.9]))  # row 1: 0.9 * 0.7 = 0.63, still in
    assert cut.lengths == [4, 0, 4]
    cut.after(2, torch.tensor([0.9, 0.99, 0.5]))  # 0.63 * 0.9 < 0.6: cut before draft 3
    # the sampled row is weighed alike: 0.8 * 0.9 * 0.5 < 0.6; every row cut, no more forwards
    assert cut.lengths == [2, 0, 2] and cut.done
    assert proposer._Cut(rows, 4, 0.0).lengths == [4, 4, 4]
    assert not proposer._Cut(rows, 4, 0.0).done  # no cut: the forwards run to K


def test_health_says_serving_and_reflection_lists_the_service(target):
    _, _, port = target
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="batchspec.v1.TargetService"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [response] = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in response.list_services_response.service}
        assert {"batchspec.v1.TargetService", "grpc.health.v1.Health"} <= names


def test_a_service_runs_its_model_on_the_compute_thread_only(target, draft):
    """Commands arrive on gRPC handler threads; every forward runs on the one compute thread
    (a second thread running torch makes OpenMP's workers sleep between kernels)."""
    seen = set()
    hooks = [runner.model.get_input_embeddings().register_forward_pre_hook(
        lambda *_: seen.add(threading.get_ident())) for _, runner, _ in (target, draft)]
    try:
        target[0].prefill([(40, [5, 6, 7])])
        draft[0].prefill([(40, [5, 6, 7])])
        [proposal], _ = draft[0].propose(2, False, [ProposeSpec(40, 3, 3, [8], GREEDY)])
        target[0].verify(False, [VerifySpec(40, 3, [8], proposal.draft_token_ids, GREEDY)])
    finally:
        for hook in hooks:
            hook.remove()
        target[0].release([40])
        draft[0].release([40])
    assert seen == {compute.thread_ident()}
    assert compute.thread_ident() != threading.get_ident()


def test_compute_run_returns_raises_and_nests():
    idents = {compute.run(threading.get_ident) for _ in range(3)}
    assert idents == {compute.thread_ident()}
    assert compute.run(compute.run, lambda x: x + 1, 1) == 2  # a nested call does not deadlock
    with pytest.raises(errors.NotFound, match="gone"):
        compute.run(lambda: (_ for _ in ()).throw(errors.NotFound("gone")))


def test_what_a_closed_stream_prefilled_is_released_and_only_that(target):
    """A coordinator that dies leaves nothing cached: when a command stream ends, the
    sequences it prefilled and did not release are released; a sequence released there and
    prefilled again on another stream belongs to that one and stays."""
    _, runner, port = target
    first, second = TargetClient(f"127.0.0.1:{port}"), TargetClient(f"127.0.0.1:{port}")
    try:
        first.prefill([(71, [5, 6, 7]), (72, [5, 6]), (73, [8, 9])])
        first.release([73])
        second.prefill([(73, [8, 9, 10])])
        first.reset()  # the stream ends as a crashed client's would
        from conftest import wait_for
        assert wait_for(lambda: 71 not in runner.caches and 72 not in runner.caches)
        assert runner.caches[73].length == 3  # the second stream's
        second.release([73])
        assert not {71, 72, 73} & set(runner.caches)
    finally:
        first.close()
        second.close()


def test_a_draft_on_the_cpu_computes_with_one_thread_unless_told():
    from batchspec.runtime import service

    def config(**kw):
        return service.ServiceConfig(model="smollm2", **kw)

    assert service.threads_for("draft", config()) == 1
    assert service.threads_for("target", config()) is None  # torch's default: every core
    assert service.threads_for("draft", config(threads=2)) == 2
    assert service.threads_for("target", config(threads=3)) == 3
    with pytest.raises(ValueError, match="threads"):
        config(threads=-1)


def test_acceptance_runs_on_the_logits_device():
    """The target's logits stay on its device (a GPU's): the drafts and counts built on the
    CPU from the wire are moved beside them, never the other way round. A 'meta' tensor
    stands in for a second device, so the check runs where there is no GPU."""
    from target_service import verifier

    rows = [VerifyRow(seq_id=i, expected_cache_len=3, append_token_ids=[1],
                               draft_token_ids=[2, 3][:n],
                               sampling=SamplingParams()) for i, n in enumerate((2, 1))]
    logits = torch.zeros(2, 3, 8, device="meta")
    result = verifier.accept(rows, torch.tensor([[2, 3], [2, 0]]), logits,
                             torch.tensor([2, 1]))
    assert result.num_accepted.device.type == "meta"
    assert result.output_token_ids.shape == (2, 3)


@pytest.fixture(scope="module")
def hosting(model_dirs):
    """A target hosting the tiny Llama's draft: (target client, draft client, target runner,
    draft runner), both clients on its one port."""
    server, port, target_runner, draft_runner = start_hosting_target(*model_dirs["llama"])
    clients = TargetClient(f"127.0.0.1:{port}"), DraftClient(f"127.0.0.1:{port}")
    yield (*clients, target_runner, draft_runner)
    for client in clients:
        client.close()
    server.stop(0)


def test_a_verify_runs_the_hosted_drafts_propose_first_and_verifies_its_tokens(
        hosting, target, draft):
    """The hosted draft proposes inside the verify command what it proposes on its own, and
    the target verifies those tokens as if they had been sent: the same outcome as a propose
    to a draft service followed by a verify of its tokens."""
    hosted_target, hosted_draft, target_runner, draft_runner = hosting
    prompt = [5, 6, 7, 9, 4]
    for client in (hosted_target, hosted_draft, target[0], draft[0]):
        client.prefill([(50, prompt)])
    spec = ProposeSpec(50, 5, 5, [8], GREEDY)
    try:
        [proposal], _ = draft[0].propose(3, False, [spec])
        [expected], _ = target[0].verify(False, [VerifySpec(50, 5, [8],
                                                            proposal.draft_token_ids[:2],
                                                            GREEDY)])
        [outcome], timing, answer = hosted_target.verify(
            False, [VerifySpec(50, 5, [8], [], GREEDY, num_proposed=2)],
            propose=clients.propose_command(3, False, [spec]))
    finally:
        for client in (hosted_target, hosted_draft, target[0], draft[0]):
            client.release([50])
    assert answer.error is None and answer.proposals == [proposal]
    assert outcome == expected  # the first two proposed tokens verified, as sent ones are
    assert 0 < answer.timing.compute_seconds <= timing.compute_seconds
    assert not target_runner.caches and not draft_runner.caches


def test_a_hosted_propose_refused_verifies_no_drafts_and_says_why(hosting):
    """A propose the hosted draft refuses (a cache length it does not hold) leaves its
    caches as they were; the verify still runs, its entry verifying no drafts."""
    hosted_target, hosted_draft, _, draft_runner = hosting
    hosted_target.prefill([(51, [5, 6, 7])])
    hosted_draft.prefill([(51, [5, 6, 7])])
    try:
        [outcome], _, answer = hosted_target.verify(
            False, [VerifySpec(51, 3, [8], [], GREEDY, num_proposed=2)],
            propose=clients.propose_command(2, False, [ProposeSpec(51, 9, 3, [8], GREEDY)]))
        assert isinstance(answer.error, errors.BatchspecError) and not answer.proposals
        assert outcome.num_accepted == 0 and len(outcome.output_token_ids) == 1
        assert draft_runner.caches[51].length == 3
    finally:
        hosted_target.release([51])
        hosted_draft.release([51])


def test_a_propose_in_a_verify_is_refused_where_it_cannot_be_run(hosting, target):
    """A target that hosts no draft refuses a verify that carries a propose; an entry that
    names both proposed and sent drafts is refused, before anything runs."""
    hosted_target, _, _, _ = hosting
    target[0].prefill([(52, [5, 6, 7])])
    hosted_target.prefill([(52, [5, 6, 7])])
    try:
        with pytest.raises(errors.InvalidArgument, match="hosts no draft"):
            target[0].verify(False, [VerifySpec(52, 3, [8], [], GREEDY, num_proposed=1)],
                             propose=clients.propose_command(1, False, [ProposeSpec(52, 3, 3, [8],
                                                                            GREEDY)]))
        with pytest.raises(errors.InvalidArgument, match="num_proposed"):
            hosted_target.verify(False, [VerifySpec(52, 3, [8], [9], GREEDY, num_proposed=1)])
        with pytest.raises(errors.InvalidArgument, match="num_proposed"):
            hosted_target.verify(False, [VerifySpec(52, 3, [8], [], GREEDY, num_proposed=1)])
    finally:
        target[0].release([52])
        hosted_target.release([52])


def test_a_verify_of_rounds_is_refused_where_it_cannot_be_run(hosting):
    """A verify of rounds with token masks, a continuation outside the vocabulary, or of more
    than 64 rounds, is refused before anything runs; the caches stay as they were."""
    hosted_target, hosted_draft, target_runner, draft_runner = hosting
    hosted_target.prefill([(53, [5, 6, 7])])
    hosted_draft.prefill([(53, [5, 6, 7])])
    propose = clients.propose_command(2, False, [ProposeSpec(53, 3, 3, [8], GREEDY)])
    try:
        with pytest.raises(errors.InvalidArgument, match="no token masks"):
            hosted_target.verify(False, [VerifySpec(53, 3, [8], [9], GREEDY,
                                                    token_masks=(b"\xff" * 12,) * 2)],
                                 rounds=2)
        with pytest.raises(errors.InvalidArgument, match="continuation of sequence 53"):
            hosted_target.verify(False, [VerifySpec(53, 3, [8], [9], GREEDY,
                                                    continuation=[10, 96])], rounds=2)
        with pytest.raises(errors.InvalidArgument, match="at most 64"):
            hosted_target.verify(False, [VerifySpec(53, 3, [8], [], GREEDY, num_proposed=2)],
                                 propose=propose, rounds=65)
        assert target_runner.caches[53].length == 3 and draft_runner.caches[53].length == 3
        [outcome], _, answer = hosted_target.verify(
            False, [VerifySpec(53, 3, [8], [], GREEDY, num_proposed=2)], propose=propose,
            rounds=3)
        assert answer.error is None and len(outcome.rounds) == 3
        assert outcome.num_accepted == sum(a for _, a in outcome.rounds)
        assert len(outcome.output_token_ids) == outcome.num_accepted + 3
        assert outcome.cache_len == 3 + len(outcome.output_token_ids)
        assert draft_runner.caches[53].length == answer.proposals[0].cache_len
    finally:
        hosted_target.release([53])
        hosted_draft.release([53])


def test_rounds_verify_a_lookups_line_while_the_outputs_follow_it(target):
    """A verify of rounds without a propose: an entry's drafts, then its continuation, a
    round's worth (as many as its drafts) after each round whose outputs stayed on the line;
    once they leave it, no drafts (a token a round, while another row's line goes on). Every
    output is the target's greedy choice."""
    client, runner, _ = target
    client.prefill([(56, [5, 6, 7])])
    [plain], _ = client.verify(False, [VerifySpec(56, 3, [8], [], GREEDY)], plain_steps=9)
    greedy = plain.output_token_ids  # the target's next 9 tokens after [5, 6, 7, 8]
    client.release([56])
    wrong = [(t + 1) % 96 for t in greedy]
    try:
        client.prefill([(57, [5, 6, 7]), (58, [5, 6, 7])])
        followed, left = client.verify(False, [
            # on the line for two rounds; the third round's second draft is wrong
            VerifySpec(57, 3, [8], greedy[:2], GREEDY, continuation=greedy[2:7] + wrong[7:8]),
            # off the line after the first round: its continuation is wrong at once
            VerifySpec(58, 3, [8], greedy[:2], GREEDY, continuation=wrong[2:])], rounds=3)[0]
        assert followed.rounds == ((2, 2), (2, 2), (2, 1))
        assert followed.output_token_ids == greedy[:8] and followed.num_accepted == 5
        assert left.rounds == ((2, 2), (0, 0), (0, 0))
        assert left.output_token_ids == greedy[:5] and left.num_accepted == 2
        assert runner.caches[57].length == 3 + 1 + 7 and runner.caches[58].length == 3 + 1 + 4
        # once every row has left its line (and no propose runs), the rounds end: the next
        # step's lookup finds more
        client.prefill([(59, [5, 6, 7])])
        [alone], _ = client.verify(False, [VerifySpec(59, 3, [8], greedy[:2], GREEDY,
                                                      continuation=wrong[2:])], rounds=3)
        assert alone.rounds == ((2, 2),) and alone.output_token_ids == greedy[:3]
    finally:
        client.release([57, 58, 59])


def test_rounds_end_where_every_row_output_an_end_of_sequence_but_for_ignore_eos(target,
                                                                               monkeypatch):
    """A row whose first round outputs an end-of-sequence token of the model's ends the
    rounds (it would only be cut); a row of a request that ignores them goes on."""
    client, runner, _ = target
    client.prefill([(60, [5, 6, 7])])
    [plain], _ = client.verify(False, [VerifySpec(60, 3, [8], [], GREEDY)], plain_steps=6)
    greedy = plain.output_token_ids
    client.release([60])
    monkeypatch.setattr(runner, "eos_token_ids", [greedy[2]])  # the first round's last output
    try:
        client.prefill([(61, [5, 6, 7]), (62, [5, 6, 7])])
        line = {"continuation": greedy[2:6]}
        [stops], _ = client.verify(False, [VerifySpec(61, 3, [8], greedy[:2], GREEDY, **line)],
                                   rounds=3)
        [goes_on], _ = client.verify(False, [VerifySpec(62, 3, [8], greedy[:2], GREEDY,
                                                        ignore_eos=True, **line)], rounds=3)
        assert stops.rounds == ((2, 2),) and stops.output_token_ids == greedy[:3]
        assert len(goes_on.rounds) == 2 and goes_on.output_token_ids[:6] == greedy[:6]
    finally:
        client.release([61, 62])


def test_rounds_stop_at_the_first_where_the_propose_names_a_sequence_not_verified(hosting):
    """A propose for two sequences in a verify of one: the result's proposal stays both
    sequences' (the draft's record of each), so no round follows the first."""
    hosted_target, hosted_draft, _, draft_runner = hosting
    for seq_id in (54, 55):
        hosted_target.prefill([(seq_id, [5, 6, 7])])
        hosted_draft.prefill([(seq_id, [5, 6, 7])])
    propose = clients.propose_command(2, False, [ProposeSpec(s, 3, 3, [8], GREEDY)
                                                 for s in (54, 55)])
    try:
        [outcome], _, answer = hosted_target.verify(
            False, [VerifySpec(54, 3, [8], [], GREEDY, num_proposed=2)], propose=propose,
            rounds=3)
        assert len(outcome.rounds) == 1
        assert [p.seq_id for p in answer.proposals] == [54, 55]
        assert all(draft_runner.caches[p.seq_id].length == p.cache_len
                   for p in answer.proposals)
    finally:
        hosted_target.release([54, 55])
        hosted_draft.release([54, 55])


def test_memory_the_allocator_holds_free_goes_back_to_the_system_after_start_up():
    """warm_up ends by returning what glibc keeps free in its heap (a calibration's batches
    leave hundreds of MB there) and logs the resident memory left."""
    def resident_mb() -> float:
        status = pathlib.Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    held = [bytearray(100_000) for _ in range(3000)]  # 300 MB under glibc's mmap threshold
    pin = bytearray(100_000)  # allocated after them: the heap's top stays in use
    del held
    before = resident_mb()
    after = service.return_free_memory()
    assert after is not None and after < before - 200
    del pin
