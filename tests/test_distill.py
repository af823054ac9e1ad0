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

from batchspec import draft_model, models, tiny
from batchspec import runner as runner_lib


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
        [sys.executable, "-m", "batchspec", "distill", "--target", target, "--out", str(out),
         "--num-prompts", "12", "--max-new-tokens", "8", "--gen-batch-size", "4",
         "--steps", str(steps), "--checkpoint-every", "2", "--batch-size", "4",
         "--num-layers", "1", "--vocab-size", "40", "--lora-rank", "4", "--teacher-top-k", "8"],
        capture_output=True, text=True, timeout=300)


def test_distill_shows_progress_resumes_and_records(tiny_target, tmp_path):
    out = tmp_path / "draft"
    first = distill(tiny_target, out, steps=4)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "generate" in first.stderr and "train" in first.stderr  # progress bars
    assert len((out / "data.jsonl").read_text().splitlines()) == 12
    second = distill(tiny_target, out, steps=6)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stderr
    manifest = json.loads((out / draft_model.MANIFEST).read_text())
    training = manifest["training"]
    assert training["config"]["steps"] == 6 and "--steps 6" in training["command"]
    assert training["data"]["num_sequences"] == 12 and "top-8" in training["data"]["labels"]
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
    from batchspec import draft_eval

    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    pairs = draft_eval.training_pairs(str(out), max_new_tokens=3, every=5)
    assert pairs == [(r["input_ids"], r["output_ids"][:3]) for r in rows[::5]]
    result = draft_eval.evaluate(tiny_target, str(out), max_new_tokens=3, training_data=str(out))
    assert result["prompts"] == str(out) and result["num_prompts"] == 1  # every 14th of 12
    assert result["num_answer_tokens"] == len(rows[0]["output_ids"][:3])
    with pytest.raises(SystemExit, match="not a distill directory"):
        draft_eval.training_pairs(str(tmp_path), max_new_tokens=3)


def test_training_prompts_grow_by_appending_and_never_include_a_benchmark_prompt():
    from batchspec.data import train_prompts
    from batchspec.draft_eval import bench_prompts

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
