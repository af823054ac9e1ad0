"""A real client nobody here wrote: lm-evaluation-harness (`local-completions`) runs a small
multiple-choice task from a local file against the HTTP edge, offline, and its scores equal
those computed from transformers' own log-probabilities of the same model."""
import json
import os
import subprocess
import sys

import pytest
import torch
from test_http import WORDS, make_chat_tokenizer
from transformers import AutoModelForCausalLM

from coordinator.text import TextCodec

from conftest import running_stack

QUESTIONS = [  # (question, choices, gold): the words are the tiny tokenizer's own
    ("the cat is", ["big", "small", "red"], 0),
    ("the sun and the moon is", ["good", "bad"], 1),
    ("one two three", ["four", "five", "six", "ten"], 0),
    ("people who paint a story", ["why", "when", "how"], 2),
    ("a robot learns to write", ["yes", "no"], 0),
    ("the dog is", ["hello", "world", "more", "less"], 3),
]
TASK = """task: batchspec_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def reference_loglikelihoods(model, codec: TextCodec) -> list[list[float]]:
    """What lm-eval computes from a model it runs itself: for each choice, the summed
    log-probability of the continuation (" " + choice) after the question."""
    out = []
    for question, choices, _ in QUESTIONS:
        context = codec.encode(question)
        row = []
        for choice in choices:
            whole = codec.encode(question + " " + choice)
            continuation = whole[len(context):]
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            row.append(sum(logp[len(context) - 1 + i, t].item()
                           for i, t in enumerate(continuation)))
        out.append(row)
    return out


def test_lm_eval_harness_scores_equal_transformers_own(model_dirs, tmp_path):
    for word in (w for q, cs, _ in QUESTIONS for w in q.split() + cs):
        assert word in WORDS  # every word is one token: no unknown tokens in the task
    tokenizer_dir = make_chat_tokenizer(tmp_path)
    # transformers' AutoTokenizer (lm-eval's client-side tokenizer) needs to know the class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, tokenizer=tokenizer_dir, http_port=0,
                       drafts=("model", "ngram")) as stack:
        done = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"base_url=http://127.0.0.1:{stack.http_port}/v1/completions,model=batchspec,"
             f"tokenizer={tokenizer_dir},tokenizer_backend=huggingface,num_concurrent=1,"
             "max_retries=1,max_length=256", "--tasks", "batchspec_tiny_mc", "--include_path",
             str(tasks), "--output_path", str(tmp_path / "out"), "--log_samples",
             "--batch_size", "4"],  # four prompts a request
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                 "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-4000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["batchspec_tiny_mc"]
    [samples_file] = (tmp_path / "out").rglob("samples_batchspec_tiny_mc_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()),
                     key=lambda s: s["doc_id"])
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    reference = reference_loglikelihoods(model, TextCodec(tokenizer_dir))
    for sample, expected in zip(samples, reference):
        served = [float(r[0][0]) for r in sample["resps"]]
        assert served == pytest.approx(expected, abs=1e-3), sample["doc"]
    picked = [max(range(len(row)), key=row.__getitem__) for row in reference]
    accuracy = sum(p == gold for p, (_, _, gold) in zip(picked, QUESTIONS)) / len(QUESTIONS)
    assert results["acc,none"] == pytest.approx(accuracy)
    assert len(samples) == len(QUESTIONS)
