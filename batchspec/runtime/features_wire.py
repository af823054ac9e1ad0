"""The target's features on the wire (cache.proto `Features`): float16, row-major.

torch is imported only where a tensor is made or read, so a service that never sees features
(the n-gram draft) never imports it.
"""
from batchspec import errors
from batchspec.v1 import cache_pb2


def to_message(values) -> cache_pb2.Features:
    """[positions, width] float tensor -> Features (rounded to float16)."""
    import torch

    half = values.detach().to("cpu", torch.float16).contiguous()
    rows, width = half.shape
    return cache_pb2.Features(num_positions=rows, width=width,
                              values_f16=half.numpy().astype("<f2").tobytes())


def from_message(message: cache_pb2.Features, what: str):
    """Features -> [positions, width] float32 tensor; InvalidArgument when the payload does
    not hold num_positions x width float16 values."""
    import numpy as np
    import torch

    expected = 2 * message.num_positions * message.width
    if len(message.values_f16) != expected:
        raise errors.InvalidArgument(
            f"{what}: features of {message.num_positions} x {message.width} need {expected} "
            f"bytes, not {len(message.values_f16)}")
    values = np.frombuffer(message.values_f16, dtype="<f2").astype(np.float32)
    return torch.from_numpy(values.reshape(message.num_positions, message.width).copy())
