"""The planned linear computes the same product as nn.Linear, for every row count and every
way the plan may choose (weight-major, the oneDNN-packed weight, the usual product)."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from batchspec.runtime import fastlinear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])
def test_weight_major_matches_linear(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(1, rows, 24)
    expected = linear(x)
    fastlinear.patch_linears(linear)
    got = linear(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # views downstream (as attention does) need a contiguous result
    got.view(1, rows, 4, 10)


def test_only_positions_computes_the_marked_positions_and_zeros_the_rest():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(3, 5, 24)
    expected = linear(x)
    fastlinear.patch_linears(linear)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False], [True] + [False] * 4])
    with torch.no_grad(), fastlinear.only_positions(valid):
        got = linear(x)
        last_two = linear(x[:, -2:])  # fewer columns: the last ones of `valid`
        other_batch = linear(x[:2])  # not the marked batch: every position
    bias = linear.bias.detach()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~valid], bias.expand(int((~valid).sum()), 40))  # zeros, plus bias
    torch.testing.assert_close(last_two[valid[:, -2:]], expected[:, -2:][valid[:, -2:]])
    assert torch.equal(last_two[~valid[:, -2:]], bias.expand(int((~valid[:, -2:]).sum()), 40))
    torch.testing.assert_close(other_batch, expected[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)  # outside: all


def test_patch_covers_every_linear_and_keeps_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3, bias=False))
    assert fastlinear.patch_linears(model) == 2
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


@pytest.mark.parametrize("rows", [*range(1, fastlinear.MAX_ROWS + 1), 17, 64])
def test_every_candidate_computes_the_same_product(rows):
    torch.manual_seed(rows)
    weight, flat = torch.randn(40, 24), torch.randn(rows, 24)
    expected = flat @ weight.T
    methods = fastlinear.candidates(rows)
    packing = fastlinear.packing_works(torch.float32)
    assert packing == torch.backends.mkldnn.is_available()  # the CPU wheels ship oneDNN
    assert methods[0] == fastlinear.USUAL and (methods[-1] == fastlinear.PACKED) == packing
    assert all(rows <= m <= fastlinear.MAX_ROWS for m in methods[1:len(methods) - packing])
    for method in methods:
        got = fastlinear._product(flat, weight, method)
        assert got.shape == (rows, 40) and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tune_times_big_models_and_gives_small_ones_the_default(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(24, 8),
                                torch.nn.Linear(8, 24))
    assert fastlinear.tune(model) == 0  # far below MIN_TIMED_BYTES: not worth timing
    assert fastlinear.plan(24, 8, torch.float32, 1) == fastlinear.DEFAULT_PLAN[0]
    monkeypatch.setattr(fastlinear, "MIN_TIMED_BYTES", 0)
    monkeypatch.setattr(fastlinear, "_PLANS", {})
    assert fastlinear.tune(model) == 2  # two distinct shapes, timed
    for out_features, in_features in [(24, 8), (8, 24)]:
        for rows in range(1, fastlinear.MAX_ROWS + 1):
            chosen = fastlinear.plan(out_features, in_features, torch.float32, rows)
            assert chosen in fastlinear.candidates(rows)
        for rows in (fastlinear.MAX_ROWS + 1, 500):  # past MAX_ROWS: one entry, no padding
            chosen = fastlinear.plan(out_features, in_features, torch.float32, rows)
            assert chosen in (fastlinear.USUAL, fastlinear.PACKED)
    assert fastlinear.DEFAULT_PLAN == tuple(
        max(2, rows) for rows in range(1, fastlinear.MAX_ROWS + 1)) + (fastlinear.USUAL,)


def test_plans_timed_once_are_read_back_from_the_store(monkeypatch, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(24, 8))
    store = tmp_path / "cache" / "plans.json"
    monkeypatch.setattr(fastlinear, "MIN_TIMED_BYTES", 0)
    monkeypatch.setattr(fastlinear, "_PLANS", {})
    assert fastlinear.tune(model, store) == 2  # timed, then written
    timed = dict(fastlinear._PLANS)
    assert len(json.loads(store.read_text())) == 2
    monkeypatch.setattr(fastlinear, "_PLANS", {})  # a new process on the same machine
    monkeypatch.setattr(fastlinear, "_timed_plan", lambda *key: pytest.fail(f"timed {key}"))
    assert fastlinear.tune(model, store) == 0
    assert fastlinear._PLANS == timed
    store.write_text("{not json")  # an unreadable store is timed again, and rewritten
    monkeypatch.setattr(fastlinear, "_PLANS", {})
    monkeypatch.setattr(fastlinear, "_timed_plan", lambda *key: fastlinear.DEFAULT_PLAN)
    assert fastlinear.tune(model, store) == 2
    assert len(json.loads(store.read_text())) == 2


class Clock:
    """A stand-in for `time` whose clock moves only by what the timed work says it took."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_a_slow_stretch_of_the_machine_does_not_pick_the_slower_kernel(monkeypatch):
    """Timed while the machine is busy for a while (another process loading its model), the
    faster method is still chosen: methods are timed in turns and judged by their least
    time, so none is judged on the slow stretch alone."""
    own = {fastlinear.USUAL: 1.0, 2: 1.2, 4: 1.5}  # the methods' own times
    clock, passes = Clock(), []

    def timed(flat, weights, method):
        passes.append(method)
        busy = len(passes) <= 6  # the first six passes run at a third of the speed
        clock.now += own[method] * (3.0 if busy else 1.0)

    monkeypatch.setattr(fastlinear, "time", clock)
    monkeypatch.setattr(fastlinear, "_pass", timed)
    monkeypatch.setattr(fastlinear, "_product", lambda flat, weight, method: None)
    monkeypatch.setattr(fastlinear, "candidates", lambda rows, dtype: list(own))
    weights = [torch.zeros(2, 2)]
    assert fastlinear._fastest(torch.zeros(1, 2), weights) == fastlinear.USUAL
    assert len(passes) == fastlinear.TIMING_TURNS * len(own)
    # every method had its turn first once in three turns: no order favours one
    firsts = passes[::len(own)]
    assert set(firsts[:len(own)]) == set(own)


TUNING_PROCESS = """
import json, pathlib, sys, time
import torch
from batchspec.runtime import fastlinear
fastlinear.MIN_TIMED_BYTES = 0
spans = []
def timed_plan(*key):
    spans.append(time.time())
    time.sleep(3.0)
    spans.append(time.time())
    return fastlinear.DEFAULT_PLAN
fastlinear._timed_plan = timed_plan
timed = fastlinear.tune(torch.nn.Sequential(torch.nn.Linear(8, 24)), pathlib.Path(sys.argv[1]))
print(json.dumps([timed, spans]))
"""


def test_processes_starting_together_time_one_after_another(tmp_path):
    """Two processes tuning the same model against one store at once (a target and its draft
    starting together): their timings never overlap, and the later one reads the plan the
    first stored instead of timing it."""
    store = pathlib.Path(tmp_path / "plans.json")
    children = [subprocess.Popen([sys.executable, "-c", TUNING_PROCESS, str(store)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    answers = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    assert sorted(timed for timed, _ in answers) == [0, 1]
    assert [spans for timed, spans in answers if not timed] == [[]]
    assert json.loads(store.read_text())  # what the first one timed


packing = pytest.mark.skipif(not fastlinear.packing_works(torch.float32),
                             reason="this torch build has no oneDNN")


@packing
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
def test_packed_plan_matches_linear_and_follows_the_weight(monkeypatch, rows):
    """With every entry of the plan PACKED, a patched linear still computes x @ W.T + b (3-d
    input, past MAX_ROWS too), and a weight changed in place is packed again."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(24, 40)
    monkeypatch.setattr(fastlinear, "_PLANS",
                        {(40, 24, torch.float32): (fastlinear.PACKED,) * len(
                            fastlinear.DEFAULT_PLAN)})
    x = torch.randn(1, rows, 24)
    with torch.inference_mode():
        expected = linear(x)
        fastlinear.patch_linears(linear)
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
        assert linear.weight._batchspec_packed is not None  # made once, kept with the weight
    with torch.no_grad():
        linear.weight.mul_(-2.0)
    with torch.inference_mode():
        got = linear(x)
    torch.testing.assert_close(got, x @ linear.weight.T + linear.bias, rtol=1e-5, atol=1e-5)


@packing
def test_packed_plan_gives_way_where_gradients_are_needed(monkeypatch):
    """The packed product has no backward: a product that needs gradients goes the usual way."""
    linear = torch.nn.Linear(24, 40)
    monkeypatch.setattr(fastlinear, "_PLANS",
                        {(40, 24, torch.float32): (fastlinear.PACKED,) * len(
                            fastlinear.DEFAULT_PLAN)})
    fastlinear.patch_linears(linear)
    x = torch.randn(3, 24, requires_grad=True)
    linear(x).sum().backward()
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(3, 24))
    assert linear.weight.grad is not None


def test_a_stored_plan_of_another_format_is_timed_again(monkeypatch, tmp_path):
    """Plans stored before the plan had its entry past MAX_ROWS are one entry short: timed anew
    and rewritten, never read as they are."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 24))
    store = tmp_path / "plans.json"
    monkeypatch.setattr(fastlinear, "MIN_TIMED_BYTES", 0)
    monkeypatch.setattr(fastlinear, "_PLANS", {})
    name = f"{fastlinear.machine()} | 24x8 torch.float32"
    store.write_text(json.dumps({name: [2] * fastlinear.MAX_ROWS}))
    assert fastlinear.tune(model, store) == 1
    assert len(json.loads(store.read_text())[name]) == fastlinear.MAX_ROWS + 1


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_feed_forwards_run_on_the_real_positions_only(family):
    """Inside only_positions a whole model gives every real position the logits it gives
    unpacked; its feed-forward blocks are gathered once, so their inner layers never see a
    padded position."""
    from batchspec.runtime import tiny

    model = getattr(tiny, family)(seed=0)
    ids = torch.randint(3, 50, (3, 5))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    fastlinear.patch_linears(model)
    assert fastlinear.patch_feed_forwards(model) == model.config.num_hidden_layers
    assert fastlinear.patch_feed_forwards(model) == 0  # once only
    valid = torch.tensor([[True] * 5, [True, True, False, False, False], [True] + [False] * 4])
    seen = []
    first = next(m for n, m in model.named_modules() if n.endswith("mlp"))
    inner = next(m for m in first.modules() if m is not first and hasattr(m, "weight"))
    inner.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    with torch.no_grad(), fastlinear.only_positions(valid):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-4, atol=1e-4)
    assert seen == [torch.Size([1, int(valid.sum()), model.config.hidden_size])]
    with torch.no_grad():  # outside: every position, as before
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
