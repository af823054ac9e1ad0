"""`batchspec distill --kind bytes`: a small byte-level model trained from scratch on the
target's own chat answers: a draft of another tokenizer than the target's (its tokens are
bytes, and the target's special tokens whole), served translated to the target's tokens
(draft_service.translating).

It is saved as a plain model directory (config, weights, tokenizer.json) with the record of
how it was made in `batchspec_training.json`; `batchspec serve --draft-model DIR` sees its
tokenizer differs from the target's and serves it translating.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import time

log = logging.getLogger("batchspec_tools.drafting.byte_draft")
RECORD = "batchspec_training.json"
HIDDEN = 256  # the model's width; its depth is DistillConfig.num_layers
WINDOW = 384  # bytes per training window


def byte_tokenizer(specials: list[str]):
    """A byte-level tokenizer: the 256 bytes as GPT-2 writes them, no merges, and `specials`
    (the target's special tokens) as whole tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: ord(c))
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tokenizer


def special_tokens(tokenizer) -> list[str]:
    """The target tokenizer's special tokens, in id order."""
    return [t.content for _, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special]


def distill_bytes(config, tokenizer, data: list[dict], out: pathlib.Path, command: str,
                  started: float, prompts_note: str) -> pathlib.Path:
    """Train and save the byte-level draft on `data` (the target's answers: prompt ids and
    output ids, decoded with the target's `tokenizer`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = special_tokens(tokenizer)
    own = byte_tokenizer(specials)
    texts = [tokenizer.decode(d["input_ids"] + d["output_ids"], skip_special_tokens=False)
             for d in data]
    ids = torch.tensor([t for text in texts for t in own.encode(text).ids])
    log.info("byte draft: %d sequences, %d tokens of training text", len(texts), len(ids))
    eos = own.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=own.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=3 * HIDDEN,
        num_hidden_layers=config.num_layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos,
        bos_token_id=None, pad_token_id=eos)).to(config.device)
    final = train(model, ids, config)
    model = model.to("cpu").eval()
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=own, eos_token=tokenizer.eos_token
                            ).save_pretrained(out)
    (out / RECORD).write_text(json.dumps({
        "kind": "bytes", "target": config.target, "command": command,
        "config": dataclasses.asdict(config), "prompts": prompts_note,
        "num_sequences": len(texts), "num_bytes": len(ids), "final_loss": final,
        "seconds": round(time.time() - started, 1)}, indent=2))
    log.info("byte draft saved to %s (final loss %.3f)", out, final)
    return out


def train(model, ids, config) -> float:
    """Next-byte training on random windows of `ids`, with a linear warm-up and a cosine
    decay; returns the mean loss of the last 50 steps."""
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    window = min(WINDOW, len(ids) - 1)
    losses = []
    model.train()
    with torch.enable_grad():  # whatever the calling thread's mode
        for step in range(config.steps):
            losses.append(_train_step(model, optimizer, ids, window, generator, step, config))
            if step % 50 == 0 or step == config.steps - 1:
                log.info("byte draft step %d/%d: loss %.3f", step + 1, config.steps,
                         losses[-1])
    tail = losses[-50:]
    return sum(tail) / len(tail)


def _train_step(model, optimizer, ids, window: int, generator, step: int, config) -> float:
    """One optimizer step on config.batch_size random windows; returns its loss."""
    import torch

    scale = min(1.0, (step + 1) / config.warmup_steps) * 0.5 * (
        1 + math.cos(math.pi * step / config.steps))
    for group in optimizer.param_groups:
        group["lr"] = config.lr * scale
    starts = torch.randint(0, len(ids) - window, (config.batch_size,),
                           generator=generator).tolist()
    batch = torch.stack([ids[s:s + window] for s in starts]).to(config.device)
    loss = model(batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss)
