"""A prompt longer than --prefill-chunk-tokens is fed to the target a chunk a step, between
the steps of the sequences already decoding: its answer is the target alone's, greedy and
sampled, with every draft kind, and the others step while it is fed."""
import concurrent.futures
import random
import threading

import pytest
from transformers import AutoModelForCausalLM

from batchspec.params import SamplingParams
from batchspec.v1 import generate_pb2

import tiny_models
from conftest import running_stack

CHUNK = 8


def fed(runner, log):
    """Record (seq_id, tokens appended) of every group forward the target runs."""
    open_group = runner.open_group

    def recorded(rows, **kwargs):
        log.extend((r.seq_id, len(r.append_token_ids)) for r in rows)
        return open_group(rows, **kwargs)

    runner.open_group = recorded


@pytest.mark.parametrize("arch,drafts", [("llama", ("model", "ngram")), ("gpt2", ("hosted",)),
                                         ("llama", ("local:ngram",))])
def test_a_long_prompt_fed_in_chunks_is_answered_as_whole_while_others_step(model_dirs, arch,
                                                                              drafts):
    target_dir, draft_dir = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    rng = random.Random(3)
    long_prompt = [rng.randrange(4, tiny_models.VOCAB) for _ in range(5 * CHUNK + 3)]
    short_prompt = [rng.randrange(4, tiny_models.VOCAB) for _ in range(5)]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    log = []
    with running_stack(target_dir, draft_dir, drafts=drafts, batch_size=4,
                       prefill_chunk_tokens=CHUNK) as stack:
        fed(stack.target_runner, log)
        stub = stack.stub()
        short = []
        running = threading.Thread(target=lambda: short.extend(
            t for r in stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=short_prompt, max_new_tokens=200, ignore_eos=True), timeout=120)
            for t in r.token_ids))
        running.start()
        while not log:  # the short request decodes
            threading.Event().wait(0.01)
        answers = [[t for r in stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=long_prompt, max_new_tokens=12, ignore_eos=True, **fields),
            timeout=120) for t in r.token_ids]
            for fields in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 11})]
        running.join()
    assert answers[0] == tiny_models.reference_greedy(model, long_prompt, 12, ignore_eos=True)
    assert answers[1] == tiny_models.reference_sampled(model, long_prompt, 12, sampled)
    assert short == tiny_models.reference_greedy(model, short_prompt, 200, ignore_eos=True)
    chunks = [i for i, (_, n) in enumerate(log) if n == CHUNK]
    assert len(chunks) >= 2 * 4  # each long prompt: a chunk at admission, then four fed
    # the short request stepped (one token appended) while the first prompt was fed
    assert any(n == 1 for _, n in log[chunks[0]:chunks[3]])


def test_a_long_prompt_alone_is_fed_whole(model_dirs):
    """Chunks are for the streams a prompt would stall: with none decoding, a long prompt is
    prefilled in one forward (chunks would only delay its first token)."""
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    long_prompt = [random.Random(5).randrange(4, tiny_models.VOCAB) for _ in range(6 * CHUNK)]
    log = []
    with running_stack(target_dir, draft_dir, drafts=("model",), num_draft_tokens=3,
                       prefill_chunk_tokens=CHUNK) as stack:
        fed(stack.target_runner, log)
        answer = [t for r in stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=long_prompt, max_new_tokens=10, ignore_eos=True), timeout=120)
            for t in r.token_ids]
    assert answer == tiny_models.reference_greedy(model, long_prompt, 10, ignore_eos=True)
    assert log and all(n <= 4 for _, n in log)  # verifies of K + 1 tokens, never a chunk


def test_a_long_prompt_asked_several_times_at_once_is_fed_once(model_dirs):
    """Three requests of one long prompt (n choices, or clients asking the same) while another
    stream decodes: the first is fed in chunks, the others wait until it holds the prompt
    whole and start from a copy of its cache, so the prompt's chunks are fed once, not three
    times; every answer is the target alone's."""
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    rng = random.Random(7)
    long_prompt = [rng.randrange(4, tiny_models.VOCAB) for _ in range(5 * CHUNK + 3)]
    short_prompt = [rng.randrange(4, tiny_models.VOCAB) for _ in range(5)]
    log = []
    with running_stack(target_dir, draft_dir, drafts=("model",), batch_size=4,
                       prefill_chunk_tokens=CHUNK) as stack:
        fed(stack.target_runner, log)
        stub = stack.stub()

        def generate(prompt, max_new):
            return [t for r in stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_new_tokens=max_new, ignore_eos=True),
                timeout=120) for t in r.token_ids]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            short = pool.submit(generate, short_prompt, 150)
            while not log:  # the short request decodes
                threading.Event().wait(0.01)
            answers = list(pool.map(lambda _: generate(long_prompt, 10), range(3)))
            short = short.result()
    expected = tiny_models.reference_greedy(model, long_prompt, 10, ignore_eos=True)
    assert answers == [expected] * 3
    assert short == tiny_models.reference_greedy(model, short_prompt, 150, ignore_eos=True)
    # the chunks fed after the first (which the admission's prefill caches): four, once
    assert sum(n == CHUNK for _, n in log) == 4
