"""The feature-level (EAGLE-style) draft: the target's features on the wire, the head as a
draft service obeying the same cache commands, and greedy output through the services equal
to the target's own, on a Llama-style and a GPT-2-style target."""
import argparse
import json
import os
import shutil
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec import errors
from batchspec.metrics import scrape
from batchspec.params import SamplingParams
from batchspec.runtime import draft_model, models, tiny, wire
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import VerifyRow
from batchspec.v1 import cache_pb2, draft_pb2, generate_pb2, target_pb2
from coordinator import features as features_lib
from draft_service import proposer
from draft_service.servicer import DraftServicer
from target_service import verifier
from target_service.servicer import TargetServicer

import tiny_models
from conftest import running_stack, start_draft


@pytest.fixture(scope="module")
def heads(model_dirs, tmp_path_factory):
    """{arch: (target_dir, head_dir)}: an untrained head for each tiny target, and "exact":
    a one-layer target with a head that computes what it computes."""
    root = tmp_path_factory.mktemp("heads")
    made = {arch: (target, tiny_models.save_feature_head(target, root / f"{arch}-head"))
            for arch, (target, _) in model_dirs.items()}
    one_layer = tiny_models.save_one_layer_target(root)
    made["exact"] = (one_layer, tiny_models.save_feature_head(one_layer, root / "exact-head",
                                                       exact=True))
    return made


def runner(model_dir):
    model = models.load_causal_lm(model_dir)
    return runner_lib.ModelRunner(model, name=model_dir, device=torch.device("cpu"),
                                  eos_token_ids=[], max_context_len=256)


def test_features_travel_as_float16_rows_and_a_short_payload_is_refused():
    values = torch.randn(3, 8)
    message = wire.features_message(values)
    assert (message.num_positions, message.width, len(message.values_f16)) == (3, 8, 48)
    assert torch.equal(wire.features_tensor(message, "x"), values.half().float())
    message.values_f16 = message.values_f16[:-2]
    with pytest.raises(errors.InvalidArgument, match="need 48 bytes"):
        wire.features_tensor(message, "x")


def test_a_feature_log_feeds_each_token_the_features_of_the_position_before_it():
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)  # positions 0..3, width 3
    log = features_lib.from_message(wire.features_message(rows))
    assert log.length == 4
    fed = wire.features_tensor(log.fed_with(0, 3), "x")
    assert torch.equal(fed, torch.cat([torch.zeros(1, 3), rows[:2]]))  # zeros before token 0
    assert torch.equal(wire.features_tensor(log.fed_with(2, 5), "x"), rows[1:4])
    with pytest.raises(ValueError):
        log.fed_with(2, 6)  # token 5 needs position 4, not known
    assert not log.extend(wire.features_message(torch.zeros(1, 4)))  # another width
    assert log.length == 4  # ... and nothing of it appended


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_targets_features_agree_across_prefill_verify_and_recomputation(model_dirs, arch):
    """What a prefill and a verify return for the positions they cache is what the target
    computes for the same committed prefix on request, which touches no cache, and what a
    head is trained on: the last of the hidden states a stock forward returns."""
    target = runner(model_dirs[arch][0])
    prompt = [5, 6, 7, 8, 9]
    _, kept = target.prefill_features([(1, prompt[:-1])], keep=True)
    outcomes, _ = verifier.verify(target, [VerifyRow(
        1, 4, [prompt[-1]], [10, 11, 12], SamplingParams())], realign=False,
        keep_features=True)
    outcome = outcomes[0]
    committed = prompt + outcome.output_token_ids
    assert outcome.features.shape == (outcome.cache_len - 4, target.hidden_size)
    before = {s: c.length for s, c in target.caches.items()}
    recomputed = target.features([committed[:-1]])[0]
    assert {s: c.length for s, c in target.caches.items()} == before
    assert torch.allclose(recomputed[:4], kept[1], atol=1e-4)
    assert torch.allclose(recomputed[4:], outcome.features, atol=1e-4)
    with torch.inference_mode():
        trained_on = target.model(input_ids=torch.tensor([committed[:-1]]),
                                  output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(recomputed, trained_on, atol=1e-4)


def test_services_refuse_features_where_they_do_not_belong(model_dirs, heads):
    target_dir, draft_dir = model_dirs["llama"]
    head = DraftServicer(runner(heads["llama"][1]))
    plain_draft = DraftServicer(runner(draft_dir))
    target = TargetServicer(runner(target_dir))
    assert head.feature_width() == 64 and plain_draft.feature_width() == 0
    assert target.feature_width() == 64
    rows = wire.features_message(torch.zeros(3, 64))
    with pytest.raises(errors.InvalidArgument, match="reads the target's features"):
        head.handle("prefill", cache_pb2.PrefillCommand(entries=[
            cache_pb2.PrefillEntry(seq_id=1, token_ids=[5, 6, 7])]))
    with pytest.raises(errors.InvalidArgument, match="send 3 rows of 64"):
        head.handle("prefill", cache_pb2.PrefillCommand(entries=[cache_pb2.PrefillEntry(
            seq_id=1, token_ids=[5, 6, 7], features=wire.features_message(
                torch.zeros(2, 64)))]))
    with pytest.raises(errors.InvalidArgument, match="reads no features"):
        plain_draft.handle("prefill", cache_pb2.PrefillCommand(entries=[
            cache_pb2.PrefillEntry(seq_id=1, token_ids=[5, 6, 7], features=rows)]))
    target.handle("prefill", cache_pb2.PrefillCommand(entries=[
        cache_pb2.PrefillEntry(seq_id=1, token_ids=[5, 6, 7])]))
    with pytest.raises(errors.InvalidArgument, match="copy_from"):
        target.handle("prefill", cache_pb2.PrefillCommand(return_features=True, entries=[
            cache_pb2.PrefillEntry(seq_id=2, token_ids=[5, 6], copy_from=1)]))
    _, result = target.handle("prefill", cache_pb2.PrefillCommand(
        return_features=True, entries=[cache_pb2.PrefillEntry(seq_id=3, token_ids=[5, 6, 7])]))
    assert [f.num_positions for f in result.features] == [3]
    # the head drafts after a prefill from features, its cache checked like any draft's
    head.handle("prefill", cache_pb2.PrefillCommand(entries=[
        cache_pb2.PrefillEntry(seq_id=1, token_ids=[5, 6, 7], features=rows)]))
    _, proposed = head.handle("propose", draft_pb2.ProposeCommand(
        num_draft_tokens=3, entries=[draft_pb2.ProposeEntry(
            seq_id=1, expected_cache_len=3, keep_len=3, append_token_ids=[8],
            features=wire.features_message(torch.zeros(1, 64)))]))
    assert len(proposed.entries[0].draft_token_ids) == 3 and proposed.entries[0].cache_len == 6
    _, found = target.handle("features", target_pb2.FeaturesCommand(entries=[
        target_pb2.FeaturesEntry(seq_id=9, token_ids=[5, 6, 7, 8])]))
    assert found.features[0].num_positions == 4 and 9 not in target.runner.caches


def test_a_head_says_it_is_calibrated_when_its_manifest_does(heads, tmp_path):
    """ModelInfo.calibrated comes from the manifest: the coordinator cuts only such drafts."""
    head_dir = tmp_path / "head"
    shutil.copytree(heads["llama"][1], head_dir)
    assert not DraftServicer(runner(str(head_dir))).Describe(None, None).calibrated
    manifest = json.loads((head_dir / draft_model.MANIFEST).read_text())
    (head_dir / draft_model.MANIFEST).write_text(json.dumps({**manifest, "calibrated": True}))
    assert DraftServicer(runner(str(head_dir))).Describe(None, None).calibrated


def generate(stack, prompt, max_new_tokens):
    responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True), timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].stats


PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34, 35]]


def spy_on_proposals(monkeypatch) -> list:
    """(seq_id, keep_len, append_token_ids, features) of every row a draft is asked to
    propose for."""
    fed = []
    real_propose = proposer.propose

    def spy(runner_, rows, *args, **kwargs):
        fed.extend((r.seq_id, r.keep_len, list(r.append_token_ids), r.features) for r in rows)
        return real_propose(runner_, rows, *args, **kwargs)

    monkeypatch.setattr(proposer, "propose", spy)
    return fed


def generate_together(stack, prompts, max_new_tokens):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(stack, p, max_new_tokens), prompts))


def assert_fed_the_targets_features(target, answered, fed):
    """Every proposal's features are the target's own features of the positions before its
    tokens, recomputed for the answers ((prompt, tokens) each)."""
    assert fed
    by_prefix = {}
    for prompt, tokens in answered:
        full = prompt + tokens
        by_prefix[tuple(full)] = target.features([full])[0]
    for _, keep, append, features in fed:
        end = keep + len(append)  # tokens [keep, end) fed; positions [keep-1, end-1)
        candidates = []
        for full, truth in by_prefix.items():
            if list(full[keep:end]) != append:
                continue
            expected = truth[max(keep - 1, 0):end - 1]
            if keep == 0:
                expected = torch.cat([torch.zeros(1, truth.shape[1]), expected])
            candidates.append(expected)
        # the sequence it belongs to (tokens alone may not tell which)
        assert any(torch.allclose(features, e, atol=2e-2) for e in candidates), (keep, append)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_through_a_feature_draft_is_the_targets_and_it_is_fed_the_right_rows(
        heads, arch, monkeypatch):
    """Rows of different lengths in one batch; every proposal's features are compared with
    the target's own features of the positions before its tokens, recomputed."""
    target_dir, head_dir = heads[arch]
    fed = spy_on_proposals(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3) as stack:
        results = generate_together(stack, PROMPTS, 16)
        for prompt, (tokens, stats) in zip(PROMPTS, results):
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 16)
        assert sum(stats.num_drafted_tokens for _, stats in results) > 0
        assert_fed_the_targets_features(stack.target_runner, [
            (prompt, tokens) for prompt, (tokens, _) in zip(PROMPTS, results)], fed)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rounds_of_a_hosted_head_feed_it_the_targets_rows_and_stay_exact(
        heads, arch, monkeypatch, tmp_path):
    """The head hosted by the target, cohorts of rows of different lengths running several
    rounds of proposing and verifying in one command: the answers are the target's, and every
    proposal, those of the rounds after a command's first included, is fed the target's own
    features of the positions before its tokens."""
    target_dir, head_dir = heads[arch]
    fed = spy_on_proposals(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3,
                       drafts=("hosted",), draft_rounds=4, step_log=str(log)) as stack:
        results = generate_together(stack, PROMPTS, 24)
        for prompt, (tokens, _) in zip(PROMPTS, results):
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 24)
        assert_fed_the_targets_features(stack.target_runner, [
            (prompt, tokens) for prompt, (tokens, _) in zip(PROMPTS, results)], fed)
    assert any(json.loads(line)["rounds"] > 1 for line in log.read_text().splitlines())


def test_rounds_of_the_exact_head_have_every_draft_accepted(heads, tmp_path):
    """The head that computes what the target computes, hosted, K = 3, 13 tokens: one
    command of three rounds commits 12 (every draft accepted in every round, so the features
    each round feeds are the target's), then a step of the 13th token."""
    target_dir, head_dir = heads["exact"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3, metrics_port=0,
                       drafts=("hosted",), draft_rounds=4, step_log=str(log)) as stack:
        for prompt in PROMPTS[:2]:
            tokens, stats = generate(stack, prompt, 13)
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 13)
            assert stats.num_accepted_tokens == stats.num_drafted_tokens == 9
            assert stats.num_target_forward_passes == 4
        samples = scrape(f"http://127.0.0.1:{stack.metrics_port}/metrics")
    # the metrics count a draft a round: three of three tokens, each accepted, per request
    counted = {(name, labels.get("position")): value for name, labels, value in samples
               if name.startswith("vllm:spec_decode")}
    assert counted[("vllm:spec_decode_num_drafts_total", None)] == 6
    assert counted[("vllm:spec_decode_num_draft_tokens_total", None)] == 18
    assert [counted[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
            for i in range(3)] == [6, 6, 6]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s["rounds"] for s in steps if s["committed"] == 12] == [3, 3]
    # the step log counts every round's drafts; width is one round's
    assert [(s["drafts"], s["accepted"], s["width"]) for s in steps if s["committed"] == 12] \
        == [([9], [9], 3)] * 2


def test_a_prompt_fed_in_chunks_feeds_its_feature_draft_the_targets_rows(heads, monkeypatch):
    """Prompts longer than the prefill chunk (4 here), arriving while a stream decodes, are
    fed to the target a chunk a step, their features kept from each chunk's verify: the
    answers are the target's and every proposal is fed the target's own features of the
    positions before its tokens."""
    import concurrent.futures

    from test_chunked_prefill import fed as record_fed

    target_dir, head_dir = heads["llama"]
    fed = spy_on_proposals(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = [PROMPTS[1] + PROMPTS[3], PROMPTS[0], PROMPTS[3] + PROMPTS[0] + PROMPTS[1]]
    appended = []
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3,
                       prefill_chunk_tokens=4) as stack, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        record_fed(stack.target_runner, appended)
        running = pool.submit(generate, stack, PROMPTS[2], 120)
        while not appended:  # the stream decodes
            threading.Event().wait(0.01)
        results = generate_together(stack, prompts, 16)
        results.append(running.result())
        prompts.append(PROMPTS[2])
        for prompt, (tokens, _) in zip(prompts, results):
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, len(tokens))
        assert sum(stats.num_drafted_tokens for _, stats in results) > 0
        assert_fed_the_targets_features(stack.target_runner, [
            (prompt, tokens) for prompt, (tokens, _) in zip(prompts, results)], fed)
    assert sum(n == 4 for _, n in appended) >= 2 + 3  # chunks fed after the first ones


def test_a_repeated_prompt_is_copied_in_the_target_with_its_features(heads, monkeypatch):
    """A prompt asked again while the first asking runs starts from the first one's cache,
    with a feature draft in use as without one, and its drafts are fed the features of the
    positions it copied."""
    target_dir, head_dir = heads["llama"]
    fed = spy_on_proposals(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3) as stack:
        copies = []
        real_copies = stack.target_runner.prefill_copies
        monkeypatch.setattr(stack.target_runner, "prefill_copies", lambda entries, c: (
            copies.append(dict(c)), real_copies(entries, c))[1])
        results = generate_together(stack, prompts, 24)
        for prompt, (tokens, _) in zip(prompts, results):
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 24)
        assert [len(c) for c in copies if c] == [1]  # the second asking, copied
        assert_fed_the_targets_features(stack.target_runner, [
            (prompt, tokens) for prompt, (tokens, _) in zip(prompts, results)], fed)
        copied = next(iter(next(c for c in copies if c)))
        assert any(seq_id == copied for seq_id, *_ in fed)  # and it drafted


def test_a_head_that_computes_what_the_target_computes_has_every_draft_accepted(heads):
    target_dir, head_dir = heads["exact"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3) as stack:
        for prompt in PROMPTS[:2]:
            tokens, stats = generate(stack, prompt, 13)
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 13)
            # 3 steps of 3 accepted drafts and a bonus token, then the 13th token with no
            # draft (none past the tokens a row may still commit)
            assert stats.num_accepted_tokens == stats.num_drafted_tokens == 9
        # a scored prompt is prefilled without features: the head's prefill asks the target
        # to compute them (the path a lost feature log takes too)
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=PROMPTS[3], max_new_tokens=13, ignore_eos=True,
            prompt_logprobs=generate_pb2.LogprobsOptions(num_top=1)), timeout=120))
        assert [t for r in responses for t in r.token_ids] == tiny_models.greedy_ignoring_eos(
            model, PROMPTS[3], 13)
        stats = responses[-1].stats
        assert stats.num_accepted_tokens == stats.num_drafted_tokens == 9


def exact_with_drafts(stack, model) -> tuple[int, int]:
    """(drafted, accepted) tokens of 13-token answers to three prompts, each the target's."""
    drafted = accepted = 0
    for prompt in PROMPTS[:3]:
        tokens, stats = generate(stack, prompt, 13)
        assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, 13)
        drafted += stats.num_drafted_tokens
        accepted += stats.num_accepted_tokens
    return drafted, accepted


def test_a_head_served_over_q8_0_blocks_keeps_the_output_the_targets(heads):
    """`--dtype auto` serves a draft directory over Q8_0 blocks of its weights on a CPU (the
    kernels build in CI): each linear layer multiplies by blocks that hold exactly its
    (quantized) weight, the output stays the target's, and the head that computes what the
    target computes still has nearly all its drafts accepted."""
    from batchspec.runtime import gguf_blocks

    if not gguf_blocks.load():
        if os.environ.get("CI"):
            pytest.fail("the GGUF kernels must build in CI")
        pytest.skip("no C++ compiler to build the GGUF kernels")
    target_dir, head_dir = heads["exact"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3,
                       draft_dtype="auto") as stack:
        head = stack.draft_runner.model
        quantized = [m for m in (head.fuse, head.lm_head, *head.body.layers[0].mlp.children())
                     if gguf_blocks.blocks_of(getattr(m, "weight", torch.empty(0))) is not None]
        assert len(quantized) >= 4 and all(torch.equal(gguf_blocks.blocks_of(
            m.weight).dequantize(), m.weight) for m in quantized)
        drafted, accepted = exact_with_drafts(stack, model)
        assert drafted >= 27 and accepted >= 0.8 * drafted  # a rejection adds a step


def test_a_head_served_in_bfloat16_keeps_the_output_the_targets(heads):
    """`--dtype auto` serves a feature head in bfloat16 on CPUs that multiply it natively:
    its drafts may differ from float32 ones, the output may not. The head that computes
    what the target computes still has nearly all its drafts accepted, so the drafts are
    the head's, not noise from a misread dtype."""
    target_dir, head_dir = heads["exact"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with running_stack(target_dir, head_dir, batch_size=4, num_draft_tokens=3,
                       draft_dtype="bfloat16") as stack:
        assert stack.draft_runner.model.fuse.weight.dtype == torch.bfloat16
        drafted, accepted = exact_with_drafts(stack, model)
        assert drafted == 27 and accepted >= 0.8 * drafted


def test_auto_picks_q8_0_blocks_for_a_draft_on_a_cpu_else_bfloat16_for_a_head(
        heads, model_dirs, tmp_path, monkeypatch):
    from batchspec.runtime import fastlinear, gguf_blocks
    from batchspec.runtime.service import add_service_arguments, config_from_args

    _, head_dir = heads["llama"]
    _, plain_draft = model_dirs["llama"]  # a model directory, not a distilled draft
    for kernels, native, expected in ((True, True, "auto"), (False, True, "bfloat16"),
                                      (False, False, "float32")):
        monkeypatch.setattr(gguf_blocks, "load", lambda kernels=kernels: kernels)
        monkeypatch.setattr(fastlinear, "native_bfloat16", lambda native=native: native)
        assert models.draft_dtype(head_dir, "cpu") == expected
        parser = argparse.ArgumentParser()
        add_service_arguments(parser, 0, "draft")
        assert config_from_args(parser.parse_args(["--model", head_dir])).dtype == expected
        assert models.draft_dtype(plain_draft, "cpu") == "float32"  # as --dtype says
    assert models.draft_dtype(head_dir, "cuda:0") == "float32"  # a GPU: as --dtype says
    assert models.draft_dtype("ngram", "cpu") == "float32"
    # what serve gives its draft services
    assert models.draft_service_dtype("float32") == "auto"
    assert models.draft_service_dtype("bfloat16") == "bfloat16"
    assert models.draft_service_dtype("float32", "float32") == "float32"
    assert models.draft_service_dtype("auto") == "auto"  # serve's default
    target = argparse.ArgumentParser()
    add_service_arguments(target, 0)
    # a target's auto (its default) is its own: a GGUF file's blocks as stored, not a draft's
    assert config_from_args(target.parse_args(["--model", head_dir])).dtype == "auto"
    assert config_from_args(target.parse_args(["--dtype", "float32"])).dtype == "float32"


def test_a_restarted_feature_draft_is_refilled_from_the_targets_features(heads, monkeypatch):
    """The head's service restarts empty mid-stream: the coordinator prefills the new one
    from the target's features of the committed prefix, and drafting goes on, exactly."""
    import time

    from conftest import wait_for

    real_verify, real_decode = verifier.verify, verifier.decode

    def slow_verify(*args, **kwargs):  # steps slow enough to outlast the reconnection
        time.sleep(0.01)
        return real_verify(*args, **kwargs)

    def slow_decode(runner, rows, steps, **kwargs):  # plain steps too, while the head is down
        time.sleep(0.01 * steps)
        return real_decode(runner, rows, steps, **kwargs)

    monkeypatch.setattr(verifier, "verify", slow_verify)
    monkeypatch.setattr(verifier, "decode", slow_decode)
    target_dir, head_dir = heads["exact"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with running_stack(target_dir, head_dir, batch_size=2, num_draft_tokens=3) as stack:
        call = stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=PROMPTS[1], max_new_tokens=200, ignore_eos=True), timeout=120)
        first = next(call)
        stack.draft_server.stop(0).wait()
        server, _, _, restarted = start_draft(head_dir, port=stack.draft_port)
        try:
            # the new instance is given the sequence (prefilled from its features) and drafts
            assert wait_for(lambda: restarted.caches, timeout=20)
            rest = list(call)
        finally:
            server.stop(0)
        tokens = list(first.token_ids) + [t for r in rest for t in r.token_ids]
        assert tokens == tiny_models.greedy_ignoring_eos(model, PROMPTS[1], 200)
        stats = rest[-1].stats
        assert stats.num_accepted_tokens == stats.num_drafted_tokens > 0


def test_the_in_process_engine_relays_features_too(heads):
    """The benchmark's in-process engine (no gRPC) drives a head the same way."""
    from test_goodput import engine_for, run_all

    target_dir, head_dir = heads["exact"]
    engine, _ = engine_for(target_dir, head_dir, lambda step, batch: [3] * batch,
                           batch_size=4)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    outputs, handles = run_all(engine, [(p, 12) for p in PROMPTS], ignore_eos=True)
    assert outputs == [tiny_models.greedy_ignoring_eos(model, p, 12) for p in PROMPTS]
    drafted = sum(h.seq.stats.num_drafted_tokens for h in handles)
    assert sum(h.seq.stats.num_accepted_tokens for h in handles) == drafted > 0


def with_character_tokenizer(target_dir: str, out) -> str:
    """A copy of a tiny target with a character-level tokenizer of its own."""
    import string

    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(target_dir, out)
    chars = ["<unk>", "<s>", "</s>"] + list(string.ascii_letters + " .")
    backend = Tokenizer(WordLevel({c: i for i, c in enumerate(chars[:tiny.VOCAB])},
                                  unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(out)
    return str(out)


def test_bench_head_check_reports_what_a_head_that_computes_the_targets_features_gets(
        heads, tmp_path):
    """`batchspec bench --head-check`: every draft of the exact head is accepted, at every
    position, greedy and sampled; an untrained head's are not all."""
    from batchspec_tools.bench import head_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": "c", "prompt": p}) + "\n"
                               for p in ("the cat sat", "a dog ran far away")))
    reports, targets = {}, {}
    for arch in ("exact", "llama"):
        target, head = heads[arch]
        targets[arch] = with_character_tokenizer(target, tmp_path / arch)
        reports[arch] = head_check.run(
            targets[arch], head, prompts=str(prompts), num_prompts=2, max_new_tokens=9, k=3,
            head_dtype="float32", min_confidence=0.0)
    assert reports["exact"]["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert reports["exact"]["tokens_per_target_pass"] > 3.0  # K + 1 a pass, but at the end
    assert reports["llama"]["acceptance_rate"] < 1.0
    # sampled: the exact head samples with the noise the target's choice uses, so it still
    # proposes the target's choices; the untrained head agrees less often
    for arch in ("exact", "llama"):
        reports[arch] = head_check.run(
            targets[arch], heads[arch][1], prompts=str(prompts), num_prompts=2, max_new_tokens=9,
            k=3, head_dtype="float32", min_confidence=0.0, temperature=1.0, top_p=0.9)
    assert reports["exact"]["temperature"] == 1.0
    assert reports["exact"]["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert reports["llama"]["acceptance_rate"] < 1.0
    # ... and its sampled answers are not the greedy ones, whatever it drafts
    target, head = runner(heads["exact"][0]), runner(heads["exact"][1])
    answers = []
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        for k in (1, 3):
            answers.append(head_check.decode(target, head, [1, 2, 3], k, 12,
                                             head_check.new_stats(k), params=params)[:12])
    assert answers[0] == answers[1] and answers[2] == answers[3] and answers[0] != answers[2]
