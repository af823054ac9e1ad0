"""Linear layers computed weight-major on CPU.

With the MKL build of torch used here (CPU, float32), `x @ W.T` for a handful of rows (one
decode step, a K+1-token verify) costs about one matrix-vector product *per row*, while the
same product taken as `(W @ x.T).T` costs little more for 2 to 64 rows than for one. The output
head of SmolLM2 (49,152 x 576) takes 10.3 ms for 2 rows as `x @ W.T` and 2.1 ms as
`(W @ x.T).T` on the 2-core machine this project is developed on (`python -m
batchspec.fastlinear` prints the table for the machine it runs on). Over the whole target, one
decode step (batch 1, 100 cached positions) falls from 31.8 to 22.6 ms and a 4-token verify
from 49.4 to 23.9 ms: verifying K+1 tokens costs about what decoding one does.

It is the same product with another summation order: results agree to float32 rounding,
exactly as a batched forward agrees with an unbatched one. Inputs on other devices take the
usual path.
"""
import types

import torch
import torch.nn.functional as F

# Past this many rows both forms cost the same (measured up to 128 rows).
MAX_ROWS = 16


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, taken as (weight @ x.T).T for up to MAX_ROWS rows.

    x [..., in], weight [out, in] -> [..., out], contiguous."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or x.device.type != "cpu":
        return x @ weight.T
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.repeat(2, 1)  # the two-row product is the faster one here
    out = (weight @ flat.T).T[:rows]
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = weight_major(x, self.weight)
    return out if self.bias is None else out + self.bias


def patch_linears(model: torch.nn.Module) -> int:
    """Make every nn.Linear compute weight-major (on CPU inputs); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def main() -> None:
    import time

    def median_us(fn, n=30):
        times = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return sorted(times)[n // 2] * 1e6

    print("out x in     rows   x@W.T us   (W@x.T).T us")
    with torch.inference_mode():
        for out_features, in_features in [(49152, 576), (1536, 576), (576, 1536)]:
            weight = torch.randn(out_features, in_features)
            for rows in (1, 2, 3, 4, 8, 16):
                x = torch.randn(rows, in_features)
                plain = median_us(lambda: F.linear(x, weight))
                fast = median_us(lambda: weight_major(x, weight))
                shape = f"{out_features:>5} x {in_features:<5}"
                print(f"{shape} {rows:>4} {plain:>10.0f} {fast:>14.0f}")


if __name__ == "__main__":
    main()
