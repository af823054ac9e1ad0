"""Draft distributions on the wire: float16, sparse over their support when that is smaller.

The draft samples from exactly `decode(*encode(q))`, so the q the verifier uses is the
distribution the draft token was drawn from, bit for bit, not an approximation of it.
"""
import numpy as np
import torch


def encode(probs: torch.Tensor) -> tuple[list[int], bytes]:
    """probs [vocab] -> (token_ids, float16 bytes). token_ids is empty for the dense form."""
    half = probs.detach().to("cpu", torch.float16)
    support = torch.nonzero(half).squeeze(-1)
    if support.numel() * 3 < half.numel():  # 4-byte id + 2-byte prob beat 2 bytes per token
        return support.tolist(), half[support].numpy().astype("<f2").tobytes()
    return [], half.numpy().astype("<f2").tobytes()


def decode(token_ids: list[int], probs_f16: bytes, vocab_size: int) -> torch.Tensor:
    """The dense float32 distribution [vocab] that (token_ids, probs_f16) stands for."""
    values = torch.from_numpy(np.frombuffer(probs_f16, dtype="<f2").astype(np.float32))
    if token_ids:
        if len(token_ids) != values.numel():
            raise ValueError("draft probs: token_ids and probs_f16 differ in length")
        dense = torch.zeros(vocab_size, dtype=torch.float32)
        dense[torch.tensor(token_ids, dtype=torch.long)] = values
    else:
        if values.numel() != vocab_size:
            raise ValueError(f"draft probs: dense form needs {vocab_size} values, "
                             f"got {values.numel()}")
        dense = values
    total = dense.sum()
    if not torch.isfinite(total) or total <= 0 or (dense < 0).any():
        raise ValueError("draft probs are not a distribution")
    return dense / total


def wire_round_trip(probs: torch.Tensor) -> tuple[torch.Tensor, list[int], bytes]:
    """(the distribution the wire form stands for, token_ids, bytes) for probs [vocab]."""
    token_ids, payload = encode(probs)
    return decode(token_ids, payload, probs.shape[-1]), token_ids, payload
