"""`batchspec distill` on a tiny target: progress, resume from a checkpoint, a record of how the
draft was made, and a draft that loads and drafts through the model-runner."""
import json
import string
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from batchspec.runtime import draft_model, models, tiny
from batchspec.runtime import runner as runner_lib
from batchspec_tools.data import train_prompts


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny Llama-style target with a character-level tokenizer of its own."""
    root = tmp_path_factory.mktemp("distill")
    target_dir, _ = tiny.save_pair("llama", root)
    chars = ["<unk>", "<s>", "</s>"] + list(string.ascii_letters + string.digits + " .,?!'")
    vocab = {c: i for i, c in enumerate(chars[:tiny.VOCAB])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(target_dir)
    return target_dir


def distill(target, out, steps):
    return subprocess.run(
        [sys.executable, "-m", "batchspec_tools", "distill", "--target", target, "--out", str(out),
         "--num-prompts", "12", "--max-new-tokens", "8", "--gen-batch-size", "4",
         "--steps", str(steps), "--checkpoint-every", "2", "--batch-size", "4",
         "--num-layers", "1", "--vocab-size", "40", "--lora-rank", "4", "--teacher-top-k", "8",
         "--self-instruct", "6"],
        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_distill_shows_progress_resumes_and_records(tiny_target, tmp_path):
    out = tmp_path / "draft"
    first = distill(tiny_target, out, steps=4)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "generate" in first.stderr and "train" in first.stderr  # progress bars
    requests = [json.loads(line) for line in (out / "self_instruct.jsonl").read_text().splitlines()]
    assert [r["request"] for r in requests] == [
        r["request"] for r in train_prompts.self_instruct_requests(6)]  # sampled, one per request
    written = list(dict.fromkeys(r["prompt"] for r in requests if r["prompt"]))
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == train_prompts.training_prompts(12) + written
    second = distill(tiny_target, out, steps=6)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stderr
    manifest = json.loads((out / draft_model.MANIFEST).read_text())
    training = manifest["training"]
    assert training["config"]["steps"] == 6 and "--steps 6" in training["command"]
    assert training["data"]["num_sequences"] == 12 + len(written)
    assert "top-8" in training["data"]["labels"] and "6 sampled" in training["data"]["prompts"]
    assert manifest["base_model"] == tiny_target and manifest["num_layers"] == 1

    draft = models.load_causal_lm(str(out))
    vocab = json.loads((out / draft_model.VOCAB).read_text())
    assert len(vocab) <= 41
    runner = runner_lib.ModelRunner(draft, name="draft", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    runner.prefill([(1, [5, 6, 7])])
    group = runner.open_group([runner_lib.RowSpec(1, 3, 3, [8])], realign=False)
    logits = group.step(torch.tensor([[8]]), num_logits=1)[0, -1]
    assert int(logits.argmax()) in vocab  # drafts come only from the draft's vocabulary
    assert torch.isinf(logits).sum() == tiny.VOCAB - len(vocab)

    # evaluate-draft --training-data: agreement on the draft's own training answers
    from batchspec_tools.drafting import evaluate as draft_eval

    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    pairs = draft_eval.training_pairs(str(out), max_new_tokens=3, every=5)
    assert pairs == [(r["input_ids"], r["output_ids"][:3]) for r in rows[::5] if r["output_ids"]]
    result = draft_eval.evaluate(tiny_target, str(out), max_new_tokens=3, training_data=str(out))
    every_14th = [r for r in rows[::14] if r["output_ids"]]
    assert result["prompts"] == str(out) and result["num_prompts"] == len(every_14th)
    assert result["num_answer_tokens"] == sum(len(r["output_ids"][:3]) for r in every_14th)
    # --temperature: the share of positions where the draft's seeded sample is the target's
    sampled = draft_eval.evaluate(tiny_target, str(out), max_new_tokens=3,
                                  training_data=str(out), temperature=0.8, top_p=0.95)
    assert 0 <= sampled["sampled_agreement"] <= 1 and sampled["temperature"] == 0.8
    itself = draft_eval.evaluate(tiny_target, tiny_target, max_new_tokens=3,
                                 training_data=str(out), temperature=1.0)
    assert itself["sampled_agreement"] == 1.0  # a draft equal to the target always agrees
    assert draft_eval.main(["--target", tiny_target, "--draft", str(out), "--max-new-tokens",
                            "3", "--num-prompts", "2", "--record"]) == 0
    recorded = json.loads((out / draft_model.MANIFEST).read_text())["evaluation"]
    assert recorded["num_prompts"] == 2 and recorded["prompts"] == "benchmark"
    assert recorded["command"].endswith("--num-prompts 2 --record")
    with pytest.raises(SystemExit):  # --record needs a draft directory to write to
        draft_eval.main(["--target", tiny_target, "--draft", tiny_target, "--record"])
    with pytest.raises(SystemExit, match="not a distill directory"):
        draft_eval.training_pairs(str(tmp_path), max_new_tokens=3)


def test_training_prompts_grow_by_appending_and_never_include_a_benchmark_prompt():
    from batchspec_tools.data import bench_prompts, train_prompts

    first = train_prompts.training_prompts(1440)
    grown = train_prompts.training_prompts(3440)
    assert grown[:1440] == first  # a resumed distill only generates the new prompts
    assert not set(grown) & {row["prompt"] for row in bench_prompts()}
    varied = grown[1440:]
    assert len(set(varied)) == len(varied) and not set(varied) & set(first)
    assert any("```python" in p for p in varied) and any("Translate" in p for p in varied)
    assert train_prompts.training_prompts(3440, seed=0) == grown  # deterministic
    with pytest.raises(ValueError, match="at most"):
        train_prompts.training_prompts(10**6)


def test_distill_config_rejects_an_unknown_device():
    from batchspec_tools.drafting.distill import DistillConfig

    with pytest.raises(ValueError, match="torch device"):
        DistillConfig(device="gpu0")
    assert DistillConfig(device="cuda:1").device == "cuda:1"  # checked by name, not by presence


def test_self_instruct_requests_cover_every_kind_and_wrap_answers_into_prompts():
    requests = train_prompts.self_instruct_requests(16, seed=0)
    assert requests == train_prompts.self_instruct_requests(16, seed=0)  # deterministic
    kinds = [r["kind"] for r in requests]
    assert kinds[:8] == [kind for kind, _, _ in train_prompts.SELF_INSTRUCT] == kinds[8:]
    question = requests[kinds.index("qa")]
    assert train_prompts.self_instruct_prompt(question, ' "Why do owls hoot at night?" ') == (
        "Why do owls hoot at night?")
    translation = requests[kinds.index("translation")]
    prompt = train_prompts.self_instruct_prompt(translation, "The bus is late again today.")
    assert prompt.startswith("Translate into ")
    assert prompt.endswith(": 'The bus is late again today.'")
    assert train_prompts.self_instruct_prompt(question, "Why?") is None  # too short
    assert train_prompts.self_instruct_prompt(question, "x" * 601) is None  # too long
    echo = "Sure! Write only the question: ..."
    assert train_prompts.self_instruct_prompt(question, echo) is None


def distill_head(target, out, steps):
    return subprocess.run(
        [sys.executable, "-m", "batchspec_tools", "distill", "--kind", "feature", "--target",
         target, "--out", str(out), "--num-prompts", "12", "--prompt-pool", "40",
         "--max-new-tokens", "8", "--gen-batch-size", "4", "--steps", str(steps),
         "--checkpoint-every", "2", "--batch-size", "4", "--vocab-size", "40", "--unroll", "2"],
        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_distill_a_feature_head_shows_progress_resumes_and_records(tiny_target, tmp_path):
    from batchspec.runtime import feature_head

    out = tmp_path / "head"
    first = distill_head(tiny_target, out, steps=4)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "features" in first.stderr and "train head" in first.stderr  # progress bars
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    import random

    pool = train_prompts.training_prompts(40)
    assert [r["prompt"] for r in rows] == random.Random(0).sample(pool, 40)[:12]
    second = distill_head(tiny_target, out, steps=6)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stderr
    manifest = json.loads((out / draft_model.MANIFEST).read_text())
    assert manifest["format"] == feature_head.FORMAT and manifest["base_model"] == tiny_target
    training = manifest["training"]
    assert len(training["history"]) == 2 and "--steps 6" in training["history"][-1]
    assert training["config"]["kind"] == "feature" and training["machine"]
    assert len(training["held_back_acceptance_by_position"]) == 2  # one per unrolled step
    assert training["data"]["num_sequences"] == sum(bool(r["output_ids"]) for r in rows)

    head = models.load_causal_lm(str(out))
    runner = runner_lib.ModelRunner(head, name="head", device=torch.device("cpu"),
                                    eos_token_ids=[], max_context_len=256)
    assert runner.reads_features == 64
    runner.prefill([(1, [5, 6, 7])], {1: torch.zeros(3, 64)})
    group = runner.open_group([runner_lib.RowSpec(1, 3, 3, [8])], realign=False)
    logits = group.step(torch.tensor([[8]]), num_logits=1, features=torch.zeros(1, 1, 64))
    vocab = json.loads((out / draft_model.VOCAB).read_text())
    # it scores its own vocabulary only: its drafts come from it
    assert runner.logit_token_ids.tolist() == vocab and logits.shape[-1] == len(vocab)
    assert int(runner.logit_token_ids[logits[0, -1].argmax()]) in vocab


def test_distill_refuses_a_bad_setting_with_usage(capsys):
    from batchspec_tools.drafting import distill as distill_tool

    with pytest.raises(SystemExit) as stopped:
        distill_tool.main(["--kind", "bogus", "--out", "unused"])
    assert stopped.value.code == 2 and "kind must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_distill_bytes_makes_a_draft_of_another_tokenizer_that_serves_translated(tiny_target,
                                                                                   tmp_path):
    """--kind bytes: a byte-level model trained from scratch on the target's answers, saved
    with its own tokenizer (the target's special tokens whole) and a record of how it was
    made; its vocabulary is not the target's, so serve starts it translating, and a
    translating runner over it proposes target tokens."""
    from batchspec.runtime import service
    from batchspec_tools import cli
    from draft_service import translating

    out = tmp_path / "bytes"
    done = subprocess.run(
        [sys.executable, "-m", "batchspec_tools", "distill", "--kind", "bytes", "--target",
         tiny_target, "--out", str(out), "--num-prompts", "8", "--max-new-tokens", "8",
         "--gen-batch-size", "4", "--steps", "3", "--batch-size", "2", "--num-layers", "1"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "byte draft step 3/3" in done.stderr
    record = json.loads((out / "batchspec_training.json").read_text())
    assert record["kind"] == "bytes" and record["num_sequences"] == 8 and record["num_bytes"]
    table = json.loads((out / "tokenizer.json").read_text())
    assert {t["content"] for t in table["added_tokens"]} == {"<unk>", "<s>", "</s>"}
    assert models.vocabulary_digest(str(out)) != models.vocabulary_digest(tiny_target)
    args = cli.serve_parser().parse_args(["--target-model", tiny_target, "--draft-model",
                                          str(out)])
    assert "--target-tokenizer" in cli.draft_command(args, str(out), 1234)
    runner = translating.build_runner(service.ServiceConfig(
        model=str(out), target_tokenizer=tiny_target))
    prompt = runner.target.encode("Hello there")
    runner.prefill([(1, prompt[:-1])])
    from batchspec.params import SamplingParams
    from batchspec.runtime.rows import ProposeRow

    proposed, _ = runner.propose([ProposeRow(1, len(prompt) - 1, len(prompt) - 1,
                                             prompt[-1:], SamplingParams())], 3)
    assert proposed[0].cache_len == runner.caches[1].length >= len(prompt)
    assert all(0 <= t < runner.vocab_size for t in proposed[0].draft_token_ids)
