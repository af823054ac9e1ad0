"""`batchspec distill --kind feature`: train a feature-level (EAGLE-style) draft head for a
target on the target's own greedy answers, with features from the target's forward.

Stages, each resumable (re-run the same command after a stop):
1. generate: the target answers training prompts greedily (as for a layer draft); data.jsonl.
2. vocabulary: the answers' most frequent tokens (plus every EOS id).
3. features: the target's final hidden states over every prompt and answer, float16, saved
   in parts (features-NNNN.pt) as they are made.
4. train: the head (batchspec.runtime.feature_head) learns to predict the target's next
   features (smooth L1) and distribution over the draft vocabulary (cross-entropy against
   the target's), at every answer position. Training unrolls `unroll` drafting steps the
   way drafting runs them: step k feeds the head its own features of step k - 1 and attends
   to positions computed from the target's features before the chain began, plus its own
   chain ("training-time test"); step k's loss weighs 0.8 ** (k - 1). Checkpointed.
5. save: the head's weights, vocabulary and a manifest (command, data, machine, time).
"""
import json
import logging
import math
import pathlib
import platform
import random
import time

from batchspec.runtime import models
from batchspec_tools.data import right_padded

log = logging.getLogger("batchspec_tools.drafting.feature_head")
FEATURES_PART = "features-{:04d}.pt"
PART_SEQUENCES = 256  # sequences per saved part of the features
STEP_WEIGHT = 0.8  # the loss of unrolled step k weighs STEP_WEIGHT ** (k - 1)
REGRESSION_WEIGHT = 0.1  # smooth-L1 to the target's features, beside the cross-entropy


def distill_head(config, target, tokenizer, data: list[dict], vocab: list[int],
                 out: pathlib.Path, command: str, started: float, prompts_note: str):
    """Stages 3 to 5 for a `DistillConfig` with kind "feature"; returns the head directory."""
    import torch

    from batchspec.runtime import feature_head

    examples = [d for d in data if d["output_ids"]]
    features = target_features(config, target, examples, out)
    head = feature_head.build_head(target, vocab, models.max_context_len(target))
    head.init_from_target(target)
    head.to(config.device)
    final_loss, acceptance = train_head(config, head, examples, features, out)
    record = {
        "base_model": config.target,
        "feature_width": head.feature_width,
        "training": {"command": command, "config": config_dict(config),
                     "data": {"prompts": prompts_note, "num_sequences": len(examples),
                              "num_answer_tokens": sum(len(d["output_ids"]) for d in examples),
                              "answers": "target's greedy answers, chat template applied",
                              "features": "target's final hidden state (after its last norm)"},
                     "final_loss": final_loss,
                     "held_back_acceptance_by_position": acceptance,
                     "machine": machine(config.device), "torch": torch.__version__,
                     "seconds": round(time.time() - started, 1)},
    }
    manifest = out / "batchspec_draft.json"
    earlier = json.loads(manifest.read_text()) if manifest.exists() else {}
    history = earlier.get("training", {}).get("history", [])
    record["training"]["history"] = history + [command]
    feature_head.save_head(out, head, record)
    log.info("feature head saved to %s", out)
    return out


def config_dict(config) -> dict:
    import dataclasses

    return dataclasses.asdict(config)


def machine(device: str = "cpu") -> str:
    """The CPU model and cores, led by the GPU's name when training ran on one."""
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    host = f"{cpu}, {os.cpu_count()} cores"
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(device)} (host: {host}), {platform.system()}"
    return f"{host}, {platform.system()}"


def target_features(config, target, examples: list[dict], out: pathlib.Path):
    """Per example, the target's features of every position of prompt + answer, float16 on
    the CPU; made in parts of PART_SEQUENCES sequences, each saved when done (resumable)."""
    import torch
    from tqdm import tqdm

    device = next(target.parameters()).device
    features = []
    bar = tqdm(total=len(examples), desc="features", unit="seq")
    for part, start in enumerate(range(0, len(examples), PART_SEQUENCES)):
        path = out / FEATURES_PART.format(part)
        chunk = examples[start:start + PART_SEQUENCES]
        if path.exists():  # made before a stop
            made = torch.load(path, weights_only=True)
            bar.update(len(made))
        else:
            made = []
            for offset in range(0, len(chunk), config.gen_batch_size):
                batch = chunk[offset:offset + config.gen_batch_size]
                seqs = [d["input_ids"] + d["output_ids"] for d in batch]
                ids, mask = right_padded(seqs)
                with torch.inference_mode():
                    hidden = target(input_ids=ids.to(device), attention_mask=mask.to(device),
                                    output_hidden_states=True,
                                    logits_to_keep=1).hidden_states[-1]
                made += [hidden[i, :len(s)].half().cpu() for i, s in enumerate(seqs)]
                bar.update(len(batch))
            torch.save(made, path)
        features += made
    bar.close()
    return features


def split(examples: list, held_back: int):
    """(training, held back) indices: the last `held_back` examples judge acceptance."""
    indices = list(range(len(examples)))
    return indices[:-held_back] if held_back else indices, indices[-held_back:]


def train_head(config, head, examples, features, out: pathlib.Path):
    """Train the head; returns (final loss, held-back greedy acceptance by draft position)."""
    import torch
    from tqdm import tqdm

    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    checkpoint = out / "head-checkpoint.pt"
    step, losses = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=config.device)
        head.load_trained(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        log.info("resumed from step %d", step)
    held = min(32, len(examples) // 10)
    train_ids, held_ids = split(examples, held)
    rng = random.Random(config.seed + step)
    bar = tqdm(total=config.steps, initial=step, desc="train head", unit="step")
    head.train()
    while step < config.steps:
        batch = rng.sample(train_ids, min(config.batch_size, len(train_ids)))
        loss = unrolled_loss(head, [examples[i] for i in batch], [features[i] for i in batch],
                             config.unroll, config.device)
        lr = config.lr * min(1.0, (step + 1) / config.warmup_steps) * 0.5 * (
            1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        losses.append(float(loss))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if step % config.checkpoint_every == 0 or step == config.steps:
            torch.save({"head": head.trained_state(), "optimizer": optimizer.state_dict(),
                        "step": step, "losses": losses}, checkpoint)
    bar.close()
    head.eval()
    acceptance = held_back_acceptance(head, [examples[i] for i in held_ids],
                                      [features[i] for i in held_ids], config.unroll,
                                      config.device)
    log.info("held-back greedy acceptance by draft position: %s", acceptance)
    tail = losses[-20:] or [float("nan")]
    return round(sum(tail) / len(tail), 4), acceptance


def chain_mask(length: int, k: int, device):
    """[length, k * length] bool: which keys drafting step k (1-based) at position j sees.
    The chain that reaches j at step k began at s = j - k + 1 from the target's features:
    step 1's keys at positions <= s, then step m's key at position s + m - 1 (m = 2..k)."""
    import torch

    j = torch.arange(length, device=device)[:, None]
    i = torch.arange(length, device=device)[None, :]
    start = j - k + 1
    blocks = [i <= start]
    for m in range(2, k + 1):
        blocks.append(i == start + m - 1)
    return torch.cat(blocks, dim=1)


def unroll(head, ids, feats, steps: int):
    """The head's predicted features [steps, batch, L, hidden] over a right-padded batch:
    step 1 from the target's features, step k from the head's own of step k - 1."""
    import torch
    from transformers import DynamicCache

    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device)[None].expand(batch, -1)
    shifted = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)
    cache, outs, current = DynamicCache(), [], shifted
    for k in range(1, steps + 1):
        mask = None
        if k > 1:
            mask = chain_mask(length, k, ids.device)[None, None].expand(batch, 1, -1, -1)
        out = head(ids, current, position_ids=positions, cache=cache,
                   attention_mask=mask, logits_to_keep=0)
        cache = out.cache
        outs.append(out.hidden)
        current = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
    return torch.stack(outs)


def batch_tensors(examples, features, device):
    import torch

    seqs = [d["input_ids"] + d["output_ids"] for d in examples]
    ids, _ = right_padded(seqs)
    feats = torch.zeros(len(seqs), ids.shape[1], features[0].shape[-1])
    answer = torch.zeros(ids.shape, dtype=torch.bool)
    for i, (d, f) in enumerate(zip(examples, features)):
        feats[i, :f.shape[0]] = f.float()
        # position j predicts token j + 1: the answer's tokens are predicted from
        # len(prompt) - 1 up to the answer's second-to-last position
        answer[i, len(d["input_ids"]) - 1:len(seqs[i]) - 1] = True
    return ids.to(device), feats.to(device), answer.to(device)


def unrolled_loss(head, examples, features, steps: int, device):
    """Cross-entropy against the target's distribution over the draft vocabulary, plus the
    smooth-L1 distance to its features, at answer positions, summed over unrolled steps."""
    import torch

    ids, feats, answer = batch_tensors(examples, features, device)
    predicted = unroll(head, ids, feats, steps)
    with torch.no_grad():
        teacher = head.lm_head.subset_logits(feats[answer]).softmax(-1)
    total = 0.0
    for k in range(steps):
        # step k + 1 at position j needs a chain start j - k >= 0
        valid = answer.clone()
        valid[:, :k] = False
        weight = STEP_WEIGHT ** k
        log_q = head.lm_head.subset_logits(predicted[k][valid]).log_softmax(-1)
        target = teacher[valid[answer]]
        ce = -(target * log_q).sum(-1).mean()
        reg = torch.nn.functional.smooth_l1_loss(predicted[k][valid], feats[valid])
        total = total + weight * (ce + REGRESSION_WEIGHT * reg)
    return total


def held_back_acceptance(head, examples, features, steps: int, device) -> list[float]:
    """Share of answer positions where drafting step k's greedy guess is the target's greedy
    token, given the chain so far was right (k = 1..steps): the per-position acceptance of a
    greedy head on held-back answers."""
    import torch

    if not examples:
        return []
    with torch.no_grad():
        ids, feats, answer = batch_tensors(examples, features, device)
        predicted = unroll(head, ids, feats, steps)
        truth = head.lm_head(feats).argmax(-1)  # [batch, L] the target's greedy next token
        alive = answer.clone()
        rates, chain_ok = [], None
        for k in range(steps):
            guess = head.lm_head(predicted[k]).argmax(-1)
            # step k + 1 at position j is right if its guess is the target's token there;
            # the chain's earlier steps were at j - 1, ...
            right = guess == truth
            if k:
                alive = alive.clone()
                alive[:, k:] &= chain_ok[:, k - 1:-1]
                alive[:, :k] = False
            total = int(alive.sum())
            rates.append(round(int((right & alive).sum()) / max(1, total), 4))
            chain_ok = right & alive
    return rates
