"""Sampling through the services, for every draft kind, with tests that can fail: the output
distribution is the target's at temperature 0.7 and top-p 0.9 (a sampler that ignored either
would be caught), with a draft close to the target and one far from it (a draft whose tokens
leaked into the output unverified would be caught), sampled drafts are really accepted (a
sampler that rejects everything keeps the target's distribution, so this is asserted on its
own), the bonus token after a fully accepted draft is the target's, and seeded requests
repeat."""
import concurrent.futures
import json
from collections import Counter

import pytest
import torch
from test_sampling_e2e import chi_square_p_value
from transformers import AutoConfig, AutoModelForCausalLM

from batchspec.runtime import tiny
from batchspec.v1 import generate_pb2

import tiny_models
from conftest import running_stack

NUM_SAMPLES = 600
NUM_POSITIONS = 3
TEMPERATURE, TOP_P = 0.7, 0.9
ALPHA = 0.001 / NUM_POSITIONS  # per position; the whole test fails by chance below 0.001


@pytest.fixture(scope="module")
def far_draft(model_dirs, tmp_path_factory):
    """A draft far from the target: another random model of the same shape and vocabulary."""
    target_dir = model_dirs["llama"][0]
    model = tiny.BUILDERS["llama"](seed=5)
    eos = AutoConfig.from_pretrained(target_dir).eos_token_id
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("far") / "llama-far-draft"
    model.save_pretrained(path)
    return str(path)


def lookup_prompt(target_dir) -> list[int]:
    """A prompt whose lookup proposes the target's own likely tokens: a start, the target's
    greedy continuation of it, then the start again."""
    start = [11, 12, 13, 14]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    return start + tiny_models.greedy_ignoring_eos(model, start, 6) + start


def sample(stack, seeds, prompt):
    """(tokens, drafted, accepted) per seed, sampled at TEMPERATURE and TOP_P."""
    def one(seed):
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=NUM_POSITIONS, temperature=TEMPERATURE,
            top_p=TOP_P, seed=seed, ignore_eos=True), timeout=120))
        stats = responses[-1].stats
        return (tuple(t for r in responses for t in r.token_ids), stats.num_drafted_tokens,
                stats.num_accepted_tokens)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return list(pool.map(one, seeds))


def target_alone(model_dir, count, prompt):
    """Target-only sampling written out from the definitions: logits / temperature, then the
    smallest set of most likely tokens whose mass reaches top_p (a token is kept while the
    mass before it is below top_p), renormalised."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor([prompt] * count)
    with torch.no_grad():
        for _ in range(NUM_POSITIONS):
            probs = torch.softmax(model(tokens).logits[:, -1].double() / TEMPERATURE, -1)
            sorted_probs, order = probs.sort(-1, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < TOP_P
            nucleus = torch.where(keep, sorted_probs, 0.0)
            picked = torch.multinomial(nucleus.float(), 1, generator=generator)
            tokens = torch.cat([tokens, order.gather(-1, picked)], dim=1)
    return [tuple(row) for row in tokens[:, len(prompt):].tolist()]


def assert_follows_the_target(ours, target_dir, prompt):
    reference = target_alone(target_dir, len(ours), prompt)
    for position in range(NUM_POSITIONS):
        # the prefix up to this position: later positions compare conditionals jointly
        p_value = chi_square_p_value(Counter(s[:position + 1] for s in ours),
                                     Counter(s[:position + 1] for s in reference))
        assert p_value > ALPHA, f"position {position}: p = {p_value:.2e}"


@pytest.mark.parametrize("kinds,draft", [(("model",), "near"), (("model",), "far"),
                                         (("ngram",), None), (("ngram", "model"), "near"),
                                         (("ngram", "hosted"), "near")],
                         ids=["model-near", "model-far", "ngram", "router", "router-hosted"])
def test_sampled_output_is_the_targets_and_drafts_are_accepted(model_dirs, far_draft, kinds,
                                                                draft):
    target_dir, near_dir = model_dirs["llama"]
    prompt = lookup_prompt(target_dir)
    with running_stack(target_dir, far_draft if draft == "far" else near_dir, drafts=kinds,
                       batch_size=16, num_draft_tokens=3) as stack:
        results = sample(stack, range(NUM_SAMPLES), prompt)
        again = sample(stack, range(20), prompt)
    assert [r[0] for r in again] == [r[0] for r in results[:20]]  # seeded requests repeat
    drafted, accepted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # sampled drafts were accepted
    if draft == "far":
        assert accepted < 0.5 * drafted  # and a far draft is mostly rejected
    assert_follows_the_target([r[0] for r in results], target_dir, prompt)


def test_the_bonus_token_after_a_fully_accepted_draft_is_the_targets(model_dirs,
                                                                     tmp_path_factory):
    """A draft equal to the target, sampling with the same seeded noise, proposes the
    target's own choices, so its drafts are accepted and a step ends with a bonus token, the
    target's choice at the position after the drafts: K = 2 over 3 positions makes the third
    token a bonus."""
    target_dir = model_dirs["llama"][0]
    prompt = [11, 12, 13, 14]
    with running_stack(target_dir, target_dir, batch_size=16, num_draft_tokens=2) as stack:
        results = sample(stack, range(NUM_SAMPLES), prompt)
    # nearly every draft accepted (the two forwards' logits differ by rounding alone), and
    # nearly every request one step: 2 accepted drafts, then the bonus as its third token
    drafted, accepted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert accepted >= 0.98 * drafted
    assert sum(r[1] == r[2] == 2 for r in results) > 0.9 * NUM_SAMPLES
    assert_follows_the_target([r[0] for r in results], target_dir, prompt)


@pytest.fixture(scope="module")
def feature_heads(model_dirs, tmp_path_factory):
    """{"exact": (a one-layer target, a head computing what it computes), "far": (the tiny
    Llama target, an untrained head)}."""
    root = tmp_path_factory.mktemp("feature-heads")
    one_layer = tiny_models.save_one_layer_target(root)
    target_dir = model_dirs["llama"][0]
    return {"exact": (one_layer,
                      tiny_models.save_feature_head(one_layer, root / "exact", exact=True)),
            "far": (target_dir, tiny_models.save_feature_head(target_dir, root / "far"))}


@pytest.mark.parametrize("head,drafts", [("exact", ("model",)), ("far", ("model",)),
                                         ("exact", ("hosted",))],
                         ids=["exact", "far", "exact-hosted"])
def test_sampled_output_through_a_feature_head_is_the_targets(feature_heads, head, drafts):
    """The feature kind: its sampled drafts are accepted where they are the target's choices;
    an exact head's drafts are all but always accepted (a step of K = 2 ends with the bonus
    token, the third output, the target's), a far one's mostly not. Hosted by the target, it
    reads the features the coordinator relays as a draft service does."""
    target_dir, head_dir = feature_heads[head]
    prompt = lookup_prompt(target_dir)
    with running_stack(target_dir, head_dir, batch_size=16, num_draft_tokens=2,
                       drafts=drafts) as stack:
        results = sample(stack, range(NUM_SAMPLES), prompt)
        again = sample(stack, range(20), prompt)
    assert [r[0] for r in again] == [r[0] for r in results[:20]]  # seeded requests repeat
    drafted, accepted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if head == "exact":
        assert accepted >= 0.98 * drafted
        assert sum(r[1] == r[2] == 2 for r in results) > 0.9 * NUM_SAMPLES
    else:
        assert accepted < 0.5 * drafted
    assert_follows_the_target([r[0] for r in results], target_dir, prompt)


def test_rounds_of_the_hosted_draft_sample_what_one_round_a_command_samples(model_dirs,
                                                                           tmp_path):
    """Seeded sampled requests, some with a frequency penalty, one at a time (none waits,
    so the hosted draft's cohorts run several rounds a command): each answer is the one the
    same server gives at one round a command, since every output is the target's seeded
    choice at its position, whatever drafts were verified before it."""
    target_dir, near_dir = model_dirs["llama"]
    prompt = lookup_prompt(target_dir)

    def answers(rounds):
        log = tmp_path / f"steps-{rounds}.jsonl"
        with running_stack(target_dir, near_dir, drafts=("hosted",), batch_size=16,
                           num_draft_tokens=3, draft_rounds=rounds, step_log=str(log)) as stack:
            got = []
            for seed in range(24):
                responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_new_tokens=14, temperature=TEMPERATURE,
                    top_p=TOP_P, seed=seed, ignore_eos=True,
                    frequency_penalty=0.8 if seed % 2 else None), timeout=120))
                stats = responses[-1].stats
                got.append(([t for r in responses for t in r.token_ids],
                            stats.num_drafted_tokens, stats.num_accepted_tokens))
        return got, [json.loads(line)["rounds"] for line in log.read_text().splitlines()]

    several, rounds = answers(4)
    one, single = answers(1)
    assert [a for a, _, _ in several] == [a for a, _, _ in one]
    assert max(rounds) > 1 and max(single) == 1
    assert sum(a for _, _, a in several) > 0  # sampled drafts were accepted in rounds


def test_a_cohort_mixing_greedy_and_sampled_rows_keeps_both_exact(model_dirs):
    """Greedy and sampled requests stepped together (every fourth request greedy, on one of
    20 prompts, 32 at a time into cohorts of 16): the greedy ones are target-alone greedy
    decoding, the sampled ones follow the target's distribution, and both had drafts
    accepted."""
    target_dir, near_dir = model_dirs["llama"]
    prompt = lookup_prompt(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    greedy_prompts = [[20 + p, 21, 22, 23, 24] for p in range(20)]
    greedy = [tuple(tiny_models.greedy_ignoring_eos(model, p, NUM_POSITIONS))
              for p in greedy_prompts]

    def one(stub, i):
        fields = {} if i % 4 == 0 else {"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i}
        asked = greedy_prompts[i // 4 % 20] if i % 4 == 0 else prompt
        responses = list(stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=asked, max_new_tokens=NUM_POSITIONS, ignore_eos=True, **fields),
            timeout=120))
        return (i, tuple(t for r in responses for t in r.token_ids),
                responses[-1].stats.num_accepted_tokens)

    with running_stack(target_dir, near_dir, drafts=("ngram", "model"), batch_size=16,
                       num_draft_tokens=3) as stack:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: one(stack.stub(), i), range(4 * NUM_SAMPLES // 3)))
    greedy_rows = [r for r in results if r[0] % 4 == 0]
    sampled_rows = [r for r in results if r[0] % 4]
    assert all(tokens == greedy[i // 4 % 20] for i, tokens, _ in greedy_rows)
    assert sum(a for _, _, a in greedy_rows) > 0 and sum(a for _, _, a in sampled_rows) > 0
    assert_follows_the_target([tokens for _, tokens, _ in sampled_rows[:NUM_SAMPLES]],
                              target_dir, prompt)
