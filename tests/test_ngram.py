"""The model-free n-gram draft: its lookup, its cache contract, its service without torch,
and the coordinator choosing per sequence between it and the model draft."""
import dataclasses
import random
import subprocess
import sys
import types
from collections import Counter

import pytest
from test_sampling_e2e import NUM_SAMPLES, assert_follows_the_target, sample_service
from transformers import AutoModelForCausalLM

from batchspec import errors
from batchspec.ngram import NgramIndex, NgramStore
from batchspec.params import SamplingParams
from batchspec.runtime.rows import ProposeRow
from batchspec.v1 import generate_pb2
from coordinator import goodput, verifying
from coordinator import policy as policy_lib
from coordinator.clients import Proposal, ProposeSpec
from coordinator.local_draft import LocalNgram

import tiny_models
from conftest import running_stack, wait_for
from test_exactness import generate_all, random_requests


# ---- the lookup ---------------------------------------------------------------------------------
def index_of(tokens, min_n=2, max_n=4):
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index



def rows(*fields) -> list[ProposeRow]:
    """Propose rows from (seq_id, expected_cache_len, keep_len, append_token_ids)."""
    return [ProposeRow(*f, SamplingParams()) for f in fields]

def test_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    assert index_of(tokens).propose(3) == [3, 4, 6]  # "6 7" last seen at 6-7, then 3 4 6
    longer = [1, 6, 7, 8, 8, 2, 6, 7, 9, 9, 1, 6, 7]
    assert index_of(longer).propose(2) == [8, 8]  # "1 6 7" (3 tokens) beats the later "6 7"


def test_a_continuation_that_reaches_the_end_repeats_the_loop():
    assert index_of([1, 2, 3, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]


def test_no_earlier_occurrence_proposes_nothing():
    assert index_of([1, 2, 3, 4, 5]).propose(4) == []
    assert index_of([7]).propose(2) == []


def test_truncation_leaves_the_index_as_if_built_from_the_kept_tokens():
    rng = random.Random(3)
    index = NgramIndex(1, 3)
    for _ in range(300):
        if index.length and rng.random() < 0.3:
            index.truncate(rng.randrange(index.length))
        else:
            index.extend([rng.randrange(4) for _ in range(rng.randint(1, 5))])
        fresh = index_of(index.tokens, 1, 3)
        assert index.table == fresh.table
        assert index.propose(4) == fresh.propose(4)


# ---- the cache contract -------------------------------------------------------------------------
def test_the_coordinators_own_ngram_draft_keeps_the_services_contract():
    """local:ngram answers the engine as a DraftClient of the n-gram service would: the same
    lengths, proposals and typed refusals; one instance for its life."""
    local = LocalNgram()
    info = local.describe()
    assert (info.model, info.num_sequences, info.instance_id) == ("ngram", 0, local.instance)
    assert info.step_costs and local.probe().done() and local.probe().info() == info
    # on the host's CPU, as the n-gram service reports: --overlap auto stays off where every
    # model service runs on the CPU too
    peers = types.SimpleNamespace(kinds=[None], draft_up=True)
    verifier = verifying.Verifier(peers=peers, pool=None, overlap="auto")
    verifier.configure(dataclasses.replace(info, model="target"), [info])
    assert info.device == "cpu" and not verifier.overlapping()
    verifier.shutdown()
    assert local.prefill([(1, [4, 5, 6, 4, 5]), (2, [9])]) == [5, 1]
    specs = [ProposeSpec(1, 5, 5, [6], SamplingParams()), ProposeSpec(2, 1, 1, [8],
                                                                      SamplingParams(0.8))]
    proposals, timing = local.propose(3, False, specs, timeout=1.0)
    assert proposals == [Proposal(1, [4, 5, 6], 8), Proposal(2, [], 2)]
    assert timing.compute_seconds > 0
    assert local.trim([(1, 8, 6)]) == [6]
    with pytest.raises(errors.FailedPrecondition):
        local.propose(2, False, [ProposeSpec(1, 8, 6, [6], SamplingParams())])
    with pytest.raises(errors.InvalidArgument):
        local.propose(0, False, [ProposeSpec(1, 6, 6, [6], SamplingParams())])
    assert local.describe().num_cached_tokens == 6 + 2
    assert local.release([1, 2]) == 0
    with pytest.raises(errors.NotFound):
        local.release([1])


def test_store_keeps_the_model_drafts_cache_lengths():
    store = NgramStore()
    assert store.prefill([(1, [4, 5, 6, 4, 5]), (2, [9])]) == [5, 1]
    # seq 1 appends its last committed token (6): "5 6" occurred, 4 5 6 ... follows
    [p1, p2] = store.propose(rows((1, 5, 5, [6]), (2, 1, 1, [8])), 3)
    assert p1.draft_token_ids == [4, 5, 6] and p1.cache_len == 5 + 1 + 3 - 1
    assert p2.draft_token_ids == [] and p2.cache_len == 2  # nothing found: nothing drafted
    # the coordinator rolls back to what it verified and appends the new committed tokens
    [again] = store.propose(rows((1, 8, 7, [4, 9])), 2)
    assert store.caches[1].tokens[:9] == [4, 5, 6, 4, 5, 6, 4, 4, 9]


def test_store_refuses_what_the_model_runner_refuses():
    store = NgramStore()
    store.prefill([(1, [1, 2, 3])])
    with pytest.raises(errors.AlreadyExists):
        store.prefill([(1, [1])])
    with pytest.raises(errors.FailedPrecondition):
        store.propose(rows((1, 2, 2, [3])), 2)  # the service holds 3, not 2
    with pytest.raises(errors.NotFound):
        store.propose(rows((7, 0, 0, [3])), 2)
    with pytest.raises(errors.InvalidArgument):
        store.propose(rows((1, 3, 4, [3])), 2)  # keep past the cache
    with pytest.raises(errors.InvalidArgument):
        store.propose(rows((1, 3, 3, [-1])), 2)
    with pytest.raises(errors.InvalidArgument):
        store.trim([(1, 3, 5)])
    assert store.caches[1].tokens == [1, 2, 3]  # nothing refused changed anything
    assert store.release([1]) == 0
    with pytest.raises(errors.NotFound):
        store.release([1])


@pytest.mark.slow
def test_the_ngram_service_never_imports_torch():
    code = ("import sys; from draft_service import __main__ as m, ngram_servicer; "
            "from batchspec.runtime import service; "
            "config = service.ServiceConfig(model='ngram'); "
            "make, build, warm = m.hosting(config); store = build(config); warm(store); "
            "assert store.step_costs; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"


# ---- the policy choosing a draft per row --------------------------------------------------------
def two_kind_policy():
    grid = [(r, t) for r in (1, 8, 32) for t in (1, 2, 5, 8)]
    target = goodput.ServiceCost(goodput.ForwardCosts([(r, t, 0.03 + 0.004 * t + 0.0003 * r * t)
                                                       for r, t in grid]))
    model = goodput.ServiceCost(goodput.ForwardCosts([(r, t, 0.002 + 0.0001 * r * t)
                                                      for r, t in grid]))
    ngram = goodput.ServiceCost(goodput.ForwardCosts([(r, t, 0.0001) for r, t in grid]))
    return goodput.GoodputPolicy(goodput.GoodputConfig(max_k=4), [model, ngram], target)


def test_each_row_gets_the_draft_it_accepts_best_per_cost():
    p = two_kind_policy()
    copying = goodput.Row(choices=(goodput.Option(0.3), goodput.Option(0.95)))
    chatting = goodput.Row(choices=(goodput.Option(0.8), goodput.Option(0.05)))
    plan = p.plan([copying, chatting])
    assert plan.kinds == [1, 0] and min(plan.k) > 0
    # nearly free and well accepted: the n-gram drafts even where the model would not pay
    alone = p.plan([goodput.Row(choices=(goodput.Option(0.1), goodput.Option(0.9)))] * 32)
    assert set(alone.kinds) == {1}


def test_a_draft_left_unused_for_long_is_explored():
    p = two_kind_policy()
    stale = goodput.Option(0.01, explore=True)
    plan = p.plan([goodput.Row(choices=(goodput.Option(0.9), stale))] * 4)
    assert 1 in plan.kinds


# ---- through the services -----------------------------------------------------------------------
def ngram_store(stack):
    """The n-gram draft's store: its service's, or the coordinator's own (local:ngram)."""
    client = stack.router.engines[0].peers.kinds[-1].client
    return client.store if isinstance(client, LocalNgram) else stack.drafts[-1][2]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("drafts", [("ngram",), ("model", "ngram"), ("model", "local:ngram")])
def test_greedy_output_is_exact_with_the_ngram_draft_and_the_router(model_dirs, arch, drafts):
    target_dir, draft_dir = model_dirs[arch]
    requests = random_requests(seed=29, count=16)
    # prompts that repeat themselves, so the lookup finds something to propose
    requests += [(p * 3, 40) for p, _ in random_requests(seed=30, count=6)]
    # every row drafts K, with the kind it accepts best (or one it must explore): the
    # mechanics of switching kinds, which the goodput policy could turn off for tiny models;
    # one token a command, so the lookup is asked at every token (a step whose lookup found
    # nothing would decode four, and these tiny models' answers give it few matches to find)
    with running_stack(target_dir, draft_dir, batch_size=6, drafts=drafts,
                       plain_steps=1) as stack:
        results = generate_all(stack.stub(), requests)
        store = ngram_store(stack)
        assert wait_for(lambda: not store.caches)  # every sequence released
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
    accepted = sum(last.stats.num_accepted_tokens for _, last in results)
    assert accepted > 0


def test_the_router_uses_both_drafts_and_survives_losing_one(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    rng = random.Random(8)
    requests = [([rng.randrange(4, tiny_models.VOCAB) for _ in range(6)] * 4, 30)
                for _ in range(8)] + random_requests(seed=31, count=8)
    with running_stack(target_dir, draft_dir, batch_size=8, drafts=("model", "ngram"),
                       plain_steps=1) as stack:  # a draft asked at every token (see above)
        engine = stack.router.engines[0]
        drafter = engine.drafter
        counts = Counter()
        original = drafter._propose

        def counting(kind, step, rows, *args):
            counts[kind.index] += len(rows)
            return original(kind, step, rows, *args)
        drafter._propose = counting
        generate_all(stack.stub(), requests)
        # the n-gram draft does poorly on a tiny random model, but it was tried
        assert counts[0] > 0 and counts[1] >= drafter.policy.planner.config.min_evidence
        stack.drafts[1][0].stop(0)  # the n-gram service goes away
        # new rows are cold there and it drafts poorly: let a starved kind be tried soon, so
        # the next round calls it and finds it gone
        planner = drafter.policy.planner
        planner.config = dataclasses.replace(planner.config, starve_every=4)
        results = generate_all(stack.stub(), requests)
        assert not engine.peers.kinds[1].up and engine.peers.kinds[0].up
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)


@pytest.mark.parametrize("drafts", [("ngram",), ("model", "ngram"), ("local:ngram",)])
def test_sampling_with_point_mass_proposals_follows_the_target(model_dirs, drafts):
    target_dir, draft_dir = model_dirs["llama"]
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]  # the lookup proposes 13 11 12 ...
    with running_stack(target_dir, draft_dir, batch_size=16, num_draft_tokens=3,
                       drafts=drafts) as stack:
        ours = sample_service(stack.stub(), range(NUM_SAMPLES), prompt=prompt)
        drafted = stack.router.stats.num_sampled_rows
    assert drafted > 0  # lookups were verified for sampled rows
    assert_follows_the_target(ours, target_dir, prompt)


def test_a_seeded_request_repeats_with_the_router(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    with running_stack(target_dir, draft_dir, batch_size=1, drafts=("model", "ngram")) as stack:
        alone = sample_service(stack.stub(), [7, 8], prompt=prompt)
    with running_stack(target_dir, draft_dir, batch_size=16, drafts=("model", "ngram")) as stack:
        crowd = sample_service(stack.stub(), [7, 8] + list(range(100, 120)), prompt=prompt)[:2]
    assert alone == crowd


def test_sampled_rows_draft_with_the_lookup_alone_under_goodput_and_repeat(model_dirs):
    """With the n-gram draft alone and the goodput policy planning (no step-aside yardstick
    first), sampled rows get the lookup's proposals (asked before planning, like every row)
    and a seeded request still repeats."""
    target_dir, draft_dir = model_dirs["llama"]
    prompt = [11, 12, 13, 11, 12, 13, 11, 12]
    runs = []
    for batch_size, seeds in ((1, [7, 8]), (16, [7, 8] + list(range(100, 114)))):
        with running_stack(target_dir, draft_dir, batch_size=batch_size, drafts=("ngram",),
                           draft_policy="goodput", step_aside=False, plain_steps=1) as stack:
            runs.append(sample_service(stack.stub(), seeds, prompt=prompt)[:2])
            assert stack.router.stats.num_sampled_rows > 0  # proposals went to sampled rows
    assert runs[0] == runs[1]


def test_generate_over_the_ngram_draft_alone_reports_drafts(model_dirs):
    target_dir, draft_dir = model_dirs["gpt2"]
    with running_stack(target_dir, draft_dir, drafts=("ngram",)) as stack:
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=[5, 6, 7, 8] * 5, max_new_tokens=30, ignore_eos=True), timeout=60))
    stats = responses[-1].stats
    assert stats.num_generated_tokens == 30 and stats.num_drafted_tokens > 0


def test_a_draft_whose_vocabulary_does_not_fit_is_refused_at_start(model_dirs, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from coordinator import __main__ as coordinator_main
    from coordinator.config import CoordinatorConfig

    from conftest import start_draft, start_ngram, start_target

    wide = tmp_path / "wide-draft"
    GPT2LMHeadModel(GPT2Config(vocab_size=tiny_models.VOCAB + 32, n_embd=32, n_layer=1,
                               n_head=2, n_positions=256)).save_pretrained(wide)
    target, target_port, _, _ = start_target(model_dirs["llama"][0])
    drafts = [start_ngram(), start_draft(str(wide))]
    try:
        config = CoordinatorConfig(
            targets=(f"127.0.0.1:{target_port}",),
            drafts=tuple(f"127.0.0.1:{port}" for _, port, _, _ in drafts), port=0,
            connect_timeout_s=10)
        with pytest.raises(errors.FailedPrecondition, match="128 tokens against 96"):
            coordinator_main.start(config)
    finally:
        target.stop(0)
        for server, _, _, _ in drafts:
            server.stop(0)


def test_an_offered_proposal_costs_nothing_more_and_counts_only_its_tokens():
    grid = [(r, t) for r in (1, 8) for t in (1, 2, 5)]
    target = goodput.ServiceCost(goodput.ForwardCosts([(r, t, 0.03) for r, t in grid]))
    costly = goodput.ServiceCost(goodput.ForwardCosts([(r, t, 0.05) for r, t in grid]))
    p = goodput.GoodputPolicy(goodput.GoodputConfig(max_k=4), [costly], target)
    # asked again, the draft would cost more than it returns; already proposed, it pays
    assert p.plan([goodput.Row(choices=(goodput.Option(0.9),))]).k == [0]
    offered = p.plan([goodput.Row(choices=(goodput.Option(0.9, offered=3),))])
    assert offered.k[0] > 0 and offered.kinds == [0]
    # its expected gain is that of the tokens it has, not of K
    one = p._best_for([goodput.Row(choices=(goodput.Option(0.9, offered=1),))], 4, (0,))
    four = p._best_for([goodput.Row(choices=(goodput.Option(0.9, offered=4),))], 4, (0,))
    assert one.tokens_per_s * 2.0 / goodput.expected_tokens(0.9, 1) == pytest.approx(
        four.tokens_per_s * 2.0 / goodput.expected_tokens(0.9, 4))


def test_the_lookup_is_asked_for_every_row_and_its_misses_are_no_rejections(model_dirs,
                                                                            monkeypatch):
    monkeypatch.setattr(policy_lib, "ASK_USE_FLOOR", 0.0)  # due every step (see below)
    # a tiny target's forward costs a millisecond and a lookup tens of microseconds: 5% of
    # the one is the other, give or take the host's noise; the model draft costs ~the target
    monkeypatch.setattr(policy_lib, "ASK_FIRST_SHARE", 0.3)
    target_dir, draft_dir = model_dirs["llama"]
    rng = random.Random(9)
    requests = [([rng.randrange(4, tiny_models.VOCAB) for _ in range(6)] * 4, 30)
                for _ in range(6)] + random_requests(seed=32, count=6)
    # the planner on every step (stepping aside asks no draft: a step it takes is plain)
    # one token a command: the lookup asked at every token (see above)
    with running_stack(target_dir, draft_dir, batch_size=6, drafts=("model", "ngram"),
                       draft_policy="goodput", step_aside=False, plain_steps=1) as stack:
        drafter = stack.router.engines[0].drafter
        assert drafter.policy.asked_first() == [1]  # the lookup, not the model
        counts = Counter()
        propose, draft, verified = drafter._propose, drafter.draft, drafter.observe
        observe = drafter.policy.planner.observe

        def counting_propose(kind, step, rows, *args):
            counts[f"asked {kind.index}"] += len(rows)
            return propose(kind, step, rows, *args)

        def counting_draft(seqs, *args):
            counts["rows"] += len(seqs)
            return draft(seqs, *args)

        def counting_verified(row, outcome):
            counts["verified lookups"] += row.kind_index == 1 and row.num_drafts > 0
            return verified(row, outcome)

        def counting_observe(state, num_drafts, num_accepted, kind=0):
            counts["lookup evidence"] += kind == 1 and num_drafts > 0
            return observe(state, num_drafts, num_accepted, kind)
        drafter._propose, drafter.draft, drafter.observe = (counting_propose, counting_draft,
                                                            counting_verified)
        drafter.policy.planner.observe = counting_observe
        results = generate_all(stack.stub(), requests)
        # every row of every step was looked up once, before planning
        assert counts["asked 1"] == counts["rows"] > 0
        # the lookup's evidence is its verified proposals only: a miss is no rejection
        assert counts["lookup evidence"] == counts["verified lookups"] > 0
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)


def steps_due(kind: policy_lib.KindModel, steps: int, tokens: int = 1) -> list[bool]:
    """Whether `kind` is asked at each of `steps` steps that decode `tokens` tokens a row."""
    due = []
    for _ in range(steps):
        due.append(kind.ask_due())
        kind.decoded(tokens)
    return due


def idle_kind() -> policy_lib.KindModel:
    kind = policy_lib.KindModel()
    assert all(steps_due(kind, 5))  # a fresh kind is asked every step
    asks = 0
    while kind.ask_use >= policy_lib.ASK_USE_FLOOR:
        assert kind.ask_due()
        kind.asked(False)
        kind.decoded(1)
        asks += 1
    assert asks > 10  # a run of unused asks, not one, makes it idle
    return kind


def test_a_lookup_whose_offers_go_unused_is_asked_only_every_few_steps():
    kind = idle_kind()
    due = steps_due(kind, 4 * policy_lib.IDLE_ASK_EVERY)
    assert sum(due) == 4 and due[policy_lib.IDLE_ASK_EVERY - 1]  # evidence keeps coming
    kind.asked(True)  # one ask a plan drafted with: asked every step again
    assert kind.ask_use >= policy_lib.ASK_USE_FLOOR and all(steps_due(kind, 5))


def test_an_idle_lookup_is_paced_in_tokens_not_commands():
    """Where each command decodes several tokens a row (plain steps), an idle lookup is asked
    as often in a sequence's tokens as where each decodes one: a sequence that starts to
    repeat itself is found as soon."""
    every = policy_lib.IDLE_ASK_EVERY
    for tokens, due in ((every, [True] * 8), (every // 2, [i % 2 == 1 for i in range(8)])):
        kind = idle_kind()
        while not kind.ask_due():  # a step that asks it, of `tokens` tokens a row
            kind.decoded(1)
        kind.decoded(tokens)
        assert steps_due(kind, 8, tokens) == due
