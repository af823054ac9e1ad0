"""Logit bias and presence/frequency penalties: OpenAI's definition, applied by the target at
every position it outputs (a verify's drafts counted before the positions after them, a
plain-steps command's own outputs too), so drafted, plain and target-alone answers agree."""
import collections
import concurrent.futures

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec.params import SamplingParams
from batchspec.runtime import adjust, sampling, tiny
from batchspec.v1 import generate_pb2

import tiny_models
from conftest import running_stack

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [11, 12, 11, 12], [20, 21, 22, 23, 24]]
NEW_TOKENS = 24
PENALIZED = dict(presence_penalty=0.6, frequency_penalty=1.5, logit_bias={9: 3.0, 17: -100.0})


def params_of(fields: dict, **sampled) -> SamplingParams:
    return SamplingParams(presence_penalty=fields.get("presence_penalty", 0.0),
                          frequency_penalty=fields.get("frequency_penalty", 0.0),
                          logit_bias=tuple(sorted(fields.get("logit_bias", {}).items())),
                          **sampled)


@tiny_models.on_compute_thread
def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target alone, one token a forward, each position's logits adjusted for the tokens
    it output before (adjust.adjustments, the definition) and then chosen as the services
    choose (argmax, or the seeded sample of that position)."""
    out = []

    def choose(logits, position):
        added = adjust.adjustments(params, collections.Counter(out), [], 1,
                                   logits.shape[-1], logits.device)
        out.append(int(sampling.choose(logits + added, [params], [position])[0, 0]))
        return out[-1]

    return tiny.decode_ignoring_eos(model, prompt, NEW_TOKENS, choose)


def generate(stub, prompt, **fields):
    responses = list(stub.Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **fields),
        timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].stats


def test_adjustments_are_openais_definition_counting_the_drafts_before():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias=((3, 2.0), (7, -1.5)))
    counts, drafts, vocab = {3: 2, 5: 1}, [5, 8, 8], 10
    got = adjust.adjustments(params, counts, drafts, 4, vocab, "cpu")
    for j in range(4):
        seen = collections.Counter(counts) + collections.Counter(drafts[:j])
        for t in range(vocab):
            want = dict(params.logit_bias).get(t, 0.0) - 0.25 * seen[t] - 0.5 * (seen[t] > 0)
            assert got[j, t].item() == pytest.approx(want), (j, t)
    # a bias alone needs no counts, and rows that adjust nothing are passed through untouched
    only_bias = adjust.adjustments(SamplingParams(logit_bias=((2, 1.0),)), None, [8], 2, vocab,
                                   "cpu")
    assert only_bias[1, 2] == 1.0 and only_bias[1, 8] == 0.0
    logits = torch.zeros(1, 2, vocab)

    class Row:
        sampling, output_counts = SamplingParams(), None

    assert adjust.adjusted(logits, [Row()], [[]]) is logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_penalized_answers_are_the_target_alones_whatever_was_drafted(model_dirs, arch):
    """The target drafts for itself (its drafts, unpenalized, are accepted wherever the
    penalties do not change its choice), so outputs after accepted drafts are adjusted
    with those drafts counted; greedy and seeded-sampled rows alike."""
    target_dir, _ = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    sampled = dict(temperature=0.8, top_p=0.95, seed=11)
    with running_stack(target_dir, target_dir, batch_size=4, num_draft_tokens=3) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            greedy = list(pool.map(lambda p: generate(stub, p, **PENALIZED), PROMPTS))
            drawn = pool.submit(generate, stub, PROMPTS[0], **PENALIZED, **sampled).result()
            plain = pool.submit(generate, stub, PROMPTS[0]).result()
    for prompt, (tokens, _) in zip(PROMPTS, greedy):
        assert tokens == reference(model, prompt, params_of(PENALIZED))
        assert 17 not in tokens
    assert drawn[0] == reference(model, PROMPTS[0], params_of(PENALIZED, **sampled))
    assert plain[0] != greedy[0][0]  # the penalties change the answer
    assert sum(stats.num_accepted_tokens for _, stats in greedy) > NEW_TOKENS // 2


def test_plain_steps_count_their_own_outputs(model_dirs):
    """Without drafts a command decodes four tokens a row: each later one is adjusted for
    the ones the same command output before it."""
    target_dir, _ = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    only_penalties = dict(frequency_penalty=2.0)
    with running_stack(target_dir, None, drafts=(), batch_size=4, plain_steps=4) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: generate(stub, p, **only_penalties), PROMPTS))
            biased = pool.submit(generate, stub, PROMPTS[1], logit_bias={9: 5.0}).result()
    for prompt, (tokens, _) in zip(PROMPTS, answers):
        assert tokens == reference(model, prompt, params_of(only_penalties))
        assert max(collections.Counter(tokens).values()) <= 6
    assert biased[0] == reference(model, PROMPTS[1], params_of(dict(logit_bias={9: 5.0})))
    assert biased[0].count(9) > NEW_TOKENS // 2


@pytest.mark.parametrize("fields, message", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={3: 150.0}), "logit_bias"),
    (dict(logit_bias={10**6: 1.0}), "outside the vocabulary"),
])
def test_bad_penalties_and_biases_are_refused(model_dirs, fields, message):
    import grpc

    target_dir, _ = model_dirs["llama"]
    with running_stack(target_dir, None, drafts=()) as stack:
        with pytest.raises(grpc.RpcError) as caught:
            generate(stack.stub(), PROMPTS[0], **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
