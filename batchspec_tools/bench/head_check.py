"""`batchspec bench --head-check`: what a feature-level draft head delivers for its target, in
one process at batch 1: acceptance per draft position at K, greedy or sampled, what a drafted
token costs against a target step, and what the features cost on the wire.

    batchspec bench --head-check --draft smollm2-eagle --ks 4 --num-prompts 16 \
        --prompts docs/bench/heldout_prompts.jsonl [--temperature 0.8 --top-p 0.95]

Each prompt is decoded the way the services do it (greedy, or with --temperature prompt i
sampled with seed i: the head samples with the noise the target's choice uses, so a draft is
accepted where the two choices agree): the target verifies K drafts and
returns the features of the positions it caches; the head keeps the positions it computed
from the target's features, drops those of its own drafts, and is fed the new tokens with
their features. Acceptance at position k is the share of steps whose k-th draft was accepted
among those whose first k - 1 were; the share of drafted tokens accepted counts every draft.
`--min-confidence C` cuts each draft where the head's probability of it falls below C, as the
services do (docs/design.md). Costs are medians of the timed forwards, taken in turn.
"""
import statistics
import time

import torch

from batchspec.params import SamplingParams
from batchspec.runtime import cache_dir, fastlinear, models, wire
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import ProposeRow, VerifyRow
from batchspec_tools.data import bench_prompts
from draft_service import proposer
from target_service import verifier


def runner_of(model, name):
    return runner_lib.ModelRunner(model, name=name, device=torch.device("cpu"),
                                  eos_token_ids=models.eos_token_ids(model),
                                  max_context_len=models.max_context_len(model))


def new_stats(k: int) -> dict:
    """What `decode` counts, before any prompt."""
    return {"head_s": [], "verify_s": [], "tried": [0] * k, "accepted": [0] * k, "drafted": 0,
            "accepted_total": 0, "spent_s": 0.0, "wire_bytes": 0, "wire_rows": 0,
            "committed": 0, "steps": 0}


def decode(target, head, prompt, k, max_new_tokens, stats, min_confidence=0.0,
           params: SamplingParams = SamplingParams()):
    """Decoding of one prompt under `params` with drafts from the head; fills stats and
    returns the answer's tokens (the target's choices, whatever the head drafted)."""
    _, kept = target.prefill_features([(1, prompt[:-1])], keep=True)
    features = kept[1]  # positions [0, len(tokens) - 1)
    tokens = list(prompt)
    fed = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])
    head.prefill([(1, tokens[:-1])], {1: fed})
    head_len, valid = len(tokens) - 1, len(tokens) - 1
    while len(tokens) - len(prompt) < max_new_tokens:
        append = tokens[valid:]
        rows = features[valid - 1:len(tokens) - 1] if valid else torch.cat(
            [torch.zeros(1, features.shape[1]), features[:len(tokens) - 1]])
        started = time.perf_counter()
        proposals, _ = proposer.propose(head, [ProposeRow(
            1, head_len, valid, append, params, rows)], k, realign=False,
            min_confidence=min_confidence)
        forwards, spent = proposals[0].cache_len - len(tokens) + 1, time.perf_counter() - started
        stats["head_s"].append(spent / forwards)
        stats["spent_s"] += spent
        drafts = proposals[0].draft_token_ids
        stats["drafted"] += len(drafts)
        started = time.perf_counter()
        outcomes, _ = verifier.verify(target, [VerifyRow(
            1, len(tokens) - 1, [tokens[-1]], drafts, params)],
            realign=False, keep_features=True)
        stats["verify_s"].append(time.perf_counter() - started)
        stats["spent_s"] += stats["verify_s"][-1]
        outcome = outcomes[0]
        stats["accepted_total"] += outcome.num_accepted
        for position in range(k):
            if position <= outcome.num_accepted and position < len(drafts):
                stats["tried"][position] += 1
                stats["accepted"][position] += position < outcome.num_accepted
        stats["wire_bytes"] += wire.features_message(outcome.features).ByteSize()
        stats["wire_rows"] += outcome.features.shape[0]
        features = torch.cat([features, outcome.features])
        head_len, valid = proposals[0].cache_len, len(tokens)  # its own drafts are not kept
        tokens += outcome.output_token_ids
        stats["committed"] += len(outcome.output_token_ids)
        stats["steps"] += 1
    target.release([1])
    head.release([1])
    return tokens[len(prompt):]


def plain_step_seconds(target, prompt, repeats=8):
    """The median time of a plain target step (one token) at batch 1 after the prompt."""
    target.prefill([(2, prompt)])
    times = []
    for _ in range(repeats):
        group = target.open_group([runner_lib.RowSpec(2, len(prompt), len(prompt), [5])],
                                  realign=False)
        started = time.perf_counter()
        group.step(torch.tensor([[5]]), num_logits=1)
        times.append(time.perf_counter() - started)
    target.release([2])
    return statistics.median(times)


@torch.no_grad()
def run(target_spec: str, head_spec: str, *, prompts: str | None, num_prompts: int,
        max_new_tokens: int, k: int, head_dtype: str, min_confidence: float,
        temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """The report of decoding `num_prompts` of `prompts` with the head's drafts."""
    tokenizer = models.load_tokenizer(target_spec)
    target_model = models.load_causal_lm(target_spec)
    head_model = models.load_causal_lm(head_spec, dtype=head_dtype)
    for model in (target_model, head_model):  # the kernels the services use
        fastlinear.tune(model, cache_dir.kernel_plans_file())
    target, head = runner_of(target_model, "target"), runner_of(head_model, "head")
    rows = bench_prompts(num_prompts, prompts)
    stats = new_stats(k)
    plain = []
    for seed, row in enumerate(rows):
        prompt = models.chat_ids(tokenizer, row["prompt"])
        plain.append(plain_step_seconds(target, prompt))
        decode(target, head, prompt, k, max_new_tokens, stats, min_confidence,
               SamplingParams(temperature=temperature, top_p=top_p, seed=seed))
    step = statistics.median(plain)
    per_draft = statistics.median(stats["head_s"])
    reached = sum(stats["tried"])
    return {
        "prompts": prompts, "num_prompts": len(rows), "k": k, "head_dtype": head_dtype,
        "temperature": temperature, "top_p": top_p,
        "acceptance_by_position": [round(a / max(1, t), 3)
                                   for a, t in zip(stats["accepted"], stats["tried"])],
        "min_confidence": min_confidence,
        "acceptance_rate": round(sum(stats["accepted"]) / max(1, reached), 3),
        "drafted_per_step": round(stats["drafted"] / max(1, stats["steps"]), 3),
        "accepted_share_of_drafted": round(stats["accepted_total"] / max(1, stats["drafted"]),
                                           3),
        "tokens_per_target_pass": round(stats["committed"] / max(1, stats["steps"]), 3),
        "plain_target_step_ms": round(1000 * step, 2),
        "ms_per_committed_token": round(1000 * stats["spent_s"] / max(1, stats["committed"]), 2),
        "head_ms_per_drafted_token": round(1000 * per_draft, 2),
        "head_cost_share_of_target_step": round(per_draft / step, 3),
        "feature_wire_bytes_per_position": round(stats["wire_bytes"] / max(1, stats["wire_rows"]),
                                                 1),
    }
