"""Greedy output through the real gRPC services equals the target alone at batch 1 (float32,
CPU), under concurrency, mixed prompt lengths, batch sizes 1..16, K 1..8 and early stops."""
import concurrent.futures
import json
import random

import grpc
import pytest
from transformers import AutoModelForCausalLM

from batchspec.v1 import generate_pb2
from coordinator import clients

import tiny_models
from conftest import TEST_DEVICE, running_stack, wait_for


def random_requests(seed: int, count: int):
    rng = random.Random(seed)
    return [([rng.randrange(4, tiny_models.VOCAB) for _ in range(rng.randint(1, 24))],
             rng.randint(1, 40)) for _ in range(count)]


def generate_all(stub, requests, **fields):
    def one(request):
        prompt, max_new = request
        responses = list(stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=max_new, **fields), timeout=120))
        return [t for r in responses for t in r.token_ids], responses[-1]

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


@pytest.fixture(scope="module")
def references(model_dirs):
    cache = {}

    def reference(arch, prompt, max_new):
        key = (arch, tuple(prompt), max_new)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(model_dirs[arch][0]).to(TEST_DEVICE)
            cache[key] = tiny_models.reference_greedy(model, prompt, max_new)
        return cache[key]
    return reference


@pytest.mark.parametrize("arch,batch_size,num_draft_tokens", [
    ("llama", 1, 1), ("llama", 4, 3), ("llama", 16, 8), ("llama", 8, 5),
    ("gpt2", 1, 2), ("gpt2", 4, 4), ("gpt2", 16, 6), ("gpt2", 8, 8),
])
def test_greedy_output_is_the_targets_own(model_dirs, references, arch, batch_size,
                                          num_draft_tokens):
    requests = random_requests(seed=batch_size * 10 + num_draft_tokens, count=32)
    target_dir, draft_dir = model_dirs[arch]
    with running_stack(target_dir, draft_dir, batch_size=batch_size,
                       num_draft_tokens=num_draft_tokens) as stack:
        results = generate_all(stack.stub(), requests)
        assert stack.router.stats.num_steps > 0
        # released just after the last tokens are streamed
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
    mismatches = [i for i, ((prompt, max_new), (tokens, _)) in enumerate(zip(requests, results))
                  if tokens != references(arch, prompt, max_new)]
    assert not mismatches, f"requests {mismatches} differ from target-only greedy decoding"
    finishes = {last.finish_reason for _, last in results}
    assert generate_pb2.FINISH_REASON_STOP in finishes  # early stops were exercised
    assert generate_pb2.FINISH_REASON_LENGTH in finishes
    accepted = sum(last.stats.num_accepted_tokens for _, last in results)
    drafted = sum(last.stats.num_drafted_tokens for _, last in results)
    assert 0 < accepted < drafted  # the draft was sometimes right and sometimes wrong
    for (prompt, max_new), (tokens, last) in zip(requests, results):
        assert len(tokens) <= max_new
        assert last.stats.num_generated_tokens == len(tokens)
        assert last.stats.num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("arch,batch_size,num_draft_tokens,overlap", [
    ("llama", 1, 3, "off"), ("llama", 8, 4, "on"), ("gpt2", 4, 5, "off")])
def test_a_draft_the_target_hosts_drafts_in_the_verify_and_stays_exact(
        model_dirs, references, arch, batch_size, num_draft_tokens, overlap, monkeypatch):
    """The draft hosted by the target service: its proposals ride in the verify command (no
    propose of its own reaches it), and every output is the target alone's."""
    requests = random_requests(seed=batch_size + 7, count=16)
    target_dir, draft_dir = model_dirs[arch]
    calls = []
    monkeypatch.setattr(clients.DraftClient, "propose", lambda *a, **k: calls.append(a))
    with running_stack(target_dir, draft_dir, batch_size=batch_size, drafts=("hosted",),
                       num_draft_tokens=num_draft_tokens, overlap=overlap) as stack:
        results = generate_all(stack.stub(), requests)
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
        engine = stack.router.engines[0]
        assert engine.drafter.hosted(engine.peers.kinds[0])
    mismatches = [i for i, ((prompt, max_new), (tokens, _)) in enumerate(zip(requests, results))
                  if tokens != references(arch, prompt, max_new)]
    assert not mismatches, f"requests {mismatches} differ from target-only greedy decoding"
    accepted = sum(last.stats.num_accepted_tokens for _, last in results)
    drafted = sum(last.stats.num_drafted_tokens for _, last in results)
    assert 0 < accepted < drafted
    assert not calls  # every proposal came with a verify


@pytest.mark.parametrize("arch,batch_size,num_draft_tokens", [
    ("llama", 8, 3), ("gpt2", 16, 2)])
def test_rounds_of_the_hosted_draft_in_one_command_stay_exact(
        model_dirs, references, arch, batch_size, num_draft_tokens, tmp_path):
    """Requests that all fit the batch (none waits): the hosted draft's cohorts run several
    rounds of proposing and verifying in one verify command, rows accepting different numbers
    of drafts in each, and every output is the target alone's; the stats count every
    round's drafts."""
    requests = random_requests(seed=batch_size + 31, count=batch_size)
    requests = [(prompt, max_new + 20) for prompt, max_new in requests]
    target_dir, draft_dir = model_dirs[arch]
    log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, draft_dir, batch_size=batch_size, drafts=("hosted",),
                       num_draft_tokens=num_draft_tokens, overlap="off", draft_rounds=4,
                       step_log=str(log)) as stack:
        results = generate_all(stack.stub(), requests)
        assert wait_for(lambda: not stack.target_runner.caches and not stack.draft_runner.caches)
    mismatches = [i for i, ((prompt, max_new), (tokens, _)) in enumerate(zip(requests, results))
                  if tokens != references(arch, prompt, max_new)]
    assert not mismatches, f"requests {mismatches} differ from target-only greedy decoding"
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    rounds = [s["rounds"] for s in steps]
    assert max(rounds) == 4 and sum(r > 1 for r in rounds) >= 3
    accepted = sum(last.stats.num_accepted_tokens for _, last in results)
    drafted = sum(last.stats.num_drafted_tokens for _, last in results)
    assert 0 < accepted < drafted
    # each round drafts K for a row (this policy's fixed K): more than one round's worth
    passes = sum(last.stats.num_target_forward_passes for _, last in results)
    assert drafted > num_draft_tokens * sum(1 for s in steps) / 2
    assert passes >= len(steps)


@pytest.mark.parametrize("arch,batch_size", [("llama", 1), ("gpt2", 4)])
def test_adaptive_draft_length_stays_exact(model_dirs, references, arch, batch_size):
    """Greedy rows' drafts are cut where the draft is unsure: fewer drafts, same output."""
    requests = random_requests(seed=7 + batch_size, count=16)
    target_dir, draft_dir = model_dirs[arch]
    k = 6
    # about half of these tiny drafts' choices have a probability below 0.15
    with running_stack(target_dir, draft_dir, batch_size=batch_size, num_draft_tokens=k,
                       min_draft_confidence=0.15) as stack:
        results = generate_all(stack.stub(), requests)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == references(arch, prompt, max_new)
    drafted = sum(last.stats.num_drafted_tokens for _, last in results)
    passes = sum(last.stats.num_target_forward_passes for _, last in results)
    # rows drafted, and the cut kept fewer than half of the K drafts a step could verify
    assert 0 < drafted < k * passes / 2


def test_both_grouped_and_realigned_steps_happen_and_stay_exact(model_dirs, references):
    requests = random_requests(seed=99, count=24)
    target_dir, draft_dir = model_dirs["gpt2"]
    with running_stack(target_dir, draft_dir, batch_size=6, num_draft_tokens=3) as stack:
        results = generate_all(stack.stub(), requests)
        stats = stack.router.stats
    assert stats.num_grouped_steps > 0 and stats.num_realigned_steps > 0
    assert all(tokens == references("gpt2", p, m) for (p, m), (tokens, _) in zip(requests, results))


def test_ignore_eos_runs_to_max_new_tokens(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=4) as stack:
        results = generate_all(stack.stub(), [([5, 6, 7], 60)] * 4, ignore_eos=True)
    for tokens, last in results:
        assert len(tokens) == 60 and last.finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_no_row_drafts_past_the_tokens_it_may_still_commit(model_dirs):
    """A step commits at most a row's drafts and one more token, so a row drafts at most its
    remaining tokens but one: none when one token is left. The target serves as its own draft
    (every draft accepted, had it been verified) at a fixed K = 4: before this cap a request
    for one token verified four drafts, and one for six verified eight."""
    target_dir, _ = model_dirs["llama"]
    requests = [([5, 6, 7], n) for n in (1, 2, 3, 5, 6, 9)]
    with running_stack(target_dir, target_dir, batch_size=1, num_draft_tokens=4,
                       overlap="off") as stack:
        results = generate_all(stack.stub(), requests, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    drafted = {}
    for (prompt, n), (tokens, last) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, n, ignore_eos=True)
        drafted[n] = last.stats.num_drafted_tokens
    assert drafted[1] == 0 and drafted[2] <= 1, drafted
    # each step drafts at most what is left but one, and commits its accepted drafts and one
    # more: with every draft accepted, n tokens take ceil(n / 5) steps and n - steps drafts
    assert all(d <= n - 1 for n, d in drafted.items()), drafted


BAD_REQUESTS = [
    ({"max_new_tokens": 5}, "empty"),
    ({"prompt_token_ids": [5], "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_token_ids": [5], "max_new_tokens": 100_000}, "max_new_tokens"),
    ({"prompt_token_ids": [5] * 250, "max_new_tokens": 10}, "context"),
    ({"prompt_token_ids": [5, tiny_models.VOCAB], "max_new_tokens": 5}, "vocabulary"),
    ({"prompt_token_ids": [-1], "max_new_tokens": 5}, "vocabulary"),
    ({"prompt": "hello", "max_new_tokens": 5}, "tokenizer"),
    ({"prompt_token_ids": [5], "max_new_tokens": 5, "temperature": -1.0}, "temperature"),
    ({"prompt_token_ids": [5], "max_new_tokens": 5, "top_p": 0.0}, "top_p"),
    ({"prompt_token_ids": [5], "max_new_tokens": 5, "top_p": 1.5}, "top_p"),
    ({"prompt_token_ids": [5], "max_new_tokens": 5, "top_k": -2}, "top_k"),
    ({"prompt_token_ids": [5], "max_new_tokens": 5, "stop": ["x"]}, "tokenizer"),
]


def test_bad_input_is_refused_clearly_while_others_go_on(model_dirs, references):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=4) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            good = pool.submit(generate_all, stub, [([7, 8, 9], 30)] * 3)
            for fields, word in BAD_REQUESTS:
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=30))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
                assert word in caught.value.details(), caught.value.details()
            results = good.result(timeout=120)
    expected = references("llama", [7, 8, 9], 30)
    assert all(tokens == expected for tokens, _ in results)


def test_clients_coming_and_going_are_seated_in_place_and_stay_exact(model_dirs, references,
                                                                      monkeypatch):
    """Closed-loop clients: each sends its next request as soon as its last one ends, so
    sequences leave the running batch and newcomers join it all along. Both services keep
    their batch (the newcomers copied into the rows that left) and every output stays the
    target's own."""
    from batchspec.runtime import runner as runner_lib

    seated = {}
    real_seat = runner_lib.seat_in_place

    def counting(runner, caches, reserve):
        placed = real_seat(runner, caches, reserve)
        if placed is not None and any(c.home is None or c.home is not caches[0].home
                                      for c in caches):  # someone new took a row
            seated[runner.name] = seated.get(runner.name, 0) + 1
        return placed

    monkeypatch.setattr(runner_lib, "seat_in_place", counting)
    target_dir, draft_dir = model_dirs["llama"]
    # 12 clients in a batch of up to 12 rows: a row that leaves stays vacant until the next
    # newcomer (12 // 8 = 1 vacancy allowed), so seating does not hinge on a client's next
    # request arriving in the very step its last one ended
    clients = [random_requests(seed=300 + c, count=3) for c in range(12)]
    with running_stack(target_dir, draft_dir, batch_size=12, num_draft_tokens=3) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
            results = list(pool.map(lambda requests: generate_all_in_turn(stub, requests),
                                    clients))
        names = stack.target_runner.name, stack.draft_runner.name
    for requests, answers in zip(clients, results):
        for (prompt, max_new), tokens in zip(requests, answers):
            assert tokens == references("llama", prompt, max_new)
    assert all(seated.get(name, 0) > 0 for name in names), seated


def generate_all_in_turn(stub, requests) -> list[list[int]]:
    """One client: each request sent once the one before it has ended."""
    answers = []
    for prompt, max_new in requests:
        responses = stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=max_new), timeout=120)
        answers.append([t for r in responses for t in r.token_ids])
    return answers


def test_a_draft_of_another_vocabulary_never_fails_a_request(model_dirs, references, tmp_path,
                                                             caplog):
    """A draft whose vocabulary is not the target's (28 tokens against 96, and no tokenizer
    files to tell at start-up) refuses the target's token ids it does not know: the rows it
    refused decode without it, the refusal is logged, and every answer is the target
    alone's."""
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaForCausalLM(LlamaConfig(
        vocab_size=28, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256))
    small.save_pretrained(tmp_path / "characters")
    requests = random_requests(91, 6)
    with caplog.at_level(logging.WARNING, logger="coordinator.drafting"), \
            running_stack(model_dirs["llama"][0], str(tmp_path / "characters"),
                          batch_size=4) as stack:
        outputs = generate_all(stack.stub(), requests)
    for (prompt, max_new), (tokens, _) in zip(requests, outputs):
        assert tokens == references("llama", prompt, max_new)
    assert "refused a command" in caplog.text


def test_rounds_of_the_lookups_lines_stay_exact(model_dirs, tmp_path, monkeypatch):
    """The n-gram draft in the coordinator (K every step, nothing waiting): its rows verify
    a lookup's line in rounds, several a command, rows following and leaving their lines in
    different rounds, and every answer, greedy and seeded-sampled, is the target alone's
    (Llama and GPT-2, and beside the hosted draft: both kinds' rows in one command of
    rounds); the lookup's record of what it holds stays right through it."""
    from batchspec import ngram
    from batchspec.params import SamplingParams

    looked_up = []  # (its index, what it held) each time the lookup proposed for a sequence
    propose = ngram.NgramIndex.propose
    monkeypatch.setattr(ngram.NgramIndex, "propose", lambda index, k: (
        looked_up.append((index, list(index.tokens))), propose(index, k))[1])
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    # prompts whose greedy answers go on to repeat themselves (the tiny models loop), so
    # that the lookup finds lines the target follows
    rng = random.Random(11)
    prompts = [[rng.randrange(4, tiny_models.VOCAB) for _ in range(8)] for _ in range(3)]
    steps = []
    # (the hosted draft beside it: their rows' rounds in one command)
    for arch, drafts in (("llama", ("local:ngram",)), ("gpt2", ("local:ngram",)),
                         ("llama", ("hosted", "local:ngram"))):
        target_dir, draft_dir = model_dirs[arch]
        model = AutoModelForCausalLM.from_pretrained(target_dir)
        log = tmp_path / f"{arch}-{len(drafts)}.jsonl"
        with running_stack(target_dir, draft_dir, batch_size=4, num_draft_tokens=3,
                           overlap="off", drafts=drafts, draft_rounds=4,
                           step_log=str(log)) as stack:
            looked_up.clear()  # (the lookup timed at start-up)

            def ask(prompt, fields):
                return [t for r in stack.stub().Generate(generate_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_new_tokens=40, ignore_eos=True, **fields),
                    timeout=120) for t in r.token_ids]

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                greedy = list(pool.map(lambda p: ask(p, {}), prompts))
            # alone, a row rolls its lookup back no further than its own record says
            alone = [ask(p, {}) for p in prompts]
            answers = [ask(p, {"temperature": 0.7, "top_p": 0.9, "seed": 5}) for p in prompts]
        assert alone == greedy
        for prompt, tokens, drawn in zip(prompts, greedy, answers):
            assert tokens == tiny_models.reference_greedy(model, prompt, 40, ignore_eos=True)
            assert drawn == tiny_models.reference_sampled(model, prompt, 40, sampled)
        steps += [json.loads(line) for line in log.read_text().splitlines()]
        if len(drafts) > 1:  # a command of rounds with rows of both kinds
            assert any(len({k for k in s["kinds"] if k is not None}) == 2 and s["rounds"] > 1
                       for s in steps[-len(log.read_text().splitlines()):])
        # the lookup proposed from committed tokens only: its record of what it holds never
        # kept a draft the target did not commit (what it held of a sequence each time: a
        # prefix of one whole sequence)
        done = [p + a for p, a in zip(prompts * 2, greedy + answers)]
        held = {}
        for index, tokens in looked_up:
            held.setdefault(id(index), []).append(tokens)
        assert held and all(any(all(d[:len(t)] == t for t in seen) for d in done)
                            for seen in held.values())
        looked_up.clear()
    lined = [s for s in steps if s["rounds"] > 1]
    assert lined and sum(sum(s["accepted"]) for s in lined) > 0
    # a round verifies no more than K drafts a row: a row followed its line past a round
    assert any(max(s["drafts"]) > 3 for s in lined)
