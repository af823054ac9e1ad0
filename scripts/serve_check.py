"""Greedy answers from a running server against the target alone, on a device of your choice:
how many of them are token for token what Hugging Face `generate` gives at batch 1.

    batchspec serve --device cuda --port 50077 &
    python3 scripts/serve_check.py --port 50077 --device cuda --num-prompts 16

The prompts (held-out benchmark prompts, every kind of work in turn) are sent at once, as
chat messages, and the reference decodes each alone on `--device` in `--dtype` (float32 by
default: the product's promise; in a half precision a batch rounds differently from one
request alone, so an answer may part from the reference where two tokens nearly tie).
"""
import argparse
import concurrent.futures
import sys
import time

import grpc
import torch

from batchspec import cliargs
from batchspec.runtime import models
from batchspec.v1 import generate_pb2, generate_pb2_grpc
from batchspec_tools.data import bench_prompts


def served(stub, prompt: list[int], max_new: int) -> list[int]:
    responses = stub.Generate(generate_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                           max_new_tokens=max_new), timeout=600)
    return [t for r in responses for t in r.token_ids]


def reference(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=cliargs.port, required=True, help="the server's gRPC port")
    parser.add_argument("--target", default="smollm2", help="the target the server runs")
    parser.add_argument("--device", default="cpu", help="where the reference decodes")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="what the reference decodes in (the server's --dtype)")
    parser.add_argument("--num-prompts", type=cliargs.positive_int, default=16)
    parser.add_argument("--max-new-tokens", type=cliargs.positive_int, default=64)
    args = parser.parse_args()
    tokenizer = models.load_tokenizer(args.target)
    prompts = [models.chat_ids(tokenizer, p["prompt"]) for p in bench_prompts(args.num_prompts)]
    channel = grpc.insecure_channel(f"127.0.0.1:{args.port}")
    grpc.channel_ready_future(channel).result(timeout=600)
    stub = generate_pb2_grpc.CoordinatorStub(channel)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: served(stub, p, args.max_new_tokens), prompts))
    print(f"served {len(prompts)} requests at once in {time.perf_counter() - started:.1f} s")
    model = models.load_causal_lm(args.target, device=args.device, dtype=args.dtype)
    eos = set(models.eos_token_ids(model))
    same = 0
    for i, (prompt, got) in enumerate(zip(prompts, answers)):
        want = reference(model, prompt, args.max_new_tokens, eos)
        same += want == got
        if want != got:
            at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b),
                      min(len(want), len(got)))
            print(f"prompt {i}: differs at token {at}: reference {want[at:at + 5]}, "
                  f"served {got[at:at + 5]}")
    print(f"exact: {same}/{len(prompts)} (reference on {args.device}, {args.dtype})")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
