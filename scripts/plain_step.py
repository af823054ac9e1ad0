"""Time of one plain decoding step (no drafts) of a batch of chat prompts, three ways:

    runner   batchspec's model runner in this process (what the target service runs)
    loop     a hand-written Hugging Face decoding loop over the same left-padded batch, same
             kernels (what batched `generate` does per step)
    service  verify commands with no drafts sent to a running target service (--address),
             round trip and the forward time the service reports

    python3 scripts/plain_step.py --rows 8 --steps 40
    python3 scripts/plain_step.py --rows 8 --steps 40 --address 127.0.0.1:50052

Tells apart what a plain step costs in the runner from what serving adds around it.
"""
import argparse
import time

import torch

from batchspec.params import SamplingParams
from batchspec.runtime import kvcache, models
from batchspec_tools.data import read_jsonl

HELD_OUT = "docs/bench/heldout_prompts.jsonl"


def prompts() -> list[list[int]]:
    tokenizer = models.load_tokenizer("smollm2")
    return [models.chat_ids(tokenizer, r["prompt"]) for r in read_jsonl(HELD_OUT)]


def time_runner(batch: list[list[int]], steps: int):
    """(seconds per plain verify command in the runner, the runner's model)."""
    from batchspec.runtime.service import ServiceConfig, build_runner, warm_up
    from target_service.verifier import VerifyRow, verify

    runner = build_runner(ServiceConfig(model=models.model_path("smollm2")))
    warm_up(runner)
    ids = list(range(1, len(batch) + 1))
    runner.prefill([(i, p[:-1]) for i, p in zip(ids, batch)])
    last = {i: p[-1] for i, p in zip(ids, batch)}
    lengths = {i: len(p) - 1 for i, p in zip(ids, batch)}
    started = time.perf_counter()
    for _ in range(steps):
        rows = [VerifyRow(i, lengths[i], [last[i]], [], SamplingParams()) for i in ids]
        outcomes, _ = verify(runner, rows, realign=True)
        for o in outcomes:
            last[o.seq_id], lengths[o.seq_id] = o.output_token_ids[-1], o.cache_len
    return (time.perf_counter() - started) / steps, runner.model


@torch.inference_mode()
def time_loop(model, batch: list[list[int]], steps: int) -> float:
    """Seconds per step of a Hugging Face decoding loop over the left-padded batch."""
    from transformers import DynamicCache

    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                use_cache=True, logits_to_keep=1, **kvcache.with_cache(model, DynamicCache()))
    started = time.perf_counter()
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(len(batch), 1)], 1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), attention_mask=mask,
                    position_ids=positions, use_cache=True, logits_to_keep=1,
                    **kvcache.with_cache(model, kvcache.returned_cache(out)))
    return (time.perf_counter() - started) / steps


def time_service(address: str, batch: list[list[int]], steps: int) -> None:
    from coordinator.clients import TargetClient, VerifySpec

    client = TargetClient(address)
    ids = list(range(1_000_001, 1_000_001 + len(batch)))
    client.prefill([(i, p[:-1]) for i, p in zip(ids, batch)])
    last = {i: p[-1] for i, p in zip(ids, batch)}
    lengths = {i: len(p) - 1 for i, p in zip(ids, batch)}
    round_trip = forward = 0.0
    try:
        for step in range(steps + 3):  # three untimed first
            specs = [VerifySpec(i, lengths[i], [last[i]], [], SamplingParams()) for i in ids]
            started = time.perf_counter()
            outcomes, timing = client.verify(True, specs)
            if step >= 3:
                round_trip += time.perf_counter() - started
                forward += timing.forward_seconds
            for o in outcomes:
                last[o.seq_id], lengths[o.seq_id] = o.output_token_ids[-1], o.cache_len
    finally:
        client.release(ids)
    print(f"service round trip {round_trip / steps * 1000:.1f} ms/step, forward "
          f"{forward / steps * 1000:.1f} ms ({len(batch)} rows)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--address", help="a running target service serving smollm2")
    args = parser.parse_args()
    available = prompts()
    if not 1 <= args.rows <= len(available) or args.steps < 1:
        parser.error(f"--rows must be in [1, {len(available)}] (the held-out prompts) and "
                     "--steps >= 1")
    torch.set_num_threads(2)
    batch = available[:args.rows]
    if args.address:
        time_service(args.address, batch, args.steps)
        return
    runner_s, model = time_runner(batch, args.steps)
    loop_s = time_loop(model, batch, args.steps)
    print(f"runner {runner_s * 1000:.1f} ms/step, loop {loop_s * 1000:.1f} ms/step "
          f"({len(batch)} rows)")


if __name__ == "__main__":
    main()
