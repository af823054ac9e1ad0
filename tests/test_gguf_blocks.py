"""Linear layers over GGUF blocks as stored (batchspec.runtime.gguf_blocks): the kernels against
the float product of the dequantized weights, and a GGUF target served with them against
transformers' float32 model of the same file."""
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec.runtime import calibration, fastlinear, gguf_blocks, models, tiny
from batchspec.v1 import generate_pb2

import tiny_models
from conftest import running_stack
from test_exactness import generate_all, random_requests
from test_fastlinear import Clock

# skipped only outside CI, where a machine may lack a C++ compiler; in CI the kernels must build
pytestmark = pytest.mark.skipif(not gguf_blocks.load() and not os.environ.get("CI"),
                                reason="no C++ compiler to build the GGUF kernels (the float32 "
                                       "path serves instead)")

KINDS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def random_blocks(kind: str, out_features: int, in_features: int, seed: int):
    """(blocks [out, bytes] uint8, their float32 weights as gguf-py dequantizes them)."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((out_features, in_features)) * rng.uniform(0.01, 3)
               + rng.uniform(-1, 1)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, KINDS[kind])
    dequantized = gguf.quants.dequantize(blocks, KINDS[kind]).reshape(out_features, in_features)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dequantized.copy())


# every instruction set this CPU runs: the scalar loop, AVX2 and AVX-512 where present
ISAS = gguf_blocks.ISAS[:gguf_blocks.ISAS.index(gguf_blocks.best_isa()) + 1]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 32), (5, 96), (13, 160), (64, 576), (7, 1568)])
def test_each_product_is_the_float_product_of_the_dequantized_weights(isa, kind, out_features,
                                                                      in_features):
    data, weights = random_blocks(kind, out_features, in_features, seed=out_features)
    blocks = gguf_blocks.Blocks(kind, data, in_features)
    assert torch.equal(blocks.dequantize(), weights)  # bit for bit, as loaded
    x = torch.randn(64, in_features)
    every = blocks.product_with(x, isa)
    reference = x.double() @ weights.double().T
    # float32 rounding of a sum in another order: bounded by the sum of absolute terms
    bound = 1e-5 * (x.double().abs() @ weights.double().abs().T) + 1e-30
    assert ((every.double() - reference).abs() <= bound).all()
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):  # a row's result never depends on the others
        assert torch.equal(blocks.product_with(x[:rows], isa), every[:rows])
    assert torch.equal(blocks.product_with(x[40:41], isa), every[40:41])
    if isa == gguf_blocks.best_isa():
        assert torch.equal(blocks.product(x), every)  # what a layer runs


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_joined_blocks_give_each_layer_its_own_outputs(kind):
    """One product over joined blocks (a layer's q, k and v) gives, side by side, exactly what
    each layer's own blocks give, at every row count; the layers' blocks become views of the
    joined ones (no memory added), and blocks of another kind are not joined."""
    sizes = (64, 32, 32)
    weights = []
    for seed, out_features in enumerate(sizes):
        data, dequantized = random_blocks(kind, out_features, 96, seed=seed)
        weights.append(dequantized)
        dequantized._batchspec_gguf = gguf_blocks.Blocks(kind, data, 96, max_rows=8 - seed)
    alone = [gguf_blocks.blocks_of(w) for w in weights]
    joined = gguf_blocks.join(weights)
    assert joined.max_rows == 6 and joined.data.shape[0] == sum(sizes)
    for weight in weights:
        assert gguf_blocks.blocks_of(weight).data.untyped_storage().data_ptr() == \
            joined.data.untyped_storage().data_ptr()
    for rows in range(1, 9):
        x = torch.randn(rows, 96)
        together = joined.product(x).split(sizes, dim=-1)
        for blocks, out in zip(alone, together):
            assert torch.equal(blocks.product(x), out)
    other = "q8_0" if kind == "q4_1" else "q4_1"
    data, dequantized = random_blocks(other, 32, 96, seed=9)
    dequantized._batchspec_gguf = gguf_blocks.Blocks(other, data, 96, max_rows=8)
    assert gguf_blocks.join([weights[0], dequantized]) is None
    assert gguf_blocks.join([weights[0], torch.zeros(32, 96)]) is None


def test_an_instruction_set_the_cpu_lacks_is_refused():
    data, _ = random_blocks("q4_1", 4, 64, seed=1)
    with pytest.raises(RuntimeError, match="not available"):
        gguf_blocks.Blocks("q4_1", data, 64).product_with(torch.randn(1, 64), "avx512") \
            if gguf_blocks.best_isa() != "avx512" else \
            torch.ops.batchspec_gguf.linear_with(torch.randn(1, 64), data, 64, True, 3)


def test_bad_blocks_are_refused_with_a_clear_error():
    data, _ = random_blocks("q4_1", 4, 64, seed=1)
    with pytest.raises(RuntimeError, match="in_features"):
        gguf_blocks.Blocks("q4_1", data, 96).product(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32"):
        gguf_blocks.Blocks("q4_1", data, 64).product(torch.randn(2, 64, dtype=torch.float64))


class TimedBlocks:
    """Blocks whose products only move the test's clock (see busy_machine)."""

    kind = "q4_1"

    def __init__(self, work):
        self.work = work

    def product(self, x):
        self.work(1.0)


def busy_machine(monkeypatch, busy_calls: int):
    """fastlinear's clock made to move by what the timed work takes, the first `busy_calls`
    products at a third of the speed (another process loading its model): returns work(s)."""
    clock, calls = Clock(), []

    def work(seconds):
        calls.append(seconds)
        clock.now += seconds * (3.0 if len(calls) <= busy_calls else 1.0)

    monkeypatch.setattr(fastlinear, "time", clock)
    return work


def test_a_busy_stretch_while_blocks_are_timed_does_not_keep_them_unused(monkeypatch):
    """Blocks twice as fast as the float32 weight keep every row count they are timed at,
    though the machine is busy for as long as their warm-up and three products take: a loss
    is timed again, in turns with the float32 products. (Judged by the first timings alone,
    every product of the blocks fell in the busy stretch: the layers kept float32, and the
    model's step left its one C++ call, for as long as the service ran.)"""
    work = busy_machine(monkeypatch, busy_calls=6)
    monkeypatch.setattr(fastlinear, "weight_major", lambda x, weight: work(2.0))
    monkeypatch.setattr(fastlinear, "tune", lambda *args, **kwargs: 0)
    monkeypatch.setattr(fastlinear, "MIN_TIMED_BYTES", 0)
    found = [(torch.nn.Linear(64, 8, bias=False), TimedBlocks(work))]
    assert [rows for _, _, rows in gguf_blocks._timed(found)] == [gguf_blocks.TIMED_ROWS[-1]]


def test_blocks_slower_than_the_float32_weight_are_not_used_past_that_row_count(monkeypatch):
    work = busy_machine(monkeypatch, busy_calls=0)
    # the float32 product gains on the blocks' with rows: 2.0 at one, 1.0 at two
    monkeypatch.setattr(fastlinear, "weight_major", lambda x, weight: work(2.0 / x.shape[0]))
    monkeypatch.setattr(fastlinear, "tune", lambda *args, **kwargs: 0)
    monkeypatch.setattr(fastlinear, "MIN_TIMED_BYTES", 0)
    found = [(torch.nn.Linear(64, 8, bias=False), TimedBlocks(work))]  # 1.0 at any rows
    assert [rows for _, _, rows in gguf_blocks._timed(found)] == [1]  # 2 rows: a tie


class Widening:
    """A decoder's step limit and the time a step takes at each (one call up to max_rows)."""

    shapes = ()

    def __init__(self, max_rows: int, one_call: list[float], lean: float):
        self.max_rows, self.one_call, self.lean = max_rows, list(one_call), lean

    def seconds(self) -> float:
        return self.one_call.pop(0) if self.max_rows >= 8 else self.lean


def test_a_busy_stretch_does_not_close_the_step_widening_for_good():
    """The step in one call is faster at 8 positions, but its first timing fell in a busy
    stretch: the loss is timed again and the step widens."""
    decoder = Widening(4, one_call=[3.0, 1.0], lean=2.0)
    widening = calibration.StepWidening(decoder)
    widening.weigh(8, decoder.seconds)
    assert decoder.max_rows == 8 and widening.open
    slower = Widening(4, one_call=[3.0, 2.5], lean=2.0)  # slower in both timings
    widening = calibration.StepWidening(slower)
    widening.weigh(8, slower.seconds)
    assert slower.max_rows == 4 and not widening.open
    widening.weigh(16, slower.seconds)  # closed: no wider step is tried
    assert slower.max_rows == 4


@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    return tiny.save_gguf(tmp_path_factory.mktemp("gguf"))


def test_a_gguf_model_at_its_stored_precision_multiplies_by_its_blocks(gguf_target):
    stored = models.load_causal_lm(gguf_target, dtype="auto")
    dequantized = models.load_causal_lm(gguf_target, dtype="float32")
    linears = [m for m in stored.modules() if isinstance(m, torch.nn.Linear)]
    assert all(gguf_blocks.blocks_of(m.weight) is not None for m in linears)
    assert not any(gguf_blocks.blocks_of(m.weight) is not None
                   for m in dequantized.modules() if isinstance(m, torch.nn.Linear))
    ids = torch.tensor([[5, 9, 17, 33, 8, 2, 71]])
    with torch.inference_mode():
        a, b = stored(ids).logits, dequantized(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    read, floats = gguf_blocks.weight_bytes(stored)
    assert 0 < read < floats / 4  # what a step reads: the blocks, not float32 weights


@pytest.mark.slow
@pytest.mark.parametrize("batch_size,num_draft_tokens", [(1, 3), (8, 4)])
def test_a_gguf_target_is_served_token_for_token_as_transformers_decodes_it(
        gguf_target, model_dirs, batch_size, num_draft_tokens):
    """Served at its stored precision (the kernels up to 16 rows, float32 past them: a verify
    of 8 rows of 5 tokens takes both), greedy output equals transformers' float32 model of
    the same file at batch 1."""
    import pathlib

    path = pathlib.Path(gguf_target)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    requests = random_requests(seed=batch_size + 100, count=16)
    with running_stack(gguf_target, model_dirs["llama"][1], batch_size=batch_size,
                       num_draft_tokens=num_draft_tokens, target_dtype="auto",
                       drafts=("ngram", "model")) as stack:
        layer = stack.target_runner.model.model.layers[0].mlp.up_proj
        assert gguf_blocks.blocks_of(layer.weight) is not None
        assert fastlinear.patched(stack.target_runner.model)
        results = generate_all(stack.stub(), requests)
    for (prompt, max_new), (tokens, last) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(reference, prompt, max_new)
    finishes = {last.finish_reason for _, last in results}
    assert generate_pb2.FINISH_REASON_LENGTH in finishes


def test_a_draft_quantized_at_load_multiplies_by_blocks_that_hold_its_weights():
    """gguf_blocks.quantize_q8_0 (a draft served with --dtype auto on a CPU): every bias-free
    linear layer gets Q8_0 blocks, its weight becomes exactly what they hold, within half a
    quantization step of what it was, and the model's logits through the blocks are those of
    its float32 weights up to summation order."""
    model = tiny.llama(seed=5).eval()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear)}
    ids = torch.tensor([[3, 9, 27, 4]])
    assert gguf_blocks.quantize_q8_0(model) == len(before)
    for name, module in model.named_modules():
        if name in before:
            blocks = gguf_blocks.blocks_of(module.weight)
            assert torch.equal(blocks.dequantize(), module.weight)
            step = before[name].abs().reshape(-1, 32).amax(-1) / 127
            assert ((module.weight - before[name]).abs().reshape(-1, 32)
                    <= step[:, None] * 0.6 + 1e-6).all()  # half a step, d in float16
    fastlinear.patch_linears(model)
    with torch.inference_mode():
        quantized = model(ids).logits
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                del module.weight._batchspec_gguf
        floats = model(ids).logits
    assert torch.allclose(quantized, floats, atol=1e-4)
