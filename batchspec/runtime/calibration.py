"""What a model's forwards cost, measured at start-up: the grid of batch sizes and tokens fed
that the coordinator's planner reads (runner.step_costs, sent in Describe), and on the way the
widest step a GGUF model runs in one C++ call (StepWidening). What was measured is kept in the
user cache (kept_step_costs): a later start of the same build, model and machine reads it."""
import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import torch

from batchspec.cachebook import StepCost
from batchspec.runtime import cache_dir, decode_step, fastlinear
from batchspec.runtime.runner import ModelRunner, RowSpec

# The grid measured at start-up: batch sizes a step may take and tokens a verify feeds
# (1 + K for K = 0..7); a draft step feeds 1 (or a few to catch up).
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
CALIBRATION_TOKENS = (1, 2, 3, 5, 8)


# A forward feeding more tokens than this in all runs long enough to be timed once.
LONG_FORWARD_TOKENS = 64
# Seconds the grid may take: enough for a small CPU to reach the default batch size (32).
CALIBRATION_BUDGET_S = 30.0


def zero_features(runner: ModelRunner, rows: int, tokens: int) -> torch.Tensor | None:
    """Features of zeros for timing a model that reads them (None for other models)."""
    if not runner.reads_features:
        return None
    return torch.zeros(rows, tokens, runner.reads_features)


def measure_step_costs(runner: ModelRunner, rows=CALIBRATION_ROWS, tokens=CALIBRATION_TOKENS,
                       context: int = 128, repeats: int = 2,
                       budget_s: float = CALIBRATION_BUDGET_S,
                       proposes: bool = False) -> list[StepCost]:
    """Time group forwards of `rows` sequences feeding `tokens` tokens each over `context`
    cached positions, the way verify and propose run them (`proposes`: a draft's, which needs
    the logits of each row's last position only; a verify needs every position's). Batch
    sizes grow until the grid would take more than budget_s (a slow device measures fewer of
    them). Past the grid costs are extrapolated, and on a CPU a wide verify at 32 rows costs
    far more than 8 rows suggest (compute-bound): a planner must have measured it to keep
    large batches plain.

    A GGUF model's step in one C++ call (decode_step) is widened on the way: at each batch
    size past its limit, one token a row in one call against the lean forward, until the lean
    forward is as fast (StepWidening)."""
    costs, began = [], time.perf_counter()
    context = min(context, runner.max_context_len - max(tokens) - 1)
    widening = StepWidening.of(runner)
    for num_rows in rows:
        size_began = time.perf_counter()
        ids = [-(i + 2) for i in range(num_rows)]  # never a coordinator's (positive) seq id
        runner.prefill([(seq_id, [0] * context) for seq_id in ids],
                       {s: zero_features(runner, 1, context)[0] for s in ids}
                       if runner.reads_features else None)
        try:
            if widening is not None:
                widening.weigh(num_rows, lambda: _step_seconds(runner, ids, context, 1,
                                                               proposes, repeats))
            for num_tokens in tokens:
                timed = repeats if num_rows * num_tokens <= LONG_FORWARD_TOKENS else 1
                costs.append(StepCost(num_rows, num_tokens, context, _step_seconds(
                    runner, ids, context, num_tokens, proposes, timed)))
        finally:
            runner.release(ids)
        now = time.perf_counter()
        if now - began + 2 * (now - size_began) > budget_s:  # the next size costs ~twice
            break
    return without_spikes(costs)


def without_spikes(costs: list[StepCost]) -> list[StepCost]:
    """Each cost at most that of every forward with as many rows and tokens or more: a
    forward that does less work costs no more, so a time above one of those is another
    process's (a busy stretch of the machine during its timing), and it is kept as the least
    time of what does at least its work. Other work only ever adds time, so the least holds."""
    return [dataclasses.replace(c, seconds=min(
        o.seconds for o in costs if o.rows >= c.rows and o.tokens >= c.tokens)) for c in costs]


def _step_seconds(runner: ModelRunner, ids: list[int], context: int, num_tokens: int,
                  proposes: bool, timed: int) -> float:
    """The least time of `timed` group forwards feeding `num_tokens` tokens to each of the
    cached sequences `ids` after their `context` positions (a first one warms up, untimed)."""
    times = []
    for attempt in range(timed + 1):
        specs = [RowSpec(s, context, context, [0] * num_tokens) for s in ids]
        group = runner.open_group(specs, realign=False)
        started = time.perf_counter()
        group.step(torch.zeros(len(ids), num_tokens, dtype=torch.long),
                   num_logits=1 if proposes else num_tokens,
                   features=zero_features(runner, len(ids), num_tokens))
        if attempt:
            times.append(time.perf_counter() - started)
    return min(times)


class StepWidening:
    """How many positions a GGUF model's step in one C++ call takes (decode_step.Decoder
    max_rows): at first the fewest any layer's blocks multiply faster than its float32
    weight; then, size by size, as many as it measured faster for than the lean forward
    (which multiplies by float32 weights past that: its Python calls cost a small model's
    step more than the blocks' slower products do at a few dozen rows), up to the first size
    where it was not. A step in one call gives each position what a step of its row alone
    gives, bit for bit, at any number of positions (the lean forward past the limit: the same
    up to rounding)."""

    def __init__(self, decoder: "decode_step.Decoder"):
        self.decoder = decoder
        self.open = True

    @classmethod
    def of(cls, runner: ModelRunner) -> "StepWidening | None":
        """The widening of the runner's GGUF step; None where it has none (or a float32
        step, which takes any number)."""
        decoder = getattr(runner.lean_forward, "decoder", None)
        return None if decoder is None or decoder.shapes else cls(decoder)

    def weigh(self, positions: int, seconds) -> None:
        """Widen the step to `positions` where `seconds()` (the time of a step of that many)
        is less in one call than through the lean forward; else widen no further. A loss is
        timed once more, in the other order, and judged by each way's least time: a busy
        stretch of the machine during one timing does not close the widening for good."""
        limit = self.decoder.max_rows
        if not self.open or positions <= limit:
            return
        widened = False
        try:
            least = {positions: float("inf"), limit: float("inf")}
            for order in ((positions, limit), (limit, positions)):
                for rows in order:
                    self.decoder.max_rows = rows
                    least[rows] = min(least[rows], seconds())
                widened = least[positions] < least[limit]
                if widened:
                    break
        finally:
            self.open = widened
            self.decoder.max_rows = positions if widened else limit


# ---- costs kept between starts ------------------------------------------------------------------
# Entries measured another way (a changed grid, format) are measured again.
KEPT_FORMAT = 1
# Entries a store keeps, the latest measured: models and builds come and go.
MAX_KEPT = 64
# The CPU features the kernels choose between at run time (machines of one CPU model differ).
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile")


def kept_step_costs(runner: ModelRunner, proposes: bool = False,
                    store: pathlib.Path | None = None) -> tuple[list[StepCost], str | None]:
    """(costs, when they were measured): those kept in `store` where this build measured
    this model on this machine (CPU and its features, device, threads, torch) the same way
    before, with the GGUF step widened as it was then, and its one-row forwards (a lone
    client's steps) timed again, each kept at the least of its times; else measured now
    (measure_step_costs), kept, and None. Processes starting together measure one after
    another; a store that cannot be read or written only means measuring again."""
    if store is None:
        return measure_step_costs(runner, proposes=proposes), None
    key = costs_key(runner, proposes)
    with cache_dir.timing_alone(store):
        stored = cache_dir.read_json(store)
        kept = _kept(stored.get(key), runner)
        if kept is None:
            costs, measured = measure_step_costs(runner, proposes=proposes), None
        else:
            costs, measured = least_of(kept[0], measure_step_costs(
                runner, rows=(1,), proposes=proposes)), kept[1]
        widening = StepWidening.of(runner)
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        stored[key] = {"measured": measured or now, "used": now, "model": runner.name,
                       "costs": [[c.rows, c.tokens, c.context, c.seconds] for c in costs],
                       "widened": widening.decoder.max_rows if widening else None}
        latest = sorted(stored, key=lambda k: str(stored[k].get("used", "")))[-MAX_KEPT:]
        cache_dir.write_json(store, {k: stored[k] for k in latest})
    return costs, measured


def _kept(entry, runner: ModelRunner) -> tuple[list[StepCost], str] | None:
    """A store entry's (costs, when measured), the runner's GGUF step widened as it was; None
    where there is none or it is of another format."""
    try:
        costs = [StepCost(int(r), int(t), int(c), float(s)) for r, t, c, s in entry["costs"]]
        widening = StepWidening.of(runner)
        if widening is not None:
            widening.decoder.max_rows = int(entry["widened"])
        return costs, str(entry["measured"])
    except (TypeError, KeyError, ValueError):
        return None


def least_of(kept: list[StepCost], again: list[StepCost]) -> list[StepCost]:
    """The kept costs, each at the least of its kept time and its time measured again
    (where it was), spikes cut (without_spikes)."""
    timed = {(c.rows, c.tokens, c.context): c.seconds for c in again}
    return without_spikes([dataclasses.replace(c, seconds=min(
        c.seconds, timed.get((c.rows, c.tokens, c.context), c.seconds))) for c in kept])


def costs_key(runner: ModelRunner, proposes: bool) -> str:
    """What costs measured for this runner hold for: the machine, the build (the runtime's
    source), the model's computation (its classes, configuration, parameter shapes and
    dtypes, block kinds) and the way they are measured."""
    model = runner.model
    config = getattr(model, "config", None)
    settings = {k: v for k, v in (config.to_dict() if config is not None else {}).items()
                if not k.startswith("_") and k != "transformers_version"}
    parameters = [(name, list(p.shape), str(p.dtype),
                   getattr(getattr(p, "_batchspec_gguf", None), "kind", None))
                  for name, p in model.named_parameters()]
    described = {"format": KEPT_FORMAT, "proposes": proposes, "machine": machine(runner),
                 "build": build_digest(), "model": type(model).__name__,
                 "lean": type(runner.lean_forward).__name__, "settings": settings,
                 "parameters": parameters, "features": runner.reads_features,
                 "grid": [CALIBRATION_ROWS, CALIBRATION_TOKENS, LONG_FORWARD_TOKENS,
                          CALIBRATION_BUDGET_S]}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()
                          ).hexdigest()[:32]


def machine(runner: ModelRunner) -> str:
    """The CPU model, torch version and threads, the CPU features the kernels choose by, and
    the device (a GPU by name)."""
    try:
        flags = next(line.split(":", 1)[1].split()
                     for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = []
    device = str(runner.device)
    if runner.device.type == "cuda":
        device += " " + torch.cuda.get_device_name(runner.device)
    return " | ".join([fastlinear.machine(), ",".join(f for f in CPU_FLAGS if f in flags),
                       device])


@functools.cache
def build_digest() -> str:
    """A digest of the runtime's source (Python and C++): a changed forward is measured
    again."""
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted([*root.glob("*.py"), *root.glob("csrc/*")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
