"""The model-runner's batched prefill: right-padded chunks give every sequence the cache an
unbatched prefill gives it."""
import os
import random

import pytest
import torch

from batchspec import packing
from batchspec.runtime import attention, calibration, fastlinear, models
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import VerifyRow


def test_prefill_chunks_bound_padding_and_keep_every_prompt():
    rng = random.Random(0)
    entries = [(i, [1] * rng.randint(1, 60)) for i in range(40)] + [(99, [1] * 500)]
    chunks = list(runner_lib.prefill_chunks(entries, max_tokens=256))
    assert sorted(s for c in chunks for s, _ in c) == sorted(s for s, _ in entries)
    for chunk in chunks:
        padded = len(chunk) * max(len(t) for _, t in chunk)
        assert padded <= 256 or len(chunk) == 1  # a prompt longer than the bound goes alone
    assert [[s for s, _ in c] for c in chunks if c[0][0] == 99] == [[99]]
    assert len(chunks) < len(entries) // 2  # prompts do share forwards


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_prefill_equals_one_at_a_time(model_dirs, arch):
    model = models.load_causal_lm(model_dirs[arch][0])

    def new_runner():
        return runner_lib.ModelRunner(model, name=arch, device=torch.device("cpu"),
                                      eos_token_ids=[], max_context_len=256)

    rng = random.Random(1)
    prompts = {i: [rng.randrange(4, 60) for _ in range(rng.randint(1, 30))] for i in range(6)}
    batched = new_runner()
    assert batched.prefill(list(prompts.items())) == [len(p) for p in prompts.values()]
    for seq_id, prompt in prompts.items():
        alone = new_runner()
        alone.prefill([(seq_id, prompt)])
        got, want = batched.caches[seq_id], alone.caches[seq_id]
        assert got.length == want.length == len(prompt)
        for (k1, v1), (k2, v2) in zip(got.layers, want.layers):
            assert k1.shape == k2.shape
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,budget,split", [("llama", None, False), ("gpt2", None, False),
                                                ("llama", 3, False), ("llama", None, True),
                                                ("gpt2", None, True)])
def test_ragged_groups_match_each_sequence_run_alone(model_dirs, arch, budget, split,
                                                     monkeypatch):
    """Rows of one group feed padding past their real tokens (fewer drafts than the widest
    row) and keep different numbers of the tokens they feed (rejected drafts).
    The group's batch is then reused with those holes masked, or compacted into a left-padded
    copy once holes pass the budget; either way every row's logits are what the model gives
    that sequence alone, with no cache. With `split`, attention runs rows feeding different
    numbers of tokens in calls of their own (the tiny caches are too short for the cost model
    to split them unasked)."""
    if budget is not None:
        monkeypatch.setattr(runner_lib, "hole_budget", lambda longest: budget)
    calls = []
    if split:  # packed (a handful of padding positions would not be): split by query counts
        monkeypatch.setattr(packing, "MIN_PADDING", 1)
        monkeypatch.setattr(attention, "CALL_US", 0.0)
        real_plan = attention.plan
        monkeypatch.setattr(attention, "plan", lambda *a: calls.append(real_plan(*a)) or calls[-1])
    model = models.load_causal_lm(model_dirs[arch][0])
    runner = runner_lib.ModelRunner(model, name=arch, device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    rng = random.Random(2)
    tokens = {i: [rng.randrange(4, 90) for _ in range(rng.randint(2, 12))] for i in range(4)}
    runner.prefill(list(tokens.items()))
    resident = copied = 0
    assert runner.packs_positions  # linear layers skip each row's right padding
    for _ in range(14):
        fed = {i: [rng.randrange(4, 90) for _ in range(3)] for i in tokens}
        real = {i: rng.randint(1, 3) for i in tokens}  # the rest is padding (fewer drafts)
        valid = torch.tensor([[j < real[i] for j in range(3)] for i in tokens])
        specs = [runner_lib.RowSpec(i, len(tokens[i]), len(tokens[i]), fed[i]) for i in tokens]
        group = runner.open_group(specs, realign=True)
        resident += group.realigned and not group.copied
        copied += group.copied
        logits = group.step(torch.tensor([fed[i] for i in tokens]), num_logits=3, valid=valid)
        for row, i in enumerate(tokens):
            with torch.inference_mode():
                alone = model(input_ids=torch.tensor([tokens[i] + fed[i][:real[i]]])).logits[0]
            torch.testing.assert_close(logits[row, :real[i]], alone[-real[i]:].float(),
                                       rtol=1e-4, atol=1e-4)
        kept = {i: rng.randint(0, real[i]) for i in tokens}
        runner.store(list(tokens), group.rows_after([len(tokens[i]) + kept[i] for i in tokens]))
        for i in tokens:
            tokens[i] += fed[i][:kept[i]]
    assert resident > 0  # the group's own batch was reused with holes
    if budget is not None:
        assert copied > 1  # and compacted when they grew past the budget
    if split:
        assert max(len(runs) for runs in calls) > 1


@pytest.mark.parametrize("padded_rows,packed", [(1, False), (2, True)])
def test_a_forward_is_packed_only_when_padded_enough(model_dirs, monkeypatch, padded_rows,
                                                     packed):
    """Packing gathers and scatters around every block: a verify whose padding is a few
    positions runs padded (4 of them here), one with at least packing.MIN_PADDING (8 here)
    skips them. Either way each row's logits are what the model gives that sequence alone."""
    assert 4 < packing.MIN_PADDING <= 8
    model = models.load_causal_lm(model_dirs["llama"][0])
    runner = runner_lib.ModelRunner(model, name="llama", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    entered = []
    real_only = fastlinear.only_positions
    monkeypatch.setattr(fastlinear, "only_positions",
                        lambda valid: entered.append(valid) or real_only(valid))
    rng = random.Random(3)
    tokens = {i: [rng.randrange(4, 90) for _ in range(5 + i)] for i in range(4)}
    runner.prefill(list(tokens.items()))
    entered.clear()  # prompts of different lengths: their own padding
    fed = {i: [rng.randrange(4, 90) for _ in range(5)] for i in tokens}
    real = {i: 1 if i < padded_rows else 5 for i in tokens}  # 4 padding positions a row
    valid = torch.tensor([[j < real[i] for j in range(5)] for i in tokens])
    assert int((~valid).sum()) == 4 * padded_rows
    group = runner.open_group([runner_lib.RowSpec(i, len(t), len(t), fed[i])
                               for i, t in tokens.items()], realign=True)
    logits = group.step(torch.tensor([fed[i] for i in tokens]), num_logits=5, valid=valid)
    assert bool(entered) == packed
    for row, i in enumerate(tokens):
        with torch.inference_mode():
            alone = model(input_ids=torch.tensor([tokens[i] + fed[i][:real[i]]])).logits[0]
        torch.testing.assert_close(logits[row, :real[i]], alone[-real[i]:].float(),
                                   rtol=1e-4, atol=1e-4)


def test_holes_are_compacted_before_they_widen_attention_much(model_dirs):
    """Rejected drafts leave holes in a resident batch, which every later forward attends over
    (masked). A batch is compacted once its holes pass a sixteenth of its longest row (at
    least 8 columns): over ~200 positions a budget of half the row let plain steps of 32 rows
    attend over up to half as many columns again, 3% slower than without drafts."""
    model = models.load_causal_lm(model_dirs["llama"][0])
    runner = runner_lib.ModelRunner(model, name="llama", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=512)
    rng = random.Random(5)
    lengths = {1: 160, 2: 160}
    runner.prefill([(i, [rng.randrange(4, 90) for _ in range(n)]) for i, n in lengths.items()])
    excess, copies = [], 0
    for step in range(20):
        specs = [runner_lib.RowSpec(i, n, n, [rng.randrange(4, 90) for _ in range(4)])
                 for i, n in lengths.items()]
        group = runner.open_group(specs, realign=True)
        excess.append(group.width - max(lengths.values()))
        copies += group.copied
        group.step(torch.tensor([s.append_token_ids for s in specs]), num_logits=1)
        # each row keeps one of its four (three rejected drafts), the other row all four in
        # turn: the longest row has holes too
        kept = {i: 4 if (i + step) % 2 else 1 for i in lengths}
        runner.store(list(lengths), group.rows_after([lengths[i] + kept[i] for i in lengths]))
        lengths = {i: lengths[i] + kept[i] for i in lengths}
    assert copies >= 2  # compacted more than once in 20 steps ...
    budget = runner_lib.hole_budget(max(lengths.values()))
    assert budget == max(8, max(lengths.values()) // 16)
    assert max(excess) <= budget + 4  # ... never letting holes grow past one step beyond it


def test_a_copied_prefill_shares_its_source_and_continues_as_a_computed_one(model_dirs):
    """n choices of one prompt: the copies start from the source's first positions (no
    forward), and a step after the copy gives the logits a computed prefill gives; the
    source may be computed by the same command or cached already, never missing or short."""
    from batchspec import errors

    model = models.load_causal_lm(model_dirs["llama"][0])
    runner = runner_lib.ModelRunner(model, name="llama", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    prompt = [5, 9, 14, 22, 31, 7]
    assert runner.prefill_copies([(1, prompt), (2, prompt[:4]), (3, prompt)], {3: 1}) == [6, 4, 6]
    assert runner.prefill_copies([(4, prompt[:5])], {4: 3}) == [5]
    assert runner.caches[3].home is runner.caches[1].home  # views, not a copy
    reference = runner_lib.ModelRunner(model, name="llama", device=torch.device("cpu"),
                                       eos_token_ids=[], max_context_len=256)
    reference.prefill([(4, prompt[:5])])

    def next_logits(r, seq_id):
        group = r.open_group([runner_lib.RowSpec(seq_id, 5, 5, [prompt[5]])], realign=False)
        return group.step(torch.tensor([[prompt[5]]]), num_logits=1)

    torch.testing.assert_close(next_logits(runner, 4), next_logits(reference, 4))
    with pytest.raises(errors.NotFound):
        runner.prefill_copies([(5, prompt)], {5: 77})
    with pytest.raises(errors.FailedPrecondition):
        runner.prefill_copies([(6, prompt)], {6: 2})  # 2 holds 4 positions, not 6
    with pytest.raises(errors.InvalidArgument):
        runner.prefill_copies([(7, prompt), (8, prompt)], {7: 8, 8: 7})


def test_a_batch_is_written_over_only_where_no_stored_sequence_holds_the_columns(model_dirs):
    """A verify's rejected drafts are written over in place by the next step (no holes, no
    copy); where another sequence still holds those columns (a copy of the sequence made
    before it was trimmed), the next step writes after them and the copy is left as it was."""
    model = models.load_causal_lm(model_dirs["llama"][0])

    def new_runner():
        return runner_lib.ModelRunner(model, name="llama", device=torch.device("cpu"),
                                      eos_token_ids=[], max_context_len=256)

    def step(r, seq_id, cached, tokens, keep):
        group = r.open_group([runner_lib.RowSpec(seq_id, cached, cached, tokens)],
                             realign=False)
        logits = group.step(torch.tensor([tokens]), num_logits=1)
        r.store([seq_id], group.rows_after([keep]))
        return group, logits

    prompt = [5, 9, 14, 22, 31, 7, 11, 40]
    runner = new_runner()
    runner.prefill([(1, prompt)])
    step(runner, 1, 8, [17, 18, 19], keep=9)  # two drafts rejected
    buffer = runner.caches[1].home.buffers[0]
    assert buffer.written == 11
    group, _ = step(runner, 1, 9, [20], keep=10)
    assert group.width == 10 and group.mask is None  # written over the rejected columns
    assert runner.caches[1].home.buffers[0] is buffer and buffer.written == 10  # in place
    runner.prefill_copies([(2, prompt + [17, 20])], {2: 1})  # holds columns 0..9
    runner.trim([(1, 10, 9)])
    group, _ = step(runner, 1, 9, [21], keep=10)
    assert group.width == 11 and group.mask is not None  # after column 9, which 2 holds
    _, got = step(runner, 2, 10, [23], keep=11)
    reference = new_runner()
    reference.prefill([(2, prompt + [17, 20])])
    _, want = step(reference, 2, 10, [23], keep=11)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "head"])
def test_forwards_pass_the_cache_by_the_keyword_the_installed_transformers_takes(
        model_dirs, arch, tmp_path):
    """transformers 5 renamed a forward's `past_key_values` to `cache` (the old name warns,
    and goes in 5.40): prefill and verify of targets and of a feature head pass it by the
    name their forward takes, so neither warns."""
    import warnings

    from batchspec.params import SamplingParams
    from batchspec.runtime import kvcache, tiny
    from target_service import verifier

    path = tiny.save_feature_head(model_dirs["llama"][0], tmp_path / "head") \
        if arch == "head" else model_dirs[arch][0]
    model = models.load_causal_lm(path)
    runner = runner_lib.ModelRunner(model, name=arch, device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    assert runner.cache_keyword == kvcache.cache_keyword(model)
    features = calibration.zero_features(runner, 1, 5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        runner.prefill([(1, [5, 6, 7, 8, 9])], {1: features[0]} if arch == "head" else None)
        if arch == "head":
            group = runner.open_group([runner_lib.RowSpec(1, 5, 5, [10])], realign=False)
            group.step(torch.tensor([[10]]), num_logits=1,
                       features=calibration.zero_features(runner, 1, 1))
        else:
            verifier.verify(runner, [VerifyRow(1, 5, [10], [11, 12],
                                                        SamplingParams())], realign=False)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "head"])
def test_rows_that_leave_and_join_keep_the_batch_and_every_rows_logits(model_dirs, arch,
                                                                       tmp_path):
    """Sequences finish and new ones arrive as clients come and go. The batch is kept: a
    newcomer is copied into a row no stored sequence holds (right-aligned at the batch's
    width, which a longer newcomer widens), a row that left stays vacant (fed a token nothing
    keeps), and a sequence that sits a step out keeps its row. Rows come in any order. Every
    row's logits and final hidden states are what the model gives that sequence alone, with
    no cache (a feature head: given the same features, over its own vocabulary)."""
    from batchspec.runtime import tiny

    path = tiny.save_feature_head(model_dirs["llama"][0], tmp_path / "head") \
        if arch == "head" else model_dirs[arch][0]
    model = models.load_causal_lm(path)
    runner = runner_lib.ModelRunner(model, name=arch, device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    width_of_features = runner.reads_features
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)

    def features_of(count):  # what a feature head is fed with `count` tokens (else nothing)
        return torch.randn(count, width_of_features, generator=generator) \
            if width_of_features else torch.zeros(count, 0)

    def admit(prompts):
        fed = {i: features_of(len(t)) for i, t in prompts.items()}
        runner.prefill(list(prompts.items()), fed if width_of_features else None)
        tokens.update(prompts)
        features.update(fed)

    tokens, features = {}, {}
    admit({i: [rng.randrange(4, 90) for _ in range(rng.randint(10, 20))] for i in range(16)})
    next_id, seated, vacant, widened, resting, width_before = 16, 0, 0, 0, None, 0
    for step in range(21):
        if step % 3 == 1:  # one or two sequences finish
            leaving = rng.sample(sorted(set(tokens) - {resting}), rng.randint(1, 2))
            runner.release(leaving)
            for i in leaving:
                del tokens[i], features[i]
        elif step % 3 == 2:  # as many arrive, prefilled alone, some longer than the batch
            count = 16 - len(tokens)
            admit({next_id + j: [rng.randrange(4, 90) for _ in range(rng.randint(3, 40))]
                   for j in range(count)})
            next_id += count
        resting = rng.choice(sorted(tokens)) if step % 7 == 3 else None  # stored, sits out
        order = [i for i in rng.sample(sorted(tokens), len(tokens)) if i != resting]
        width = 1 if step % 2 else 3
        fed = {i: [rng.randrange(4, 90) for _ in range(width)] for i in order}
        fed_features = {i: features_of(width) for i in order}
        real = {i: rng.randint(1, width) for i in order}
        valid = torch.tensor([[j < real[i] for j in range(width)] for i in order])
        group = runner.open_group([runner_lib.RowSpec(i, len(tokens[i]), len(tokens[i]),
                                                      fed[i]) for i in order], realign=True)
        placed = group.slots is not None
        seated += placed and step % 3 == 2
        vacant += placed and len(group.lengths) > len(order)
        widened += placed and step % 3 == 2 and group.width > width_before
        logits = group.step(torch.tensor([fed[i] for i in order]), num_logits=width,
                            valid=valid if width > 1 else None, keep_hidden=True,
                            features=torch.stack([fed_features[i] for i in order])
                            if width_of_features else None)
        for row, i in enumerate(order):
            ids = torch.tensor([tokens[i] + fed[i][:real[i]]])
            with torch.inference_mode():
                if width_of_features:
                    alone = model(input_ids=ids, features=torch.cat(
                        [features[i], fed_features[i][:real[i]]])[None],
                        logits_to_keep=ids.shape[1])
                    hidden = alone.hidden[0]
                else:
                    alone = model(input_ids=ids, output_hidden_states=True)
                    hidden = alone.hidden_states[-1][0]
            expected = alone.logits[0, -real[i]:].float()
            if runner.logit_token_ids is not None:  # a head's logits: its own vocabulary's
                expected = expected[:, runner.logit_token_ids]
            torch.testing.assert_close(logits[row, :real[i]], expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(group.hidden[row, :real[i]], hidden[-real[i]:],
                                       rtol=1e-4, atol=1e-4)
        kept = {i: rng.randint(1, real[i]) for i in order}
        runner.store(order, group.rows_after([len(tokens[i]) + kept[i] for i in order]))
        for i in order:
            tokens[i] += fed[i][:kept[i]]
            features[i] = torch.cat([features[i], fed_features[i][:kept[i]]])
        width_before = group.width
    assert widened > 0  # a newcomer longer than the batch widened it
    assert seated > 3  # newcomers took rows of the running batch
    assert vacant > 3  # rows that left stayed vacant instead of a copy of the batch


@pytest.mark.parametrize("arch", ["llama", "gpt2", "head", "gguf"])
def test_the_lean_forward_gives_transformers_logits_bit_for_bit(model_dirs, arch, tmp_path,
                                                                monkeypatch):
    """The runtime's own forward does what transformers' forward does: prompts of several
    lengths prefilled together, then ragged verifies over a batch with holes (masked) and
    plain steps, give the same logits and final hidden states as the transformers forward,
    bit for bit; a GGUF model's included (its projections joined, its norms and rotations
    inline; its steps in one C++ call, which round otherwise, are tested apart)."""
    from batchspec.runtime import decode_step, gguf_blocks, tiny

    if arch == "gguf" and not gguf_blocks.load() and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the GGUF kernels")  # in CI they must build
    if arch == "gguf":
        monkeypatch.setattr(decode_step.Decoder, "__call__", lambda self, *args: None)
    path = tiny.save_feature_head(model_dirs["llama"][0], tmp_path / "head") \
        if arch == "head" else tiny.save_gguf(tmp_path) if arch == "gguf" \
        else model_dirs[arch][0]
    model = models.load_causal_lm(path, dtype="auto" if arch == "gguf" else "float32")
    if arch == "gguf":
        assert gguf_blocks.blocks_of(model.model.layers[0].mlp.up_proj.weight) is not None
    runners = [runner_lib.ModelRunner(model, name=arch, device=torch.device("cpu"),
                                      eos_token_ids=[], max_context_len=256, lean=lean)
               for lean in (True, False)]
    assert runners[0].lean_forward is not None and runners[1].lean_forward is None
    width = runners[0].reads_features
    generator = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    prompts = {i: [rng.randrange(4, 90) for _ in range(n)] for i, n in enumerate((9, 14, 11))}
    prompt_features = {i: torch.randn(len(t), width, generator=generator)
                       for i, t in prompts.items()} if width else None
    lengths = {i: len(t) for i, t in prompts.items()}
    for runner in runners:
        runner.prefill(list(prompts.items()), prompt_features)
    for step in range(6):
        fed = 4 if step % 2 == 0 else 1
        tokens = torch.tensor([[rng.randrange(4, 90) for _ in range(fed)] for _ in lengths])
        features = torch.randn(len(lengths), fed, width, generator=generator) if width else None
        real = torch.tensor([rng.randint(1, fed) for _ in lengths])
        valid = torch.arange(fed)[None, :] < real[:, None] if fed > 1 else None
        kept = [rng.randint(1, int(n)) for n in real]
        results = []
        for runner in runners:
            group = runner.open_group([runner_lib.RowSpec(i, n, n, [0] * fed)
                                       for i, n in lengths.items()], realign=True)
            logits = group.step(tokens, num_logits=fed, valid=valid, features=features,
                                keep_hidden=True)
            results.append((logits, group.hidden))
            runner.store(list(lengths), group.rows_after([n + k for n, k in
                                                          zip(lengths.values(), kept)]))
        for i, n in enumerate(real.tolist()):  # padding's outputs are never read
            assert torch.equal(results[0][0][i, :n], results[1][0][i, :n])
            assert torch.equal(results[0][1][i, :n], results[1][1][i, :n])
        lengths = {i: n + k for (i, n), k in zip(lengths.items(), kept)}


def test_a_float32_step_in_one_call_gives_transformers_logits_bit_for_bit(model_dirs,
                                                                          monkeypatch):
    """Steps of a float32 model that feed every row one position, or the same number of
    drafts under the causal mask, run all layers in one C++ call (decode_step); their logits
    and hidden states are transformers' forward's bit for bit, past the point where every
    layer's buffer must move to a larger one, and for a row alone after its batch."""
    from batchspec.runtime import decode_step, gguf_blocks

    if not gguf_blocks.load() and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the GGUF kernels")  # in CI they must build
    model = models.load_causal_lm(model_dirs["llama"][0])
    runners = [runner_lib.ModelRunner(model, name="gguf", device=torch.device("cpu"),
                                      eos_token_ids=[], max_context_len=256, lean=lean)
               for lean in (True, False)]
    taken = []
    call = decode_step.Decoder.__call__
    monkeypatch.setattr(decode_step.Decoder, "__call__",
                        lambda self, *args: taken.append(call(self, *args)) or taken[-1])
    rng = random.Random(5)
    batch = 5  # five rows of four drafts pass fastlinear.MAX_ROWS (the usual product)
    prompts = {i: [rng.randrange(4, 90) for _ in range(7)] for i in range(batch)}
    for runner in runners:
        runner.prefill(list(prompts.items()))
    length = 7
    for step in range(40):
        rows = list(prompts) if step < 30 else [1]  # the batch, then one row of it alone
        fed = 4 if step % 3 == 0 else 1  # a verify of drafts, or a decode step
        kept = rng.randint(1, fed)
        tokens = torch.tensor([[rng.randrange(4, 90) for _ in range(fed)] for _ in rows])
        results = []
        for runner in runners:
            group = runner.open_group([runner_lib.RowSpec(i, length, length, [0] * fed)
                                       for i in rows], realign=False)
            logits = group.step(tokens, num_logits=fed, keep_hidden=True)
            results.append((logits, group.hidden))
            runner.store(rows, group.rows_after([length + kept] * len(rows)))
        assert torch.equal(results[0][0], results[1][0])
        assert torch.equal(results[0][1], results[1][1])
        length += kept
        if step == 29:
            for runner in runners:
                runner.release([i for i in prompts if i != 1])
    # every step of the lean runner took the one-call step (the prefill did not)
    assert sum(t is not None for t in taken) == 40


def test_a_gguf_step_computes_each_position_as_a_step_of_it_alone(tmp_path, monkeypatch):
    """A GGUF model's steps run in one C++ call (decode_step, csrc/step_ops.h): a batch
    verifying drafts under holes left by rejected ones gives each kept position's logits and
    hidden states bit for bit as steps of its row alone, one position at a time, give them;
    and transformers' forward's up to rounding (the products' and softmax's summation order)."""
    from batchspec.runtime import decode_step, gguf_blocks, tiny

    if not gguf_blocks.load() and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the GGUF kernels")  # in CI they must build
    model = models.load_causal_lm(tiny.save_gguf(tmp_path), dtype="auto")
    batched, alone, stock = [
        runner_lib.ModelRunner(model, name="gguf", device=torch.device("cpu"), eos_token_ids=[],
                               max_context_len=256, lean=lean) for lean in (True, True, False)]
    taken = []
    call = decode_step.Decoder.__call__
    monkeypatch.setattr(decode_step.Decoder, "__call__",
                        lambda self, *args: taken.append(call(self, *args)) or taken[-1])
    rng = random.Random(5)
    prompts = {i: [rng.randrange(4, 90) for _ in range(7 + 2 * i)] for i in range(3)}
    for runner in (batched, alone, stock):
        runner.prefill(list(prompts.items()))
    lengths = {i: len(p) for i, p in prompts.items()}
    steps = 30  # the batch's
    for step in range(30):
        fed = 4 if step % 3 == 0 else 1  # a verify of drafts, or a decode step
        tokens = torch.tensor([[rng.randrange(4, 90) for _ in range(fed)] for _ in prompts])
        kept = [rng.randint(1, fed) for _ in prompts]
        results = []
        for runner in (batched, stock):
            group = runner.open_group([runner_lib.RowSpec(i, n, n, [0] * fed)
                                       for i, n in lengths.items()], realign=True)
            results.append((group.step(tokens, num_logits=fed, keep_hidden=True),
                            group.hidden))
            runner.store(list(lengths), group.rows_after([lengths[i] + k for i, k in
                                                          zip(prompts, kept)]))
        (logits, hidden), (stock_logits, stock_hidden) = results
        for row, (i, n) in enumerate(lengths.items()):
            torch.testing.assert_close(logits[row], stock_logits[row], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hidden[row], stock_hidden[row], rtol=1e-4, atol=1e-4)
            for j in range(kept[row]):  # the kept positions, one step each, the row alone
                group = alone.open_group([runner_lib.RowSpec(i, n + j, n + j, [0])],
                                         realign=False)
                one = group.step(tokens[row:row + 1, j:j + 1], num_logits=1, keep_hidden=True)
                alone.store([i], group.rows_after([n + j + 1]))
                assert torch.equal(one[0, 0], logits[row, j])
                assert torch.equal(group.hidden[0, 0], hidden[row, j])
        lengths = {i: n + k for (i, n), k in zip(lengths.items(), kept)}
        steps += sum(kept)
    # every step of the two lean runners took the one-call step (their prefills did not)
    assert sum(t is not None for t in taken) == steps


def test_a_gguf_step_is_widened_only_as_far_as_it_measured_faster():
    """StepWidening: past the blocks' own limit the step in one call takes each batch size it
    was faster for than the lean forward, up to the first it was not; a failed timing leaves
    the limit where it was."""
    import types

    decoder = types.SimpleNamespace(max_rows=8, shapes=())
    widening = calibration.StepWidening(decoder)
    # (in one call, lean), and where one call lost, timed again in the other order (lean,
    # in one call)
    timings = {16: (1.0, 2.0), 32: (3.0, 2.0, 2.0, 3.5), 64: (1.0, 9.0)}

    def seconds_of(positions):
        calls = iter(timings[positions])
        return lambda: next(calls)

    for positions in (1, 8, 16, 32, 64):
        widening.weigh(positions, seconds_of(positions) if positions in timings else None)
    assert decoder.max_rows == 16  # 32 was slower in one call: 64 is never tried
    decoder.max_rows, widening = 16, calibration.StepWidening(decoder)

    def fails():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        widening.weigh(32, fails)
    assert decoder.max_rows == 16


def test_a_widened_gguf_step_computes_each_row_as_a_step_of_it_alone(tmp_path, monkeypatch):
    """Past the positions its blocks are timed for (16 for a model that fits the CPU's cache),
    a widened step in one call still gives each row's hidden states bit for bit as a step of
    that row alone; the calibration that widens it leaves no sequence cached."""
    from batchspec.runtime import decode_step, gguf_blocks, tiny

    if not gguf_blocks.load() and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the GGUF kernels")  # in CI they must build
    model = models.load_causal_lm(tiny.save_gguf(tmp_path), dtype="auto")
    runner = runner_lib.ModelRunner(model, name="gguf", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    decoder = runner.lean_forward.decoder
    floor = decoder.max_rows
    costs = calibration.measure_step_costs(runner, rows=(1, 2 * floor), tokens=(1,), context=8)
    assert floor <= decoder.max_rows <= 2 * floor and not runner.caches
    assert {c.rows for c in costs} == {1, 2 * floor}
    decoder.max_rows = 4 * floor
    taken = []
    call = decode_step.Decoder.__call__
    monkeypatch.setattr(decode_step.Decoder, "__call__",
                        lambda self, *args: taken.append(call(self, *args)) or taken[-1])
    rng = random.Random(7)
    rows = 2 * floor + 3
    prompts = {i: [rng.randrange(4, 90) for _ in range(5 + i % 4)] for i in range(rows)}
    alone = runner_lib.ModelRunner(model, name="gguf", device=torch.device("cpu"),
                                   eos_token_ids=[], max_context_len=256)
    for each in (runner, alone):  # the same prefill: the same cached positions
        each.prefill(list(prompts.items()))
    tokens = torch.tensor([[rng.randrange(4, 90)] for _ in prompts])
    group = runner.open_group([runner_lib.RowSpec(i, len(p), len(p), [0])
                               for i, p in prompts.items()], realign=True)
    logits = group.step(tokens, num_logits=1, keep_hidden=True)
    assert taken and taken[-1] is not None  # the whole batch in one call
    for row, (i, prompt) in enumerate(prompts.items()):
        one = alone.open_group([runner_lib.RowSpec(i, len(prompt), len(prompt), [0])],
                               realign=False)
        one_logits = one.step(tokens[row:row + 1], num_logits=1, keep_hidden=True)
        assert torch.equal(one.hidden[0], group.hidden[row])
        # (the output head multiplies by float32 weights past its blocks' rows: rounding)
        torch.testing.assert_close(one_logits[0], logits[row], rtol=1e-4, atol=1e-4)


def test_forward_costs_are_measured_once_per_build_model_and_machine(tmp_path, monkeypatch):
    """kept_step_costs: the first start measures and keeps the costs (and the GGUF step's
    widening); a later start of the same model reads them and times only its one-row
    forwards again, keeping each at its least time; another model, a draft's way of
    measuring, another thread count or an unreadable store measure the whole grid again."""
    import itertools
    import json
    import types

    from batchspec.runtime import tiny

    full, one_row = [], itertools.chain([0.004, 0.02], itertools.repeat(1.0))

    def measure(runner, rows=None, proposes=False):
        if rows is not None:  # timed again: one row
            assert rows == (1,)
            return [calibration.StepCost(1, 1, 128, next(one_row))]
        full.append((runner.name, proposes))
        widening = calibration.StepWidening.of(runner)
        if widening is not None:
            widening.decoder.max_rows = 48
        return [calibration.StepCost(1, 1, 128, 0.05),  # timed in a busy stretch
                calibration.StepCost(2, 1, 128, 0.01 * len(full))]

    monkeypatch.setattr(calibration, "measure_step_costs", measure)

    def runner_of(model, name):
        return runner_lib.ModelRunner(model, name=name, device=torch.device("cpu"),
                                      eos_token_ids=[], max_context_len=256)

    store = tmp_path / "step-costs.json"
    llama = runner_of(tiny.llama(seed=1), "a")
    first, when = calibration.kept_step_costs(llama, False, store)
    assert when is None and full == [("a", False)] and first[0].seconds == 0.05
    for least in (0.004, 0.004):  # timed again at 0.004, then at 0.02: the least kept
        again, when = calibration.kept_step_costs(runner_of(tiny.llama(seed=2), "b"), False,
                                                  store)  # other weights, the same model
        assert [c.seconds for c in again] == [least, 0.01] and when and len(full) == 1
    calibration.kept_step_costs(llama, True, store)  # as a draft proposes
    calibration.kept_step_costs(runner_of(tiny.gpt2(seed=1), "c"), False, store)
    with monkeypatch.context() as patched:
        patched.setattr(torch, "get_num_threads", lambda: 99)
        calibration.kept_step_costs(llama, False, store)
    assert full == [("a", False), ("a", True), ("c", False), ("a", False)]
    assert len(json.loads(store.read_text())) == 4
    store.write_text("{not json")
    calibration.kept_step_costs(llama, False, store)
    assert len(full) == 5 and len(json.loads(store.read_text())) == 1
    # a GGUF step is widened as it was when its costs were measured
    decoder = types.SimpleNamespace(max_rows=8, shapes=())
    gguf = runner_of(tiny.llama(seed=1), "gguf")
    gguf.lean_forward = types.SimpleNamespace(decoder=decoder)
    calibration.kept_step_costs(gguf, False, store)
    decoder.max_rows = 8
    calibration.kept_step_costs(gguf, False, store)
    assert decoder.max_rows == 48 and len(full) == 6
    assert calibration.kept_step_costs(llama, False, None)[1] is None and len(full) == 7


def test_a_forward_timed_in_a_busy_stretch_costs_what_more_work_cost():
    """A spike (another process took the cores during one timing) is cut to the least cost
    of forwards doing at least its work; every cost stays within what was measured, and
    doing more never costs less."""
    measured = {(1, 1): 74.7, (1, 2): 13.7, (1, 5): 13.1, (2, 1): 8.5, (2, 2): 11.2,
                (2, 5): 35.9, (4, 1): 15.8, (4, 2): 114.8, (4, 5): 191.3}
    costs = calibration.without_spikes([calibration.StepCost(r, t, 128, s)
                                        for (r, t), s in measured.items()])
    got = {(c.rows, c.tokens): c.seconds for c in costs}
    assert got[(1, 1)] == 8.5 and got[(4, 2)] == 114.8 and got[(1, 2)] == 11.2
    assert all(got[k] <= measured[k] for k in measured)
    assert all(got[a] <= got[b] for a in got for b in got if b[0] >= a[0] and b[1] >= a[1])
    assert {(c.rows, c.tokens, c.context) for c in costs} == {(r, t, 128) for r, t in measured}


def test_a_service_keeps_what_it_measures_where_batchspec_measured_dir_says(tmp_path,
                                                                           monkeypatch):
    """A service's start-up (service.warm_up) keeps the forward costs it measured in
    $BATCHSPEC_MEASURED_DIR (a container's volume: read again by the next container), else
    in the user cache; the converted models stay in the user cache either way."""
    import json

    from batchspec.runtime import cache_dir, models, service, tiny

    monkeypatch.setattr(calibration, "measure_step_costs",
                        lambda runner, rows=None, proposes=False:
                        [calibration.StepCost(1, 1, 128, 0.01)])
    monkeypatch.delenv("BATCHSPEC_MEASURED_DIR", raising=False)
    assert cache_dir.step_costs_file().parent == cache_dir.kernel_plans_file().parent \
        == cache_dir.user_cache_dir()
    monkeypatch.setenv("BATCHSPEC_MEASURED_DIR", str(tmp_path / "measured"))
    runner = runner_lib.ModelRunner(tiny.llama(seed=1), name="a", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    service.warm_up(runner)
    assert json.loads((tmp_path / "measured" / "step-costs.json").read_text())
    assert cache_dir.kernel_plans_file().parent == tmp_path / "measured"
    gguf = models.resolve(tiny.save_gguf(tmp_path))
    assert models.gguf_cache_dir(gguf, "models").parent.parent == cache_dir.user_cache_dir()
