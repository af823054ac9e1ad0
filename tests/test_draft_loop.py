"""A draft's greedy steps in one C++ call (runtime/draft_loop.py): the proposals, caches and
cuts of the Python steps, over rows of different lengths, rejected drafts, rows that leave and
join, greedy and sampled rows; float32 weights and GGUF blocks; causal LMs and feature
heads."""
import os
import random

import pytest
import torch

from batchspec.params import SamplingParams
from batchspec.runtime import draft_loop, gguf_blocks, models, tiny
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import ProposeRow
from draft_service import proposer

GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def kernels():
    if not gguf_blocks.load() and not os.environ.get("CI"):
        pytest.skip("no C++ compiler to build the kernels")  # in CI they must build


def _runners(model):
    looped, stepped = (runner_lib.ModelRunner(model, name="draft", device=torch.device("cpu"),
                                              eos_token_ids=[], max_context_len=256)
                       for _ in range(2))
    stepped.draft_loop = None  # (a cached property: this runner keeps the Python steps)
    return looped, stepped


def _model(kind, model_dirs, tmp_path):
    if kind == "gguf":
        return models.load_causal_lm(tiny.save_gguf(tmp_path), dtype="auto")
    if kind.startswith("head"):  # a feature head; "head-q8": its products over Q8_0 blocks
        path = tiny.save_feature_head(model_dirs["llama"][0], tmp_path / "head")
        return models.load_causal_lm(path, dtype="auto" if kind == "head-q8" else "float32")
    return models.load_causal_lm(model_dirs["llama"][0])


# a row's sampling settings by its seq_id: greedy, top-p, top-k, the whole distribution
SETTINGS = (GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=7),
            SamplingParams(temperature=1.0, top_k=5, seed=8),
            SamplingParams(temperature=1.2, seed=9))


@pytest.mark.parametrize("kind,min_confidence,sampled", [
    ("float32", 0.0, False), ("float32", 0.05, False), ("float32", 0.0, True),
    ("gguf", 0.0, False), ("head", 0.0, False), ("head-q8", 0.0, True)])
def test_the_loop_proposes_what_the_python_steps_propose(model_dirs, tmp_path, monkeypatch,
                                                          kind, min_confidence, sampled):
    """Rounds of proposals over rows of different lengths (a masked batch), some drafts
    rejected, rows leaving and new ones joining; with `sampled`, greedy and sampled rows of
    different settings in one group: the loop's drafts, cache lengths and cuts are the Python
    steps' (the tiny models' logits, and sampled rows' scores, are nowhere within rounding of
    a tie), and the next round's proposals from its caches are too."""
    model = _model(kind, model_dirs, tmp_path)
    looped, stepped = _runners(model)
    assert looped.draft_loop is not None
    width = looped.reads_features
    calls = []
    real = draft_loop.DraftLoop.__call__
    monkeypatch.setattr(draft_loop.DraftLoop, "__call__",
                        lambda self, *a, **k: calls.append((a[0].shape[1], a[4]))
                        or real(self, *a, **k))
    rng = random.Random(3)
    generator = torch.Generator().manual_seed(3)
    committed = {}  # seq_id -> committed tokens
    features = {}  # seq_id -> a feature head's: the target's features before each token
    held = {}  # seq_id -> (positions cached, of which matching `committed`)
    next_id = 0
    cut_lengths = []
    groups = 0

    def features_of(seq_id, start, end):
        if not width:
            return None
        while len(features[seq_id]) < end:
            features[seq_id].append(torch.randn(width, generator=generator))
        return torch.stack(features[seq_id][start:end])

    def join(count):
        nonlocal next_id
        for _ in range(count):
            prompt = [rng.randrange(4, 90) for _ in range(rng.randint(3, 20))]
            committed[next_id], features[next_id] = prompt, []
            fed = features_of(next_id, 0, len(prompt) - 1)
            for runner in (looped, stepped):
                runner.prefill([(next_id, prompt[:-1])],
                               None if fed is None else {next_id: fed})
            held[next_id] = (len(prompt) - 1, len(prompt) - 1)
            next_id += 1

    join(5)
    for round_ in range(24):
        rows = [ProposeRow(i, held[i][0], held[i][1], committed[i][held[i][1]:],
                           SETTINGS[i % len(SETTINGS)] if sampled else GREEDY,
                           features_of(i, held[i][1], len(committed[i])))
                for i in committed]
        proposed = []
        for appended in sorted({len(r.append_token_ids) for r in rows}):  # a group each
            group = [r for r in rows if len(r.append_token_ids) == appended]
            results = [proposer.propose(runner, group, 4, realign=True,
                                        min_confidence=min_confidence)[0]
                       for runner in (looped, stepped)]
            assert results[0] == results[1]
            proposed += zip(group, results[0])
            groups += 1
            cut_lengths += [len(p.draft_token_ids) for p in results[0] if p.cut]
        for row, proposal in proposed:
            drafts = proposal.draft_token_ids
            accepted = rng.randint(0, len(drafts))
            fed = len(committed[row.seq_id])  # cached: the committed tokens, then drafts
            committed[row.seq_id] += drafts[:accepted] + [rng.randrange(4, 90)]
            held[row.seq_id] = (proposal.cache_len,
                                min(proposal.cache_len, fed + accepted))
        if round_ % 6 == 5:  # one leaves, two join: the loop runs over a seated batch
            gone = rng.choice(sorted(committed))
            for runner in (looped, stepped):
                runner.release([gone])
            del committed[gone], held[gone]
            join(2)
    assert len(calls) == groups  # every proposal in one call of K = 4 steps
    assert {steps for _, steps in calls} == {4}
    if min_confidence:  # rows cut within the loop's steps
        assert {1, 2} <= set(cut_lengths)
    else:  # after a row's drafts were all accepted it appends two tokens
        assert {fed for fed, _ in calls} == {1, 2}


def test_the_loop_is_built_only_for_models_it_steps(model_dirs):
    """GPT-2 (learned positions) keeps the Python steps."""
    model = models.load_causal_lm(model_dirs["gpt2"][0])
    runner = runner_lib.ModelRunner(model, name="gpt2", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    assert runner.draft_loop is None
