"""Bytes one drafted token's distribution takes on the wire, for a vocabulary and filters.

    python3 scripts/wire_bytes.py --vocab 49152 --num-draft-tokens 4

Uses random logits (scale 3) in place of a model: the dense form's size does not depend on
them; the sparse forms' sizes depend only on how many tokens survive top_k / top_p.
"""
import argparse

import torch

from batchspec.runtime import probs_wire, sampling
from batchspec.v1 import draft_pb2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    logits = torch.randn(1, 1, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    print("| filters | bytes per drafted token | bytes per sequence per step (K="
          f"{args.num_draft_tokens}) |\n| --- | --- | --- |")
    for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.9), (0, 0.5)):
        q = sampling.processed_probs(logits, torch.tensor([1.0]), torch.tensor([top_k]),
                                     torch.tensor([top_p]))[0, 0]
        _, ids, payload = probs_wire.wire_round_trip(q)
        size = draft_pb2.SparseProbs(token_ids=ids, probs_f16=payload).ByteSize()
        print(f"| top_k={top_k} top_p={top_p} | {size} | {size * args.num_draft_tokens} |")


if __name__ == "__main__":
    main()
