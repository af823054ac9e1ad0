"""Probe: would a draft that sees the target's features (EAGLE-style) agree more often?

Not part of the served system (the services exchange no features). It trains, on the data of
a `batchspec distill` directory, a one-layer draft whose input at position p is
fc([embedding(x_p), f_(p-1)]), with f the target's final (post-norm) hidden state, and whose
output goes through the target's head restricted to the directory's vocabulary. Then it
reports, on the benchmark prompts (teacher-forced on the target's greedy answers, as
`batchspec evaluate-draft` does):

- agree1: the first drafted token, with the target's features for every earlier position;
- agree2: the second drafted token (the previous position's feature is the draft's own),
  given that the first was right.

    python scripts/feature_draft_probe.py --data DIR --steps 2400

The target's features of DIR's sequences are cached in DIR/features.pt (about 8 minutes for
1,440 sequences on 2 CPU cores).
"""
import argparse
import json
import math
import pathlib
import random
import time

import torch
import torch.nn.functional as F

from batchspec import draft_model, models
from batchspec.data import read_jsonl
from batchspec.distill import DATA_FILE, load_tokenizer
from batchspec.draft_eval import bench_prompts, target_answers


def target_features(target, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's post-norm hidden state at every position of each sequence (float16)."""
    out = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    with torch.inference_mode():
        for start in range(0, len(order), 8):
            chunk = order[start:start + 8]
            width = max(len(sequences[i]) for i in chunk)
            ids = torch.tensor([sequences[i] + [0] * (width - len(sequences[i])) for i in chunk])
            mask = torch.tensor([[1] * len(sequences[i]) + [0] * (width - len(sequences[i]))
                                 for i in chunk])
            hidden = target.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(chunk):
                out[i] = hidden[row, :len(sequences[i])].half().clone()
    return out


class FeatureDraft(torch.nn.Module):
    def __init__(self, target_name: str, embedding: torch.Tensor, vocab: list[int]):
        super().__init__()
        self.body = models.load_causal_lm(target_name, num_layers=1)  # the target's layer 0
        self.head = draft_model.attach_subset_head(self.body, vocab)
        hidden = embedding.shape[1]
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1))
        self.register_buffer("embedding", embedding.detach().clone(), persistent=False)

    def forward(self, ids, previous_features, mask=None):
        x = self.fc(torch.cat([self.embedding[ids], previous_features], -1))
        return self.body.model(inputs_embeds=x, attention_mask=mask).last_hidden_state


def shifted(features: torch.Tensor) -> torch.Tensor:
    """f_(p-1) at position p (zeros at 0)."""
    return torch.cat([torch.zeros_like(features[:1]), features[:-1]])


def train(draft, data, features, teacher, steps: int, lr: float, reg_weight: float,
          noise: float) -> None:
    trainable = list(draft.body.model.layers[0].parameters()) + [draft.body.model.norm.weight]
    trainable += list(draft.fc.parameters())
    for p in draft.parameters():
        p.requires_grad_(False)
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    examples = [i for i, d in enumerate(data) if d["output_ids"]]
    rng = random.Random(0)
    started = time.time()
    for step in range(steps):
        batch = rng.sample(examples, 8)
        seqs = [data[i]["input_ids"] + data[i]["output_ids"] for i in batch]
        width = max(map(len, seqs))
        hidden = features[0].shape[-1]
        ids = torch.zeros(8, width, dtype=torch.long)
        mask = torch.zeros(8, width, dtype=torch.long)
        now = torch.zeros(8, width, hidden)
        before = torch.zeros(8, width, hidden)
        for row, (i, seq) in enumerate(zip(batch, seqs)):
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
            now[row, :len(seq)] = features[i].float()
            before[row, :len(seq)] = shifted(features[i].float())
        before = before + (torch.rand_like(before) - 0.5) * 2 * noise
        out = draft(ids, before, mask)
        reg = (F.smooth_l1_loss(out, now, reduction="none").mean(-1) * mask).sum() / mask.sum()
        ces = []
        for row, i in enumerate(batch):
            prompt, answer = len(data[i]["input_ids"]), len(data[i]["output_ids"])
            log_q = draft.head.subset_logits(out[row, prompt - 1:prompt + answer - 1])
            index, probs = teacher[i]
            ces.append(-(probs.float() * log_q.log_softmax(-1).gather(-1, index.long())).sum(-1))
        ce = torch.cat(ces).mean()
        scale = min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        optimizer.zero_grad()
        (ce + reg_weight * reg).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step} {time.time() - started:.0f}s ce {ce.item():.3f} "
                  f"reg {reg.item():.3f}", flush=True)


def evaluate(draft, vocab: list[int], pairs, features) -> tuple[float, float]:
    subset = torch.tensor(vocab)
    first = second = total = 0
    with torch.inference_mode():
        for (prompt, answer), feats in zip(pairs, features):
            ids = torch.tensor([prompt + answer])
            before = shifted(feats.float())[None]
            out = draft(ids, before)
            p, a = len(prompt), len(answer)
            truth = torch.tensor(answer)
            first += int((subset[draft.head.subset_logits(out[0, p - 1:p + a - 1]).argmax(-1)]
                          == truth).sum())
            own = before.clone()
            own[:, p:] = out[:, p - 1:-1]  # the previous position's feature is the draft's
            out2 = draft(ids, own)
            second += int((subset[draft.head.subset_logits(out2[0, p:p + a - 1]).argmax(-1)]
                           == truth[1:]).sum())
            total += a
    return first / total, second / max(1, total - len(pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a batchspec distill directory")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--reg-weight", type=float, default=0.1)
    parser.add_argument("--noise", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    root = pathlib.Path(args.data)
    data = read_jsonl(root / DATA_FILE)
    teacher = torch.load(root / "teacher.pt", weights_only=False)
    vocab = json.loads((root / "vocab.json").read_text())
    target = models.load_causal_lm(args.target)
    cache = root / "features.pt"
    features = torch.load(cache) if cache.exists() else []
    if len(features) < len(data):
        features += target_features(target, [d["input_ids"] + d["output_ids"]
                                             for d in data[len(features):]])
        torch.save(features, cache)
    pairs = target_answers(target, load_tokenizer(args.target),
                           [r["prompt"] for r in bench_prompts()], 64)
    eval_features = target_features(target, [p + a for p, a in pairs])
    draft = FeatureDraft(args.target, target.get_input_embeddings().weight, vocab)
    del target
    train(draft, data, features, teacher, args.steps, args.lr, args.reg_weight, args.noise)
    agree1, agree2 = evaluate(draft, vocab, pairs, eval_features)
    print(json.dumps({"data": str(root), "sequences": len(data), "steps": args.steps,
                      "agree1": round(agree1, 4), "agree2_given_first": round(agree2, 4)}))


if __name__ == "__main__":
    main()
