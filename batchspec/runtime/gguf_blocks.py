"""Linear layers that multiply by a GGUF file's weight blocks as stored (Q4_1, Q8_0).

A GGUF model loads as float32 (transformers dequantizes every tensor). Served with
`--dtype auto`, its linear layers then also keep the file's own blocks and, for a handful of
rows (a decode step, a verify of a few drafts), multiply by them through the C++ kernels of
`csrc/gguf_linear.cpp`: each block is dequantized in registers exactly as it was when the
model loaded and accumulated in float32, so the product is the float32 product of the same
weights up to summation order, reading a quarter to a fifth of the bytes. Larger products
(prefill, wide verifies) take the float32 weights as before.

Invariants:
- A layer gets blocks only where they dequantize to its float32 weight bit for bit (checked
  at load), so both paths multiply by the same model.
- The kernels are built once per machine (source, torch version) into the user cache and
  loaded by every process; a machine that cannot build them (no compiler) serves float32
  with one warning. The same library holds the decode step (decode_step) and the sampled
  choice (sampling.gumbel_max, csrc/sample_ops.h).
"""
import dataclasses
import fcntl
import hashlib
import logging
import pathlib

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).parent / "csrc" / "gguf_linear.cpp"
HEADERS = [SOURCE.with_name(name) for name in ("step_ops.h", "sample_ops.h")]  # SOURCE includes
# The block types the kernels read: GGUF type name -> Blocks.kind
KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}
# GGUF tensor names of a Llama-family model's linear layers, by module name suffix
_LLAMA = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

# -fopenmp: at::parallel_for runs on torch's OpenMP threads (the libgomp torch loaded);
# -ffp-contract=off: a dequantized weight is a product and a sum, never fused (as gguf-py)
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_loaded: bool | None = None


def build_dir() -> pathlib.Path:
    """Where the kernels are built: keyed by their source and the torch version."""
    from batchspec.runtime import cache_dir

    key = hashlib.sha256(b"".join(p.read_bytes() for p in (SOURCE, *HEADERS))
                         + " ".join(FLAGS).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    return cache_dir.user_cache_dir() / "kernels" / key


def load() -> bool:
    """Build (once per machine, under a lock) and load the kernels; False where they cannot
    be built here, logged once."""
    global _loaded
    if _loaded is None:
        _loaded = _build_and_load()
    return _loaded


def _build_and_load() -> bool:
    from torch.utils import cpp_extension

    out = build_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # services starting together build it once
            built = out / "batchspec_gguf.so"
            if built.is_file():  # built before (for this source, flags and torch)
                torch.ops.load_library(str(built))
                return True
            log.info("building the GGUF block kernels once into %s", out)
            cpp_extension.load(name="batchspec_gguf", sources=[str(SOURCE)],
                               extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                               build_directory=str(out), is_python_module=False,
                               verbose=False)
        return True
    except Exception as error:  # no compiler, no headers, a read-only cache: serve float32
        log.warning("cannot build the GGUF block kernels (%s): GGUF models are served in "
                    "float32, no step runs in one C++ call, and sampling runs in torch ops",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False


# The instruction sets the kernels are written for (csrc/gguf_linear.cpp's Isa), best last.
ISAS = ("scalar", "avx2", "avx512")


def best_isa() -> str:
    """The best of ISAS this CPU runs (what every product uses)."""
    return ISAS[torch.ops.batchspec_gguf.best_isa()]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A linear weight as its GGUF file stores it: `data` [out_features, bytes a row] uint8
    blocks of `kind` (a KINDS value). A layer's products of up to `max_rows` rows multiply
    by them (fastlinear.weight_major); 0: none does."""

    kind: str
    data: torch.Tensor
    in_features: int
    max_rows: int = 0

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [rows, in] float32 @ W.T, W the float32 weight the blocks hold."""
        return getattr(torch.ops.batchspec_gguf, f"{self.kind}_linear")(
            flat, self.data, self.in_features)

    def product_with(self, flat: torch.Tensor, isa: str) -> torch.Tensor:
        """product, computed with the instruction set `isa` (one of ISAS up to best_isa())."""
        return torch.ops.batchspec_gguf.linear_with(flat, self.data, self.in_features,
                                                   self.kind == "q4_1", ISAS.index(isa))

    def dequantize(self) -> torch.Tensor:
        """The [out, in] float32 weight the blocks hold."""
        return getattr(torch.ops.batchspec_gguf, f"dequantize_{self.kind}")(
            self.data, self.in_features)


def blocks_of(weight: torch.Tensor) -> Blocks | None:
    """The Blocks attached to a linear weight (see attach), or None."""
    return getattr(weight, "_batchspec_gguf", None)


def join(weights: list[torch.Tensor]) -> Blocks | None:
    """One Blocks for linear weights fed the same input, their rows stacked in order (one
    product gives each layer's outputs side by side, each what its own blocks give): each
    weight's Blocks becomes a view of the joined ones, so joining adds no memory. None
    unless every weight has blocks, all of one kind and width."""
    found = [blocks_of(w) for w in weights]
    if any(b is None for b in found) or len({(b.kind, b.in_features) for b in found}) != 1:
        return None
    data = torch.cat([b.data for b in found])
    start = 0
    for weight, blocks in zip(weights, found):
        end = start + blocks.data.shape[0]
        weight._batchspec_gguf = dataclasses.replace(blocks, data=data[start:end])
        start = end
    return Blocks(found[0].kind, data, found[0].in_features, min(b.max_rows for b in found))


def attach(model: torch.nn.Module, gguf_path: str) -> int:
    """Give every linear layer of a Llama-family model loaded from `gguf_path` the file's
    blocks for its weight, where they are of a kind the kernels read and dequantize to the
    layer's weight exactly; returns how many layers got them (0 where the kernels cannot be
    loaded or the model is of another family)."""
    import gguf
    import numpy as np

    if not load():
        return 0
    config = model.config
    if getattr(config, "model_type", None) not in ("llama", "mistral", "qwen2"):
        log.info("GGUF blocks: no kernels for model type %s; serving float32",
                 getattr(config, "model_type", None))
        return 0
    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
    skipped, found = [], []
    name_of = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.bias is not None:
            continue
        tensor, heads = _tensor_for(name, tensors, config)
        if tensor is None or tensor.tensor_type.name not in KINDS:
            skipped.append(name)
            continue
        data = np.array(tensor.data)
        if heads:  # llama.cpp stores q and k with each head's rotary halves interleaved
            data = _unpermute(data, heads)
        blocks = Blocks(KINDS[tensor.tensor_type.name],
                        torch.from_numpy(np.ascontiguousarray(data)), module.in_features)
        if blocks.data.shape[0] != module.out_features or module.in_features % 32 or \
                not torch.equal(blocks.dequantize(), module.weight.detach()):
            skipped.append(name)
            continue
        found.append((module, blocks))
    attached = _attach_timed(found)
    skipped += [name_of[id(m)] for m, _ in found if blocks_of(m.weight) is None]
    read, floats = weight_bytes(model)
    log.info("GGUF blocks: %d linear layers multiply by the file's blocks (%s) up to %s rows, "
             "%.0f MB read for %.0f MB of float32 weights; %d keep float32%s", attached,
             ", ".join(sorted(KINDS)), sorted({b.max_rows for b in map(blocks_of, (
                 m.weight for m, _ in found)) if b}), read / 1e6, floats / 1e6,
             len(skipped), f" ({', '.join(skipped[:3])}...)" if skipped else "")
    return attached


def quantize_q8_0(model: torch.nn.Module) -> int:
    """Give a draft's linear layers (bias-free, inputs a multiple of 32 wide) and its
    weight-major output head Q8_0 blocks made from their weights, each weight replaced by what
    its blocks hold (so both paths multiply by the same, quantized, draft); returns how many
    got them (0 where the kernels cannot be loaded). A draft's numbers never reach the output
    (the target verifies every token, and a sampled draft's tokens are what its own logits
    chose), so a draft may be quantized where a target may not."""
    if not load():
        return 0
    found = []
    for module in model.modules():
        linear = isinstance(module, torch.nn.Linear) and module.bias is None
        if (linear or getattr(module, "uses_weight_major", False)) \
                and module.weight.dim() == 2 and module.weight.shape[1] % 32 == 0 \
                and module.weight.device.type == "cpu" and blocks_of(module.weight) is None:
            blocks = _q8_0(module.weight.detach())
            with torch.no_grad():
                module.weight.data = blocks.dequantize()
            found.append((module, blocks))
    attached = _attach_timed(found)
    read, floats = weight_bytes(model)
    log.info("Q8_0 blocks: %d of the draft's %d linear layers multiply by them, %.0f MB read "
             "for %.0f MB of float32 weights", attached, len(found), read / 1e6, floats / 1e6)
    return attached


def _q8_0(weight: torch.Tensor) -> Blocks:
    """[out, in] float weight -> Q8_0 Blocks, quantized as llama.cpp does (gguf-py)."""
    import gguf
    import numpy as np

    raw = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return Blocks("q8_0", torch.from_numpy(np.ascontiguousarray(raw)), weight.shape[1])


def _attach_timed(found: list) -> int:
    """Attach each (module, blocks) of `found` where its blocks multiply some rows faster
    than its float32 weight (_timed), with that many rows; returns how many got them."""
    attached = 0
    for module, blocks, max_rows in _timed(found):
        if max_rows:
            module.weight._batchspec_gguf = dataclasses.replace(blocks, max_rows=max_rows)
            attached += 1
    return attached


# Row counts timed for each shape: a layer multiplies by its blocks up to the largest count
# from which on every smaller one they were faster than its float32 weight.
TIMED_ROWS = (1, 2, 4, 8, 16)
TIMING_TURNS = 3


@torch.inference_mode()
def _timed(found: list):
    """(module, blocks, max_rows) for each: the most rows its blocks multiply faster than
    its float32 weight does (0: never), timed over every layer of its shape and kind in turn
    (as a forward reads them: not from the CPU cache) (_faster)."""
    from batchspec.runtime import cache_dir, fastlinear

    if found:  # the float32 products as the model will run them (timed once per machine)
        fastlinear.tune(_holder(found), cache_dir.kernel_plans_file())
    if sum(m.weight.numel() * 4 for m, _ in found) < fastlinear.MIN_TIMED_BYTES:
        # a model that lives in the CPU cache is not worth timing (as fastlinear.tune)
        yield from ((m, q, TIMED_ROWS[-1]) for m, q in found)
        return
    groups: dict[tuple, list] = {}
    for module, blocks in found:
        groups.setdefault((blocks.kind, *module.weight.shape), []).append((module, blocks))
    for members in groups.values():
        best = 0
        for rows in TIMED_ROWS:
            x = torch.randn(rows, members[0][0].weight.shape[1])
            if not _faster(lambda: [b.product(x) for _, b in members],
                           lambda: [fastlinear.weight_major(x, m.weight) for m, _ in members]):
                break
            best = rows
        for module, blocks in members:
            yield module, blocks, best


def _faster(by_blocks, by_floats) -> bool:
    """Whether the products `by_blocks` take less time than `by_floats`: each timed by the
    least of a few turns, one after the other; where the blocks lose, both again in turns
    (fastlinear.least_in_turns), each judged by its least time of all. (Judged by the first
    timings alone, a busy stretch of the machine during the blocks' turns kept a group of
    layers float32, and the model's step out of its one C++ call, for as long as the service
    ran.)"""
    from batchspec.runtime import fastlinear

    runs = [by_blocks, by_floats]
    least = []
    for run in runs:
        run()  # warm-up
        least += fastlinear.least_in_turns([run], TIMING_TURNS)
    if least[0] < least[1]:
        return True
    again = fastlinear.least_in_turns(runs, TIMING_TURNS)
    return min(least[0], again[0]) < min(least[1], again[1])


def _holder(found: list) -> torch.nn.Module:
    """A module holding the found layers (what fastlinear.tune takes)."""
    return torch.nn.ModuleList([module for module, _ in found])


def _tensor_for(name: str, tensors: dict, config):
    """The GGUF tensor holding module `name`'s weight and, for q and k, the head count
    its rows are permuted by (None otherwise)."""
    if name == "lm_head":
        return tensors.get("output.weight", tensors.get("token_embd.weight")), None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None, None
    suffix = ".".join(parts[3:])
    short = _LLAMA.get(suffix)
    if short is None:
        return None, None
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None)
             or config.num_attention_heads}.get(short)
    return tensors.get(f"blk.{parts[2]}.{short}.weight"), heads


def _unpermute(rows, heads: int):
    """Undo llama.cpp's rotary permutation of q or k rows (whole rows of blocks move; what
    transformers does to the dequantized weights when it loads the file)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of blocks a decode step reads, bytes of float32 weights they stand for)."""
    blocks = floats = 0
    seen = set()
    for module in model.modules():
        weighted = isinstance(module, torch.nn.Linear) or getattr(module, "uses_weight_major",
                                                                  False)
        if weighted and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found = blocks_of(module.weight)
            if found is not None:
                blocks += found.data.numel()
                floats += module.weight.numel() * 4
    return blocks, floats


def main() -> None:
    """Build the kernels now (what scripts/install.sh runs), and say whether they loaded."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print(f"GGUF block kernels: {'ready' if ok else 'unavailable'} ({build_dir()})")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
