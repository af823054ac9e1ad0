"""Linear layers on CPU computed the way each shape and row count runs fastest: weight-major,
through a oneDNN-packed copy of the weight, or as usual.

With the MKL build of CPU torch (float32), `x @ W.T` for a handful of rows (one decode step, a
K+1-token verify) costs about one matrix-vector product *per row*, while the same product taken
as `(W @ x.T).T` costs little more for 2 to 64 rows than for one: verifying K+1 tokens then
costs about what decoding one does (docs/benchmarks.md has figures).

The kernel's speed also jumps with the row count, and not monotonically: some row counts cost
more than the next larger one. So `tune(model)` (run by each service and by the benchmark at
start-up) times, for every weight shape and 1 to MAX_ROWS rows, the usual product and the
weight-major one with the rows padded to a few sizes (padding rows are zeros, their outputs
dropped: each output row of a product depends on its own input row alone), on enough copies
of the weight that it comes from memory as in a real forward, in turns and by the least of
TIMING_TURNS (other work on the machine only adds time), and keeps the fastest for the rest of
the process (and, given a store file, for every later process on the same machine). A model
whose linear weights fit in the CPU cache (the tests' tiny ones) is not worth timing and
takes DEFAULT_PLAN. `python -m batchspec.runtime.fastlinear` prints the timings and the
choices for the machine it runs on.

A third way, where torch is built with oneDNN (mkldnn): multiply by a copy of the weight
reordered once into oneDNN's blocked layout (`PACKED`). On CPUs with AVX-512 it costs about
the same for 1 to 16 rows and far less than the usual way at every row count: a verify of K + 1
tokens then costs little more than decoding one, and a batch of 32 rows less than stock
transformers. The copy
is made on first use and kept with the weight (twice the memory of the linear weights); it is
never used where gradients are needed. Past MAX_ROWS rows the plan holds one more entry,
timed at LARGE_ROWS rows between the usual product and the packed one.

It is the same product with another summation order: results agree to float32 rounding,
exactly as a batched forward agrees with an unbatched one. Inputs on other devices, and
products that need gradients, take the usual path.

Inside `only_positions(valid)` a linear layer computes only the positions `valid` marks and
leaves zeros in the others: a verify whose rows carry fewer drafts than its widest row pays
for its real positions, not for the padding (linear layers act on each position alone, so a
real position's output is what it would be anyway). Layers fed the same input (a layer's
query, key and value projections) gather its real positions once, and a feed-forward block
(`patch_feed_forwards`) runs packed from its input to its output: its inner layers never see
the padding, so it is gathered and scattered once, not at each of its linear layers.
"""
import contextlib
import functools
import math
import pathlib
import platform
import threading
import time
import types

import torch

from batchspec.runtime import cache_dir

# Row counts planned one by one; weight-major pays only up to here (measured up to 128 rows).
MAX_ROWS = 16
# The row count timed for the plan's last entry, which every count past MAX_ROWS takes.
LARGE_ROWS = 64
USUAL = 0  # a plan entry: compute x @ W.T as usual
PACKED = -1  # a plan entry: multiply by the oneDNN-packed copy of the weight


def candidates(rows: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """Ways to compute `rows` rows: USUAL, weight-major padded to each listed size (up to
    MAX_ROWS rows), and PACKED where oneDNN can multiply this dtype."""
    sizes = {rows, rows + rows % 2, -(-rows // 4) * 4, MAX_ROWS}
    methods = [USUAL] + sorted(size for size in sizes if rows <= size <= MAX_ROWS)
    return methods + ([PACKED] if packing_works(dtype) else [])


def _product(flat: torch.Tensor, weight: torch.Tensor, method: int) -> torch.Tensor:
    """flat [rows, in] @ weight.T -> [rows, out], contiguous, by the planned method (USUAL,
    PACKED, or weight-major with the rows padded to `method` rows)."""
    rows = flat.shape[0]
    if method == USUAL:
        return flat @ weight.T
    if method == PACKED:
        return torch.ops.mkldnn._linear_pointwise(flat, packed(weight), None, "none", [None], "")
    if method > rows:  # zero rows, in one op; their outputs are dropped below
        flat = torch.nn.functional.pad(flat, (0, 0, 0, method - rows))
    return (weight @ flat.T).T[:rows].contiguous()


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered for oneDNN, made on first use and kept on the weight itself (so it
    lives as long as the weight); made again if the weight has changed in place since."""
    version = None if weight.is_inference() else weight._version  # inference tensors have none
    kept = getattr(weight, "_batchspec_packed", None)
    if kept is None or kept[0] != version:
        with torch.no_grad():
            kept = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        weight._batchspec_packed = kept
    return kept[1]


_PACKING: dict[torch.dtype, bool] = {}


def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build multiplies `dtype` by a oneDNN-packed weight (tried once)."""
    if dtype not in _PACKING:
        try:
            weight, flat = torch.ones(8, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype)
            _PACKING[dtype] = bool(torch.backends.mkldnn.is_available()) and torch.equal(
                _product(flat, weight, PACKED), flat @ weight.T)
        except (RuntimeError, AttributeError):  # no such op, or not for this dtype
            _PACKING[dtype] = False
    return _PACKING[dtype]


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX) and this torch
    build multiplies it by a packed weight: then bfloat16 products move half the bytes of
    float32 ones at the same speed per byte."""
    cpu = getattr(torch, "cpu", None)
    hardware = any(getattr(cpu, name, lambda: False)()
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return hardware and packing_works(torch.bfloat16)


# Weights a timing cycles through, at least this many bytes in all: a model's weights do not
# sit in the CPU cache between layers, so neither may the timed ones (hot weights favour the
# usual product for one row, cold ones the weight-major one).
COLD_BYTES = 64 << 20


# Turns of a timing: each turn times every candidate once, in a rotated order.
TIMING_TURNS = 5


def least_in_turns(runs: list, turns: int = TIMING_TURNS) -> list[float]:
    """Each of `runs` (callables, already warmed up) timed `turns` times, every turn timing
    each once in a rotated order: the least time of each. Other work on the machine (another
    service loading or timing, the host) only ever adds time: the least of several turns is
    the run's own time, and taking the runs in turns never judges one on a slower stretch than
    the others (timed one after another, a candidate timed while another process loaded its
    model lost to a slower one, and kept it for as long as the process ran)."""
    least = [math.inf] * len(runs)
    order = list(range(len(runs)))
    for turn in range(turns):
        shift = turn % len(runs)
        for i in order[shift:] + order[:shift]:
            started = time.perf_counter()
            runs[i]()
            least[i] = min(least[i], time.perf_counter() - started)
    return least


def _pass(flat: torch.Tensor, weights: list[torch.Tensor], method: int) -> None:
    """One product by `method` with each of `weights` (one pass over all)."""
    for weight in weights:
        _product(flat, weight, method)


def _least_seconds(flat: torch.Tensor, weights: list[torch.Tensor],
                   methods: list[int]) -> dict[int, float]:
    """Each method's least time of one product (least_in_turns, over passes across all
    `weights`, so that they come from memory as in a forward)."""
    for weight in weights[:2]:
        for method in methods:
            _product(flat, weight, method)  # warm-up
    least = least_in_turns([functools.partial(_pass, flat, weights, m) for m in methods])
    return {method: seconds / len(weights) for method, seconds in zip(methods, least)}


def _cold_weights(out_features: int, in_features: int, dtype: torch.dtype) -> list[torch.Tensor]:
    one = torch.randn(out_features, in_features).to(dtype)
    copies = max(1, min(64, -(-COLD_BYTES // (one.numel() * one.element_size()))))
    return [one] + [one.clone() for _ in range(copies - 1)]  # distinct memory is what counts


def _fastest(flat: torch.Tensor, weights: list[torch.Tensor]) -> int:
    timed = _least_seconds(flat, weights, candidates(flat.shape[0], flat.dtype))
    return min(timed, key=timed.get)


# (out_features, in_features, dtype) -> the plan: entries for 1..MAX_ROWS rows, then one for
# every larger count
_PLANS: dict[tuple, tuple[int, ...]] = {}


# Weight-major for every row count, one row computed as two, and the usual product past
# MAX_ROWS: the plan of shapes not worth timing (a model small enough to live in the CPU cache
# gains little either way).
DEFAULT_PLAN = tuple([2] + list(range(2, MAX_ROWS + 1)) + [USUAL])
# A lone weight, or a whole model's linear weights, smaller than this is not timed: it stays in
# the CPU cache, where the kernels differ little. A model above it (a feature head beside its
# target) is read from memory each step, where the kernels' layouts differ most.
MIN_TIMED_BYTES = 8 << 20


def plan(out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> int:
    """The fastest way (a `candidates` entry) to multiply `rows` rows by an [out, in] weight
    on this machine; every row count of a shape is timed together, once per process."""
    key = (out_features, in_features, dtype)
    if key not in _PLANS:
        size = out_features * in_features * dtype.itemsize
        _PLANS[key] = _timed_plan(*key) if size >= MIN_TIMED_BYTES else DEFAULT_PLAN
    return _PLANS[key][min(rows, MAX_ROWS + 1) - 1]


def _timed_plan(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, ...]:
    with torch.inference_mode():
        weights = _cold_weights(out_features, in_features, dtype)
        if packing_works(dtype):
            for weight in weights:  # packed before timing: a process packs once
                packed(weight)
        return tuple(_fastest(torch.randn(n, in_features).to(dtype), weights)
                     for n in [*range(1, MAX_ROWS + 1), LARGE_ROWS])


def tune(model: torch.nn.Module, store: pathlib.Path | None = None) -> int:
    """Time every linear weight shape of a CPU model now rather than at its first forward,
    when its linear weights are big enough to matter; returns how many shapes were timed.

    With `store` (a JSON file), a shape timed before on this machine (same CPU model, torch
    version and thread count) takes the stored plan, and newly timed ones are added: only the
    first process pays for timing, and every process on the machine (services, benchmark)
    multiplies the same way. Delete the file to time again."""
    weights = [m.weight for m in model.modules()
               if (isinstance(m, torch.nn.Linear) or getattr(m, "uses_weight_major", False))
               and m.weight.device.type == "cpu"]
    shapes = {(*w.shape, w.dtype) for w in weights}
    if sum(w.numel() * w.element_size() for w in weights) < MIN_TIMED_BYTES:
        for key in shapes:
            _PLANS.setdefault(key, DEFAULT_PLAN)
        return 0
    if all(key in _PLANS for key in shapes):
        return 0
    with cache_dir.timing_alone(store) if store else contextlib.nullcontext():
        # read after any other process timed
        stored = cache_dir.read_json(store) if store else {}
        machine_name = machine()
        timed = 0
        for key in shapes:
            if key in _PLANS:
                continue
            name = f"{machine_name} | {key[0]}x{key[1]} {key[2]}"
            if len(stored.get(name, ())) == len(DEFAULT_PLAN):  # else another format: time
                _PLANS[key] = tuple(stored[name])
                continue
            _PLANS[key] = _timed_plan(*key)
            stored[name] = list(_PLANS[key])
            timed += 1
        if store and timed:
            cache_dir.write_json(store, stored)
    return timed


def machine() -> str:
    """What a stored plan holds for: the same CPU model, torch version and thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip()
                   for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu} | torch {torch.__version__} | {torch.get_num_threads()} threads"
            f" | {TIMING_TURNS} turns | zero-padded")  # plans timed another way are timed again


class _Positions(threading.local):
    def __init__(self):  # per thread
        self.valid: torch.Tensor | None = None  # [batch, T] bool
        self.index: dict[int, torch.Tensor] = {}  # t -> flat indices of valid[:, -t:]
        # (input, its real positions) of the last gather: the next layer fed the same tensor
        # (key and value after query) takes them as they are. The input is held, so its
        # identity cannot pass to another tensor while it is kept.
        self.gathered: tuple[torch.Tensor, torch.Tensor] | None = None


_POSITIONS = _Positions()


@contextlib.contextmanager
def only_positions(valid: torch.Tensor):
    """Within it (on this thread), patched linear layers given [batch, t, in] inputs with
    t <= T compute only the positions valid[:, -t:] marks ([batch, T] bool, on the CPU) and
    give zeros elsewhere."""
    saved = (_POSITIONS.valid, _POSITIONS.index, _POSITIONS.gathered)
    _POSITIONS.valid, _POSITIONS.index, _POSITIONS.gathered = valid, {}, None
    try:
        yield
    finally:
        _POSITIONS.valid, _POSITIONS.index, _POSITIONS.gathered = saved


def valid_positions() -> torch.Tensor | None:
    """The [batch, T] bool positions the enclosing `only_positions` marks (None outside it)."""
    return _POSITIONS.valid


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x's positions `index` as [len(index), in] (once per input tensor, see _Positions)."""
    kept = _POSITIONS.gathered
    if kept is not None and kept[0] is x:
        return kept[1]
    packed = x.reshape(-1, x.shape[-1])[index]
    _POSITIONS.gathered = (x, packed)
    return packed


def _scatter(packed: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """[rows, out] zeros with `packed` at the positions `index`, shaped [*shape, out]."""
    out = packed.new_zeros(math.prod(shape), packed.shape[-1])
    if index.numel():
        out[index] = packed
    return out.reshape(*shape, packed.shape[-1])


def _valid_index(x: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the positions of x [batch, t, in] to compute, None for all of them."""
    valid = _POSITIONS.valid
    if valid is None or x.dim() != 3 or x.shape[0] != valid.shape[0] \
            or x.shape[1] > valid.shape[1]:
        return None
    t = x.shape[1]
    if t not in _POSITIONS.index:
        _POSITIONS.index[t] = valid[:, valid.shape[1] - t:].reshape(-1).nonzero().squeeze(1)
    return _POSITIONS.index[t]


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, computed the way `plan` found fastest for this many rows (only for the
    positions `only_positions` marks, inside it).

    x [..., in], weight [out, in] -> [..., out], contiguous."""
    rows = x.numel() // x.shape[-1]
    if rows == 0 or x.device.type != "cpu":
        return x @ weight.T
    index = _valid_index(x)
    if index is not None and index.numel() < rows:
        return _scatter(weight_major(_gather(x, index), weight), index, x.shape[:-1])
    blocks = getattr(weight, "_batchspec_gguf", None)  # gguf_blocks.Blocks (see its attach)
    out = None if blocks is None else by_blocks(x, blocks)
    if out is not None:
        return out
    flat = x.reshape(rows, x.shape[-1])
    method = plan(weight.shape[0], weight.shape[1], weight.dtype, rows)
    if rows > MAX_ROWS and method != PACKED:
        return x @ weight.T
    if method == PACKED and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        method = USUAL  # the packed product has no backward
    return _product(flat, weight, method).reshape(*x.shape[:-1], weight.shape[0])


def by_blocks(x: torch.Tensor, blocks) -> torch.Tensor | None:
    """x @ W.T through W's GGUF blocks (gguf_blocks.Blocks; only the positions
    `only_positions` marks), or None where they do not take this product: more rows than
    their max_rows, an input that is not float32 on the CPU, or one that needs gradients."""
    rows = x.numel() // x.shape[-1]
    if rows == 0 or x.device.type != "cpu" or x.dtype != torch.float32 \
            or (torch.is_grad_enabled() and x.requires_grad):
        return None
    index = _valid_index(x)
    if index is not None and index.numel() < rows:
        out = by_blocks(_gather(x, index), blocks)
        return None if out is None else _scatter(out, index, x.shape[:-1])
    if rows > blocks.max_rows:
        return None
    return blocks.product(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], -1)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = weight_major(x, self.weight)
    return out if self.bias is None else out + self.bias


def patch_linears(model: torch.nn.Module) -> int:
    """Make every nn.Linear multiply as `plan` finds fastest (on CPU inputs); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def packed_forward(forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A position-wise block's forward; inside only_positions, on the real positions only:
    gathered once, run with no padding (its own layers see every row real), scattered once."""
    index = _valid_index(x)
    if index is None or index.numel() == x.numel() // x.shape[-1]:
        return forward(x, *args, **kwargs)
    packed = _gather(x, index)
    saved = (_POSITIONS.valid, _POSITIONS.gathered)
    _POSITIONS.valid, _POSITIONS.gathered = None, None
    try:
        out = forward(packed[None], *args, **kwargs)[0]
    finally:
        _POSITIONS.valid, _POSITIONS.gathered = saved
    return _scatter(out, index, x.shape[:-1])


def patch_feed_forwards(model: torch.nn.Module) -> int:
    """Make every feed-forward block (a submodule named `mlp`: Llama's, GPT-2's and their
    kind, which act on each position alone) run on the real positions only inside
    only_positions; returns how many. Their outputs at padded positions are zeros, which no
    real position reads (padding is never attended to and its logits are never kept)."""
    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp" and not hasattr(module, "packs_positions"):
            module.forward = functools.partial(packed_forward, module.forward)
            module.packs_positions = True
            count += 1
    return count


def patched(model: torch.nn.Module) -> bool:
    """Whether patch_linears made this model's linear layers multiply as planned."""
    return any(planned(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def planned(linear: torch.nn.Linear) -> bool:
    """Whether patch_linears made this linear layer multiply as planned."""
    return getattr(linear.forward, "__func__", None) is _forward


def main() -> None:
    """Print, per shape and row count, the usual, weight-major and packed timings and the plan."""
    print("out x in      rows    x@W.T us  (W@x.T).T us  packed us   plan")
    names = {USUAL: "x@W.T", PACKED: "packed"}
    with torch.inference_mode():
        for out_features, in_features in [(49152, 576), (1536, 576), (576, 1536), (576, 576)]:
            weights = _cold_weights(out_features, in_features, torch.float32)
            for rows in [*range(1, MAX_ROWS + 1), LARGE_ROWS]:
                flat = torch.randn(rows, in_features)
                methods = [USUAL, rows] + ([PACKED] if packing_works(torch.float32) else [])
                timed = {m: t * 1e6 for m, t in _least_seconds(flat, weights, methods).items()}
                usual, major, fast = timed[USUAL], timed[rows], timed.get(PACKED, math.nan)
                chosen = plan(out_features, in_features, torch.float32, rows)
                label = names.get(chosen, f"weight-major, {chosen} rows")
                shape = f"{out_features:>5} x {in_features:<5}"
                print(f"{shape} {rows:>4} {usual:>11.0f} {major:>13.0f} {fast:>10.0f}   {label}")


if __name__ == "__main__":
    main()
