"""A cohort that decodes plainly decodes several tokens a row in one verify command
(--plain-steps): its answers are the target alone's, greedy and sampled, with log-probabilities,
stop tokens and lengths that end inside a command's steps, and the features of every step; the
service refuses plain steps that carry drafts."""
import concurrent.futures
import json
import queue

import grpc
import numpy as np
import pytest
from test_logprobs import check, reference_logprobs
from transformers import AutoModelForCausalLM

from batchspec.params import SamplingParams
from batchspec.runtime import wire
from batchspec.v1 import cache_pb2, generate_pb2, target_pb2, target_pb2_grpc

import tiny_models
from conftest import running_stack

PROMPTS = [[5, 6, 7, 8], [11, 12], [20, 21, 22, 23, 24, 25], [9], [30, 31], [40, 41, 42]]


def generate(stub, prompt, max_new_tokens, **fields):
    return [t for r in stub.Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new_tokens, **fields), timeout=120)
        for t in r.token_ids]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_steps_answer_as_the_target_alone(model_dirs, arch, tmp_path):
    target_dir, _ = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    step_log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, None, drafts=(), batch_size=4, plain_steps=4,
                       step_log=str(step_log)) as stack:
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            # lengths that are not multiples of the steps; one stops at its end-of-sequence
            greedy = list(pool.map(lambda p: generate(stub, p, 23), PROMPTS))
            long = pool.submit(generate, stub, PROMPTS[0], 30, ignore_eos=True)
            drawn = pool.submit(generate, stub, PROMPTS[1], 21, ignore_eos=True,
                                temperature=0.9, top_p=0.95, seed=7)
            long, drawn = long.result(), drawn.result()
    for prompt, tokens in zip(PROMPTS, greedy):
        assert tokens == tiny_models.reference_greedy(model, prompt, 23)
    eos = model.generation_config.eos_token_id
    assert any(len(t) < 23 and t[-1] == eos for t in greedy)  # stopped inside a command
    assert long == tiny_models.reference_greedy(model, PROMPTS[0], 30, ignore_eos=True)
    assert drawn == tiny_models.reference_sampled(model, PROMPTS[1], 21, sampled)
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    several = [s for s in steps if s["plain_steps"] > 1]
    assert several and all(s["plain_steps"] <= 4 for s in steps)
    assert all(s["committed"] <= s["rows"] * s["plain_steps"] for s in steps)
    assert max(s["committed"] / s["rows"] for s in several) > 1


def test_plain_steps_carry_every_tokens_logprobs(model_dirs):
    target_dir, _ = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompt = [5, 6, 7]
    with running_stack(target_dir, None, drafts=(), batch_size=2, plain_steps=5) as stack:
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=17, ignore_eos=True,
            logprobs=generate_pb2.LogprobsOptions(num_top=2)), timeout=120))
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == tiny_models.reference_greedy(model, prompt, 17, ignore_eos=True)
    assert max(len(r.token_ids) for r in responses) > 1  # several tokens in one command
    check([lp for r in responses for lp in r.logprobs], tokens,
          reference_logprobs(model, prompt + tokens)[len(prompt) - 1:], 2)


def test_a_cohort_that_drafts_verifies_one_step_a_command(model_dirs, tmp_path):
    """Plain steps are for cohorts that decode plainly by choice: a drafting cohort's
    commands verify one step, and its answers are still the target alone's."""
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    step_log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, draft_dir, batch_size=2, num_draft_tokens=3,
                       plain_steps=4, step_log=str(step_log)) as stack:
        tokens = generate(stack.stub(), PROMPTS[2], 24, ignore_eos=True)
    assert tokens == tiny_models.reference_greedy(model, PROMPTS[2], 24, ignore_eos=True)
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert steps and all(s["plain_steps"] == 1 for s in steps)


@pytest.mark.parametrize("asked", ["lookup", "cut"])
def test_a_step_whose_drafts_proposed_nothing_decodes_several_tokens_a_command(
        model_dirs, tmp_path, asked):
    """A step that asked drafts which proposed nothing (the n-gram lookup finding no match;
    a draft whose confidence cut left nothing) verifies none: it decodes up to --plain-steps
    tokens a row, and a step that verifies drafts one, with the target alone's answers."""
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    step_log = tmp_path / "steps.jsonl"
    drafting = {"drafts": ("local:ngram",), "draft_policy": "goodput", "step_aside": False} \
        if asked == "lookup" else {"min_draft_confidence": 0.999}  # fixed K, cut to nothing
    with running_stack(target_dir, draft_dir if asked == "cut" else None, batch_size=2,
                       num_draft_tokens=3, plain_steps=4, overlap="off",
                       step_log=str(step_log), **drafting) as stack:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: generate(stack.stub(), p, 40, ignore_eos=True),
                                    PROMPTS[:2]))
    for prompt, tokens in zip(PROMPTS, answers):
        assert tokens == tiny_models.reference_greedy(model, prompt, 40, ignore_eos=True)
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    asked_nothing = [s for s in steps if s["draft_s"] > 0 and not any(s["drafts"])]
    assert any(s["plain_steps"] > 1 for s in asked_nothing), asked_nothing
    assert all(s["plain_steps"] == 1 for s in steps if any(s["drafts"]))


def test_the_target_refuses_plain_steps_with_drafts(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, batch_size=1) as stack:
        channel = grpc.insecure_channel(f"127.0.0.1:{stack.target_port}")
        stub = target_pb2_grpc.TargetServiceStub(channel)
        commands = [
            target_pb2.TargetCommand(command_id=1, prefill=cache_pb2.PrefillCommand(entries=[
                cache_pb2.PrefillEntry(seq_id=901, token_ids=[5, 6, 7])])),
            target_pb2.TargetCommand(command_id=2, verify=target_pb2.VerifyCommand(
                plain_steps=3, entries=[target_pb2.VerifyEntry(
                    seq_id=901, expected_cache_len=3, append_token_ids=[8],
                    draft_token_ids=[9, 10])])),
            target_pb2.TargetCommand(command_id=3, verify=target_pb2.VerifyCommand(
                plain_steps=65, entries=[target_pb2.VerifyEntry(
                    seq_id=901, expected_cache_len=3, append_token_ids=[8])])),
            target_pb2.TargetCommand(command_id=4, verify=target_pb2.VerifyCommand(
                plain_steps=3, entries=[target_pb2.VerifyEntry(
                    seq_id=901, expected_cache_len=3, append_token_ids=[8])]))]
        results = list(stub.RunCommands(iter(commands), timeout=60))
        channel.close()
    assert results[0].WhichOneof("result") == "prefill"
    for refused in results[1:3]:
        assert refused.WhichOneof("result") == "error"
        assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    entry = results[3].verify.entries[0]
    assert entry.num_accepted == 0 and len(entry.output_token_ids) == 3 and entry.cache_len == 6


def test_plain_steps_return_the_features_one_step_a_command_returns(model_dirs):
    """A feature head reads the target's features of every position it caches: plain steps
    return those of each step, as three commands of one step would."""
    target_dir, draft_dir = model_dirs["llama"]
    prompt = [5, 6, 7, 8]
    with running_stack(target_dir, draft_dir, batch_size=1) as stack:
        channel = grpc.insecure_channel(f"127.0.0.1:{stack.target_port}")
        stub = target_pb2_grpc.TargetServiceStub(channel)

        def verify(command_id, seq_id, cache_len, token, steps):
            return target_pb2.TargetCommand(command_id=command_id, verify=target_pb2.VerifyCommand(
                plain_steps=steps, return_features=True, entries=[target_pb2.VerifyEntry(
                    seq_id=seq_id, expected_cache_len=cache_len, append_token_ids=[token])]))

        commands = queue.SimpleQueue()
        commands.put(target_pb2.TargetCommand(command_id=1, prefill=cache_pb2.PrefillCommand(
            entries=[cache_pb2.PrefillEntry(seq_id=s, token_ids=prompt[:-1]) for s in (1, 2)])))
        commands.put(verify(2, 1, 3, prompt[-1], 3))
        commands.put(verify(3, 2, 3, prompt[-1], 1))
        results = stub.RunCommands(iter(commands.get, None), timeout=60)  # one stream: the
        assert next(results).WhichOneof("result") == "prefill"  # sequences are its own
        together = next(results).verify.entries[0]
        singles = []
        for i in range(3):
            singles.append(next(results).verify.entries[0])
            last = singles[-1]
            commands.put(verify(4 + i, 2, last.cache_len, last.output_token_ids[-1], 1)
                         if i < 2 else None)
        channel.close()
    assert list(together.output_token_ids) == [s.output_token_ids[0] for s in singles]
    assert together.features.num_positions == 3
    joined = np.concatenate([wire.features_tensor(s.features, "verify").numpy() for s in singles])
    assert np.allclose(wire.features_tensor(together.features, "verify").numpy(), joined,
                       atol=1e-3)
