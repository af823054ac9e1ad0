"""Sampling through the services: the output distribution is the target's, and seeded
requests repeat whatever their batch mates."""
import concurrent.futures
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec.params import SamplingParams
from batchspec.runtime import sampling
from batchspec.v1 import generate_pb2

from conftest import running_stack

PROMPT = [11, 12, 13, 14]
NUM_SAMPLES = 600
NUM_POSITIONS = 3
TOP_K = 3
# Each position's two-sample chi-square test runs at this level; with a Bonferroni correction
# over positions the whole test fails by chance with probability below 0.001.
ALPHA = 0.001 / NUM_POSITIONS


def sample_service(stub, seeds, prompt=PROMPT, **fields):
    def one(seed):
        responses = stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=NUM_POSITIONS, temperature=1.0,
            top_k=TOP_K, seed=seed, ignore_eos=True, **fields), timeout=120)
        return tuple(t for r in responses for t in r.token_ids)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return list(pool.map(one, seeds))


def sample_target_alone(model_dir, count, prompt=PROMPT):
    """Target-only sampling (temperature 1, the same top_k), written out: a forward per
    position over the whole batch. End-of-sequence tokens are sampled like any other, as the
    service does with ignore_eos (generate's min_new_tokens would mask them instead)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor([prompt] * count)
    with torch.no_grad():
        for _ in range(NUM_POSITIONS):
            logits = model(tokens).logits[:, -1].float()
            top = logits.topk(TOP_K, dim=-1)
            picked = torch.multinomial(torch.softmax(top.values, -1), 1, generator=generator)
            tokens = torch.cat([tokens, top.indices.gather(-1, picked)], dim=1)
    return [tuple(row) for row in tokens[:, len(prompt):].tolist()]


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity; returns the p-value."""
    keys = sorted(set(a) | set(b))
    n_a, n_b = sum(a.values()), sum(b.values())
    statistic = 0.0
    for key in keys:
        total = a[key] + b[key]
        for count, n in ((a[key], n_a), (b[key], n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (count - expected) ** 2 / expected
    dof = len(keys) - 1
    if dof == 0:
        return 1.0
    cdf = torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64),
                                 torch.tensor(statistic / 2, dtype=torch.float64))
    return float(1 - cdf)


def test_chi_square_helper_tells_different_distributions_apart():
    same = chi_square_p_value(Counter({1: 300, 2: 300}), Counter({1: 290, 2: 310}))
    different = chi_square_p_value(Counter({1: 300, 2: 300}), Counter({1: 200, 2: 400}))
    assert same > 0.1 and different < 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sampled_tokens_follow_the_target_distribution(model_dirs, arch):
    target_dir, draft_dir = model_dirs[arch]
    with running_stack(target_dir, draft_dir, batch_size=16, num_draft_tokens=3) as stack:
        ours = sample_service(stack.stub(), range(NUM_SAMPLES))
        stats = stack.router.stats
    # steps that verified drafts for sampled rows, not plain ones (test_sampling_kinds.py
    # asserts that drafts are accepted, per draft kind)
    assert stats.num_sampled_rows > 0 and stats.num_plain_steps < stats.num_steps
    assert_follows_the_target(ours, target_dir)


def assert_follows_the_target(ours, target_dir, prompt=PROMPT):
    """The service's samples against as many target-only samples, position by position."""
    reference = sample_target_alone(target_dir, len(ours), prompt=prompt)
    for position in range(NUM_POSITIONS):
        # the prefix up to this position, so later positions compare conditionals jointly
        p_value = chi_square_p_value(Counter(s[:position + 1] for s in ours),
                                     Counter(s[:position + 1] for s in reference))
        assert p_value > ALPHA, f"position {position}: p = {p_value:.2e}"


def test_seeded_requests_repeat_across_batch_compositions(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    seeds = [101, 202, 303]
    with running_stack(target_dir, draft_dir, batch_size=1, num_draft_tokens=4) as stack:
        alone = [sample_service(stack.stub(), [s])[0] for s in seeds]
    with running_stack(target_dir, draft_dir, batch_size=16, num_draft_tokens=4) as stack:
        # the same requests among 29 others with other prompts and seeds
        crowd = list(range(1000, 1029))
        mixed = sample_service(stack.stub(), seeds + crowd)[:3]
        others = sample_service(stack.stub(), crowd[:10], prompt=[20, 21])
        assert len(others) == 10
    with running_stack(target_dir, draft_dir, batch_size=5, num_draft_tokens=4) as stack:
        regrouped = sample_service(stack.stub(), seeds + list(range(2000, 2011)))[:3]
    assert alone == mixed == regrouped
    with running_stack(target_dir, draft_dir, batch_size=4, num_draft_tokens=4) as stack:
        different = sample_service(stack.stub(), range(500, 520))
    assert len(set(different)) > 1  # different seeds give different samples


def test_a_seeded_request_is_what_the_target_alone_samples_for_its_seed(model_dirs):
    """Drafter invariance: a sampled request's tokens are the target's own seeded choices
    (the Gumbel-max sample of (seed, position), computed here from full forwards of the
    target alone), whatever was drafted and accepted on the way."""
    target_dir, draft_dir = model_dirs["llama"]
    seeds = range(40)
    with running_stack(target_dir, draft_dir, batch_size=8, num_draft_tokens=4) as stack:
        ours = sample_service(stack.stub(), seeds)
        accepted = sum(list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=NUM_POSITIONS, temperature=1.0,
            top_k=TOP_K, seed=seed, ignore_eos=True), timeout=120))[-1].stats.num_accepted_tokens
            for seed in seeds[:10])
    assert accepted > 0  # drafts were accepted on the way
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for seed, got in zip(seeds, ours):
        params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed)]
        tokens = list(PROMPT)
        with torch.no_grad():
            for _ in range(NUM_POSITIONS):
                logits = model(torch.tensor([tokens])).logits[:, -1:]
                tokens.append(int(sampling.choose(logits, params, [len(tokens)])[0, 0]))
        assert tuple(tokens[len(PROMPT):]) == got, seed
