"""`batchspec distill`: train a draft for a target by distillation on the target's own greedy
chat answers.

Stages, each resumable (re-run the same command after a stop):
0. self-instruct (with --self-instruct N): the target writes N more training prompts by
   sampling (batchspec_tools.data.train_prompts.SELF_INSTRUCT); saved to self_instruct.jsonl.
1. generate: the target answers training prompts greedily (chat template); saved to data.jsonl.
2. vocabulary: the most frequent answer tokens (plus every EOS id) become the draft's head.
3. train: the target's first layers plus low-rank deltas, trained with cross-entropy on the
   target's greedy tokens (exactly the choices a greedy draft must agree with); checkpointed.
4. save: only what the target does not hold (deltas, final norm, vocabulary) and a record of
   how it was made, including the command line.
"""
import argparse
import dataclasses
import json
import logging
import math
import pathlib
import platform
import random
import shlex
import sys
import time
from collections import Counter

from batchspec import cliargs
from batchspec.runtime import models
from batchspec_tools.data import read_jsonl, right_padded

log = logging.getLogger("batchspec_tools.drafting.distill")
DATA_FILE = "data.jsonl"  # the target's answers, one JSON object per line, appended as made
SELF_INSTRUCT_FILE = "self_instruct.jsonl"  # the target's sampled requests and prompts
KINDS = ("layers", "feature", "bytes")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    target: str = "smollm2"
    out: str = "draft-out"
    num_layers: int = 6
    vocab_size: int = 8192  # at most: the answers' most used tokens (fewer if they hold fewer)
    lora_rank: int = 64
    lora_alpha: float = 64.0
    num_prompts: int = 480
    max_new_tokens: int = 96
    gen_batch_size: int = 16
    steps: int = 600
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 20
    checkpoint_every: int = 25
    seed: int = 0
    # Soft labels: the target's top-k probabilities (over the draft's vocabulary) at every
    # answer position; 0 trains on the greedy tokens alone.
    teacher_top_k: int = 32
    # Prompts the target writes itself by sampling, added after the num_prompts fixed ones.
    self_instruct: int = 0
    # Where the target generates and the draft trains ("cuda" on a GPU); the draft is the
    # same on any device and always loads on CPU.
    device: str = "cpu"
    # "layers": the target's first num_layers layers with low-rank deltas; "feature": a
    # feature-level (EAGLE-style) head reading the target's features (num_layers, lora_rank,
    # lora_alpha and teacher_top_k do not apply; see batchspec_tools.drafting.feature_head);
    # "bytes": a byte-level model of num_layers layers trained from scratch, a draft of
    # another tokenizer (see batchspec_tools.drafting.byte_draft)
    kind: str = "layers"
    # draw the num_prompts training prompts at random (seeded) from the first prompt_pool
    # ones instead of taking the first num_prompts (0): more kinds of work for fewer answers
    prompt_pool: int = 0
    # feature heads: drafting steps unrolled in training (each fed the head's own features)
    unroll: int = 3

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.unroll < 1:
            raise ValueError("unroll must be >= 1")
        for name in ("num_layers", "vocab_size", "lora_rank", "num_prompts", "max_new_tokens",
                     "gen_batch_size", "steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.teacher_top_k < 0 or self.self_instruct < 0:
            raise ValueError("teacher_top_k and self_instruct must be >= 0")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")
        models.check_spec(self.target)
        if not cliargs.writable_dir(self.out):
            raise ValueError(f"out {self.out}: cannot write a draft there")
        import torch

        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must be a torch device such as cpu or cuda:0, "
                             f"not {self.device!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = cliargs.parser("batchspec distill", __doc__.split("\n")[0])
    defaults = DistillConfig()
    for field in dataclasses.fields(DistillConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(getattr(defaults,
                            field.name)), default=getattr(defaults, field.name),
                            help=f"(default {getattr(defaults, field.name)})")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = DistillConfig(**vars(args))
    except ValueError as error:  # a setting out of range: a usage error, not a traceback
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s distill %(message)s")
    distill(config, command="batchspec distill " + shlex.join(argv))
    return 0


def distill(config: DistillConfig, command: str) -> pathlib.Path:
    import torch

    torch.manual_seed(config.seed)
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        target = models.load_causal_lm(config.target, device=config.device)
        tokenizer = models.load_tokenizer(config.target)
    except OSError as error:  # a hub id that cannot be fetched, a directory with no model
        raise SystemExit(f"distill: cannot load the target {config.target}: {error}") from None
    from batchspec_tools.data.train_prompts import training_prompts

    fixed = training_prompts(config.num_prompts, seed=config.seed)
    if config.prompt_pool > config.num_prompts:  # a seeded order of the pool: its prefix
        pool = training_prompts(config.prompt_pool, seed=config.seed)
        fixed = random.Random(config.seed).sample(pool, len(pool))[:config.num_prompts]
    written = self_instruct_prompts(config, target, tokenizer, out / SELF_INSTRUCT_FILE, fixed)
    data = generate_data(config, target, tokenizer, out / DATA_FILE, fixed + written)
    if config.kind == "bytes":
        from batchspec_tools.drafting import byte_draft

        del target
        return byte_draft.distill_bytes(config, tokenizer, data, out, command, started,
                                        prompts_note(config, written))
    eos_ids = models.eos_token_ids(target)
    vocab_path = out / "vocab.json"
    if vocab_path.exists():  # resuming: the head (and the teacher's indices) stay as they were
        vocab = json.loads(vocab_path.read_text())
    else:
        vocab = pick_vocabulary(data, config.vocab_size, eos_ids)
        vocab_path.write_text(json.dumps(vocab))
    log.info("draft head: %d tokens", len(vocab))
    if config.kind == "feature":
        from batchspec_tools.drafting import feature_head

        return feature_head.distill_head(config, target, tokenizer, data, vocab, out, command,
                                         started, prompts_note(config, written))
    teacher = (teacher_labels(config, target, data, vocab, out / "teacher.pt")
               if config.teacher_top_k else None)
    del target
    final_loss, coverage = train(config, data, vocab, out, teacher)
    record = {
        "format": "batchspec-draft-v1", "base_model": config.target,
        "num_layers": config.num_layers, "lora_rank": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "training": {"command": command, "config": dataclasses.asdict(config),
                     "data": {"prompts": prompts_note(config, written),
                              "labels": (f"target's top-{config.teacher_top_k} probabilities "
                                         "over the draft vocabulary" if config.teacher_top_k
                                         else "target's greedy tokens"),
                              "num_sequences": len(data),
                              "num_answer_tokens": sum(len(d["output_ids"]) for d in data),
                              "answers": "target's greedy answers, chat template applied"},
                     "vocab_coverage_of_answers": coverage, "final_loss": final_loss,
                     "seconds": round(time.time() - started, 1)},
    }
    from batchspec.runtime import draft_model

    manifest = out / draft_model.MANIFEST
    earlier = json.loads(manifest.read_text()) if manifest.exists() else {}
    # every command that trained this directory, oldest first (a resumed run continues)
    before = earlier.get("training", {})
    history = before.get("history") or ([before["command"]] if "command" in before else [])
    record["training"]["history"] = history + [command]
    manifest.write_text(json.dumps(record, indent=2))
    log.info("draft saved to %s", out)
    return out


def prompts_note(config: DistillConfig, written: list[str]) -> str:
    """Where the training prompts came from, for the manifest."""
    drawn = (f"{config.num_prompts} drawn at random (seed {config.seed}) from the first "
             f"{config.prompt_pool} of " if config.prompt_pool > config.num_prompts else "")
    return (drawn + "batchspec_tools.data.train_prompts (templates x topics, then tasks on "
            f"passages and functions of the Python {platform.python_version()} standard "
            "library; disjoint from the benchmark prompts)" + (
                f", then {len(written)} prompts the target wrote answering "
                f"{config.self_instruct} sampled requests (train_prompts.SELF_INSTRUCT)"
                if config.self_instruct else ""))


def answer_batches(model, prompt_ids: list[list[int]], max_new_tokens: int, batch_size: int,
                   *, sample_seed: int | None = None):
    """Yield (index of the batch's first prompt, answers): the model's answers to left-padded
    batches of prompts on its own device, each cut after its first EOS. Greedy, or sampled
    (temperature 0.8, top-p 0.95) with the generator seeded by sample_seed + that index."""
    import torch

    eos = set(models.eos_token_ids(model))
    device = next(model.parameters()).device
    options = {"do_sample": False}
    if sample_seed is not None:
        options = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0}
    for start in range(0, len(prompt_ids), batch_size):
        ids = prompt_ids[start:start + batch_size]
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        if sample_seed is not None:
            torch.manual_seed(sample_seed + start)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=0,
                                 max_new_tokens=max_new_tokens, **options)
        answers = []
        for row in out[:, width:].tolist():
            answer = []
            for token in row:
                answer.append(token)
                if token in eos:
                    break
            answers.append(answer)
        yield start, answers


def self_instruct_prompts(config: DistillConfig, target, tokenizer, path: pathlib.Path,
                          fixed: list[str]) -> list[str]:
    """The prompts the target wrote for the config's self-instruct requests, made (or, after a
    stop, finished) by sampling; appends to `path`. Only answers that ended (EOS) count; none
    repeats a fixed training prompt or is a benchmark prompt."""
    from tqdm import tqdm

    from batchspec_tools.data import bench_prompts, train_prompts

    done = read_jsonl(path) if path.exists() else []
    requests = train_prompts.self_instruct_requests(config.self_instruct, seed=config.seed)
    todo = requests[len(done):]
    eos = set(models.eos_token_ids(target))
    if todo:
        bar = tqdm(total=len(requests), initial=len(done), desc="self-instruct", unit="prompt")
        ids = [models.chat_ids(tokenizer, r["request"]) for r in todo]
        with path.open("a") as sink:
            for start, answers in answer_batches(target, ids, config.max_new_tokens,
                                                 config.gen_batch_size,
                                                 sample_seed=config.seed + len(done)):
                for request, answer in zip(todo[start:start + len(answers)], answers):
                    text = tokenizer.decode(answer, skip_special_tokens=True)
                    ended = bool(answer) and answer[-1] in eos
                    prompt = train_prompts.self_instruct_prompt(request, text) if ended else None
                    record = {**request, "answer": text, "prompt": prompt}
                    sink.write(json.dumps(record) + "\n")
                    done.append(record)
                sink.flush()
                bar.update(len(answers))
        bar.close()
    taken = set(fixed) | {row["prompt"] for row in bench_prompts()}
    written = [p for p in dict.fromkeys(r["prompt"] for r in done if r["prompt"])
               if p not in taken]
    if config.self_instruct:
        log.info("self-instruct: %d usable prompts from %d requests", len(written), len(done))
    return written


def generate_data(config: DistillConfig, target, tokenizer, path: pathlib.Path,
                  prompts: list[str]) -> list[dict]:
    """The target's greedy answers to `prompts` (the fixed ones, then those it wrote itself);
    appends to `path`, resuming."""
    from tqdm import tqdm

    done = read_jsonl(path) if path.exists() else []
    todo = prompts[len(done):]
    bar = tqdm(total=len(prompts), initial=len(done), desc="generate", unit="prompt")
    ids = [models.chat_ids(tokenizer, p) for p in todo]
    with path.open("a") as sink:
        for start, answers in answer_batches(target, ids, config.max_new_tokens,
                                             config.gen_batch_size):
            for prompt, prompt_ids, answer in zip(todo[start:], ids[start:], answers):
                record = {"prompt": prompt, "input_ids": prompt_ids, "output_ids": answer}
                sink.write(json.dumps(record) + "\n")
                done.append(record)
            sink.flush()
            bar.update(len(answers))
    bar.close()
    return done


def teacher_labels(config: DistillConfig, target, data, vocab, path: pathlib.Path):
    """Per sequence: (top-k indices into vocab, their probabilities) at every answer position,
    from the target's distribution restricted to the draft vocabulary; None for an empty
    answer. Right-padded batches of gen_batch_size on the target's device; cached in `path`."""
    import torch
    from tqdm import tqdm

    labels = torch.load(path, weights_only=False) if path.exists() else []
    if len(labels) == len(data):
        return labels
    device = next(target.parameters()).device
    subset = torch.tensor(vocab, device=device)
    todo = data[len(labels):]
    bar = tqdm(total=len(data), initial=len(labels), desc="teacher", unit="seq")
    with torch.inference_mode():
        for start in range(0, len(todo), config.gen_batch_size):
            batch = todo[start:start + config.gen_batch_size]
            input_ids, mask = right_padded([r["input_ids"] + r["output_ids"] for r in batch])
            hidden = target.model(input_ids=input_ids.to(device),
                                  attention_mask=mask.to(device)).last_hidden_state
            for i, record in enumerate(batch):
                prompt, answer = record["input_ids"], record["output_ids"]
                if not answer:
                    labels.append(None)
                    continue
                # position t predicts token t + 1: the positions that predict answer tokens
                logits = target.lm_head(hidden[i, len(prompt) - 1:len(prompt) + len(answer) - 1])
                probs, index = logits[:, subset].float().softmax(-1).topk(config.teacher_top_k,
                                                                          dim=-1)
                labels.append((index.to(torch.int16).cpu(),
                               (probs / probs.sum(-1, keepdim=True)).half().cpu()))
            bar.update(len(batch))
    bar.close()
    torch.save(labels, path)
    return labels


def pick_vocabulary(data: list[dict], size: int, eos_ids: list[int]) -> list[int]:
    counts = Counter(t for d in data for t in d["output_ids"])
    chosen = [t for t, _ in counts.most_common(size)]
    for token in eos_ids:
        if token not in chosen:
            chosen.append(token)
    return sorted(chosen)


def train(config: DistillConfig, data: list[dict], vocab: list[int], out: pathlib.Path,
          teacher=None):
    """Train LoRA deltas + the final norm; returns (final loss, vocabulary coverage)."""
    import torch
    from tqdm import tqdm

    from batchspec.runtime import draft_model

    student = models.load_causal_lm(config.target, num_layers=config.num_layers,
                                    device=config.device)
    for param in student.parameters():
        param.requires_grad_(False)
    wrapped = draft_model.attach_lora(student, config.lora_rank, config.lora_alpha)
    head = draft_model.attach_subset_head(student, vocab)
    student.model.norm.weight.requires_grad_(True)
    params = [p for _, m in wrapped for p in (m.lora_a, m.lora_b)] + [student.model.norm.weight]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    index_of = torch.full((student.config.vocab_size,), -100, dtype=torch.long)
    index_of[torch.tensor(vocab)] = torch.arange(len(vocab))
    index_of = index_of.to(config.device)
    examples = [(d["input_ids"], d["output_ids"], teacher[i] if teacher else None)
                for i, d in enumerate(data) if d["output_ids"]]
    answer_tokens = [t for _, o, _ in examples for t in o]
    coverage = sum(int(index_of[t] >= 0) for t in answer_tokens) / max(1, len(answer_tokens))

    checkpoint = out / "checkpoint.pt"
    step, losses = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=config.device)
        for (name, module) in wrapped:
            module.lora_a.data.copy_(state["lora"][name][0])
            module.lora_b.data.copy_(state["lora"][name][1])
        student.model.norm.weight.data.copy_(state["norm"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], state["losses"]
        log.info("resumed from step %d", step)
    rng = random.Random(config.seed + step)
    bar = tqdm(total=config.steps, initial=step, desc="train", unit="step")
    student.train()
    while step < config.steps:
        batch = rng.sample(examples, min(config.batch_size, len(examples)))
        loss = train_step(student, head, batch, index_of)
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
            torch.save({"lora": {n: (m.lora_a.data, m.lora_b.data) for n, m in wrapped},
                        "norm": student.model.norm.weight.data, "optimizer":
                        optimizer.state_dict(), "step": step, "losses": losses}, checkpoint)
            draft_model.save_adapter(out, wrapped, student.model.norm.weight)
    bar.close()
    draft_model.save_adapter(out, wrapped, student.model.norm.weight)
    tail = losses[-20:] or [float("nan")]
    return round(sum(tail) / len(tail), 4), round(coverage, 4)


def train_step(student, head, batch, index_of):
    """Cross-entropy of the draft's subset head against the target: its top-k probabilities
    when there are soft labels, else its greedy answer tokens."""
    import torch

    device = index_of.device
    input_ids, mask = right_padded([p + o for p, o, _ in batch])
    hidden = student.model(input_ids=input_ids.to(device),
                           attention_mask=mask.to(device)).last_hidden_state
    losses = []
    for i, (prompt, answer, soft) in enumerate(batch):
        # position t predicts token t + 1: the positions that predict answer tokens
        log_q = head.subset_logits(hidden[i, len(prompt) - 1:len(prompt) + len(answer) - 1])
        log_q = log_q.log_softmax(-1)
        if soft is not None:
            index, probs = (t.to(device) for t in soft)
            losses.append(-(probs.float() * log_q.gather(-1, index.long())).sum(-1))
        else:
            targets = index_of[torch.tensor(answer, device=device)]
            keep = targets >= 0
            losses.append(-log_q[keep].gather(-1, targets[keep, None]).squeeze(-1))
    return torch.cat(losses).mean()
