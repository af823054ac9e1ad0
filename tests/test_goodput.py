"""Draft length by goodput: the pure policy, and the engine switching K (0 included) per row
with exact output and a draft that catches up after a stretch without drafting."""
import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec import packing
from batchspec.runtime import runner as runner_lib
from batchspec_tools.bench.inprocess import InProcessDraft, InProcessTarget
from coordinator import goodput
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.scheduler import CohortPolicy

import tiny_models
from conftest import running_stack
from test_exactness import generate_all, random_requests


# ---- the pure policy ---------------------------------------------------------------------------
def cpu_like(verify_per_token: float, verify_per_row_token: float = 0.0,
             draft_fraction: float = 0.2,
             packs_positions: bool = False) -> tuple[goodput.ServiceCost, goodput.ServiceCost]:
    """Costs shaped like a CPU: a fixed part plus a part growing with rows x tokens."""
    grid = [(r, t) for r in (1, 2, 4, 8, 16, 32) for t in (1, 2, 3, 5, 8)]
    target = [(r, t, 0.03 + verify_per_token * t + verify_per_row_token * r * t)
              for r, t in grid]
    draft = [(r, t, s * draft_fraction) for r, t, s in target]
    return (goodput.ServiceCost(goodput.ForwardCosts(draft)),
            goodput.ServiceCost(goodput.ForwardCosts(target), packs_positions=packs_positions))


def policy(max_k=4, **costs) -> goodput.GoodputPolicy:
    draft, target = cpu_like(**costs)
    return goodput.GoodputPolicy(goodput.GoodputConfig(max_k=max_k), [draft], target)


def test_the_break_even_confidence_is_a_tokens_cost_over_its_worth_and_grows_with_the_batch():
    draft, target = cpu_like(verify_per_token=0.0, verify_per_row_token=0.002)

    def cut(rows, drafting, k):
        return goodput.break_even_confidence(target, draft, rows, drafting, k)

    # 8 rows, all drafting 2: a plain step 0.046 s (0.00575 a row's token); the verify adds
    # 0.032 s for 16 tokens, the second draft forward 0.0092 s for 8 rows
    assert cut(8, 8, 2) == pytest.approx((0.032 / 16 + 0.0092 / 8) * 8 / 0.046)
    assert cut(1, 1, 2) == pytest.approx((0.004 / 2 + 0.0064) / 0.032)
    assert cut(1, 1, 2) < 0.3 < cut(8, 8, 2) < cut(32, 32, 2) < 1.0
    assert cut(8, 0, 2) == 0.0  # nothing drafted
    draft, target = cpu_like(verify_per_token=0.0, verify_per_row_token=0.01)
    assert cut(32, 32, 2) == 1.0  # no draft pays there: every one is cut


def test_a_hosted_drafts_rounds_pay_the_commands_overhead_once():
    """A target whose command overhead is as large as its forward: plain decoding pays it
    once for 4 tokens (--plain-steps 4), a drafted command of a draft the target hosts once
    for 4 rounds. Hosted, a row drafts at acceptances where a draft of its own service's
    commands would not pay, and drafts fewer tokens where both pay (the overhead no longer
    rewards long drafts)."""
    def k(acceptance, hosted):
        draft, target = cpu_like(verify_per_token=0.002, draft_fraction=0.05)
        target.overhead_s = 0.03
        p = goodput.GoodputPolicy(goodput.GoodputConfig(max_k=4, plain_steps=4, rounds=4),
                                  [draft], target, frozenset({0}) if hosted else frozenset())
        return p.plan([goodput.Row(acceptance)]).k[0]

    assert [k(a, hosted=False) for a in (0.3, 0.5)] == [0, 0]
    assert k(0.3, hosted=True) > 0 and k(0.5, hosted=True) > 0
    assert 0 < k(0.6, hosted=True) < k(0.6, hosted=False) == 4


def test_expected_tokens_is_the_geometric_sum():
    assert goodput.expected_tokens(0.5, 0) == 1
    assert goodput.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert goodput.expected_tokens(1.0, 3) == 4


def test_a_kind_that_delivers_less_than_the_geometric_model_expects_is_discounted():
    draft, target = cpu_like(verify_per_token=0.002)
    config = goodput.GoodputConfig(max_k=4, delivered_decay=1.0)  # plain sums: no noise

    def after(outcomes):
        p = goodput.GoodputPolicy(config, [draft], target)
        stream = [a for a, times in outcomes.items() for _ in range(times)] * 8
        random.Random(0).shuffle(stream)
        for accepted in stream:
            p.observe(goodput.RowState(), 4, accepted)
        return p
    # per-token acceptance 0.6 over 4 drafts, as modelled (counts of 0..4 accepted per 625)
    geometric = after({0: 250, 1: 150, 2: 90, 3: 54, 4: 81})
    # about the same acceptance, all or nothing: the model expects more than comes
    all_or_nothing = after({0: 400, 4: 225})
    assert geometric.delivered(0) == pytest.approx(1.0, abs=0.05)
    assert all_or_nothing.delivered(0) < 0.9
    row = [goodput.Row(choices=(goodput.Option(0.8),))]
    fresh = goodput.GoodputPolicy(config, [draft], target)
    assert fresh.delivered(0) == 1.0  # no evidence yet: the model as it is
    # its gain is scaled down
    assert all_or_nothing._best_for(row, 4).tokens_per_s < fresh._best_for(row, 4).tokens_per_s


def test_forward_costs_interpolate_and_extend_the_grid():
    costs = goodput.ForwardCosts([(1, 1, 1.0), (4, 1, 4.0), (1, 3, 3.0), (4, 3, 12.0)])
    assert costs.predict(1, 1) == 1.0
    assert costs.predict(2, 1) == pytest.approx(2.0)
    assert costs.predict(2, 2) == pytest.approx(4.0)  # between (2, 1) = 2 and (2, 3) = 6
    assert costs.predict(8, 1) == pytest.approx(8.0)  # past the grid: the last slope
    assert costs.predict(1, 5) == pytest.approx(5.0)


def test_noisy_calibration_is_smoothed_to_never_cheaper_for_more_work():
    # one slow outlier at 3 tokens and one fast at 5 (as single timings on a busy CPU give)
    noisy = [(1, 1, 0.038), (1, 2, 0.041), (1, 3, 0.054), (1, 5, 0.050), (1, 8, 0.066),
             (2, 1, 0.036), (2, 2, 0.044), (2, 3, 0.060), (2, 5, 0.070), (2, 8, 0.090)]
    costs = goodput.ForwardCosts(noisy)
    for rows in (1, 2):
        by_tokens = [costs.predict(rows, t) for t in range(1, 9)]
        assert by_tokens == sorted(by_tokens)
    assert all(costs.predict(2, t) >= costs.predict(1, t) for t in range(1, 9))
    assert costs.predict(1, 3) < 0.054 and costs.predict(1, 5) > 0.050


def test_a_curved_calibration_keeps_its_shape():
    """At 32 rows on a CPU the first token is dear and later ones cheaper (the kernels speed
    up with more rows): a line through the grid would price a 2-token verify at 1.3 plain
    steps where it costs 1.85, and make drafting there look as if it paid."""
    measured = [(32, 1, 0.134), (32, 2, 0.248), (32, 3, 0.327), (32, 5, 0.441), (32, 8, 0.546)]
    costs = goodput.ForwardCosts(measured)
    for rows, tokens, seconds in measured:
        assert costs.predict(rows, tokens) == pytest.approx(seconds)
    draft = goodput.ForwardCosts([(32, t, 0.034 * t) for t in (1, 2, 8)])
    p = goodput.GoodputPolicy(goodput.GoodputConfig(), [goodput.ServiceCost(draft)],
                              goodput.ServiceCost(costs))
    new_kind = p.choice(goodput.RowState(), catch_up=1, kind=0)
    assert new_kind.explore and p.plan([goodput.Row(choices=(new_kind,))] * 32).k == [0] * 32


def test_live_timings_correct_the_calibration():
    cost = goodput.ServiceCost(goodput.ForwardCosts([(1, 1, 0.010), (1, 2, 0.012)]))
    for _ in range(60):  # the device turned out twice as slow, with 5 ms of RPC per command
        cost.observe([(1, 1)], forward_s=0.020, round_trip_s=0.025)
    assert cost.ratio == pytest.approx(2.0, rel=0.01)
    assert cost.predict([(1, 2)]) == pytest.approx(2 * 0.012 + 0.005, rel=0.02)


def test_a_calibration_taken_on_busy_cores_is_corrected_by_measuring_plain_steps():
    """The target timed only one row, five times too slow and steeper in tokens than it is
    (another process was loading on its cores). Live, at 8 rows, one token costs 65 ms and
    two 105 ms: drafting one token at acceptance 0.4 loses. The planner must measure the
    plain step it never chose, and then stop drafting."""
    busy = goodput.ForwardCosts([(1, 1, 0.152), (1, 2, 0.326), (1, 3, 0.37), (1, 5, 0.36)])
    draft = goodput.ForwardCosts([(r, t, 0.002) for r in (1, 8) for t in (1, 2)])
    p = goodput.GoodputPolicy(goodput.GoodputConfig(max_k=4),
                              [goodput.ServiceCost(draft)], goodput.ServiceCost(busy))
    live = {1: 0.065, 2: 0.105, 3: 0.125, 4: 0.135, 5: 0.145}  # seconds at 8 rows
    ks = []
    for _ in range(60):
        plan = p.plan([goodput.Row(0.4)] * 8)
        k = max(plan.k)
        ks.append(k)
        p.target.observe([(8, 1 + k)], forward_s=live[1 + k], round_trip_s=live[1 + k])
    # plain decoding from the second step on (its cost measured), but for a row exploring
    assert ks[1] == 0 and sum(k > 0 for k in ks[1:]) <= 2
    assert p.target.predict([(8, 1)]) == pytest.approx(0.065, rel=0.05)


def test_memory_bound_batch_one_drafts_and_compute_bound_large_batches_do_not():
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    one = p.plan([goodput.Row(0.65)])
    assert one.k[0] >= 1  # verifying a few tokens costs little more than one
    many = p.plan([goodput.Row(0.65)] * 32)
    assert many.k == [0] * 32  # every extra token costs its full price: plain decoding


def test_a_packed_verify_lets_the_few_rows_that_pay_draft_in_a_large_batch():
    """Where every extra verified token costs its full price, a verify padded to its widest
    row makes the whole batch pay for a few good rows: plain decoding. Where the target packs
    positions, those rows pay only for their own tokens, and they draft."""
    rows = [goodput.Row(0.95)] * 5 + [goodput.Row(0.05)] * 11
    costs = dict(verify_per_token=0.004, verify_per_row_token=0.0005, draft_fraction=0.01)
    padded = policy(**costs).plan(rows)
    assert padded.k == [0] * 16
    p = policy(**costs, packs_positions=True)
    packed = p.plan(rows)
    assert packed.k[:5] == [4] * 5 and packed.k[5:] == [0] * 11
    calls = p.target.verify_calls(16, 5, 4)
    assert calls == [(16, 5, 5)] and p.target.size(calls) == 5  # learns with other K = 4
    cost = p.target.predict
    assert cost([(16, 1)]) < cost(calls) < cost(p.target.verify_calls(16, 10, 4)) \
        < cost([(16, 5)])
    assert p.target.verify_calls(16, 0, 4) == [(16, 1)]  # nobody drafts: a plain step
    assert p.target.verify_calls(16, 16, 4) == [(16, 5)]  # everybody does: no padding


def test_a_verify_padded_too_little_to_be_packed_is_priced_at_full_width():
    """The target packs a verify only with at least packing.MIN_PADDING padded positions
    (batchspec.packing), and the plan prices what it runs: half of 8 rows drafting one token
    pay what all 8 would, so a plan that drafts any of them drafts every row that could
    accept; with four tokens the padding is worth skipping."""
    p = policy(max_k=1, verify_per_token=0.002, verify_per_row_token=0.0005,
               draft_fraction=0.01, packs_positions=True)
    assert 4 < packing.MIN_PADDING <= 8
    assert p.target.verify_calls(8, 4, 1) == [(8, 2)]  # 4 padded positions: run padded
    assert p.target.verify_calls(8, 1, 4) == [(8, 5, 1)]  # 28: packed
    assert p.target.verify_calls(16, 8, 1) == [(16, 2, 8)]  # 8: packed
    rows = [goodput.Row(0.9)] * 4 + [goodput.Row(0.3)] * 4
    assert p.plan(rows).k == [1] * 8


def test_no_row_is_planned_past_its_end():
    """A step commits at most a row's drafts and one more token: a row with n tokens left
    drafts at most n - 1 (none on its last token), and the plan prices what it may commit,
    not K drafts it cannot use."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    plan = p.plan([goodput.Row(0.9), goodput.Row(0.9, room=2), goodput.Row(0.9, room=0),
                   goodput.Row(0.9, room=3)])
    k = plan.k[0]
    assert k > 1 and plan.k == [k, min(k, 2), 0, min(k, 3)]
    assert [plan.kind(i) for i in range(4)] == [0, 0, None, 0]
    unbounded = p.plan([goodput.Row(0.9)] * 2)
    near_end = p.plan([goodput.Row(0.9, room=1)] * 2)
    assert near_end.k == [1, 1] and min(unbounded.k) > 1
    assert near_end.tokens_per_s < unbounded.tokens_per_s  # one draft a row priced, not K
    uncalibrated = goodput.GoodputPolicy(goodput.GoodputConfig(max_k=3), [], None)
    assert uncalibrated.plan([goodput.Row(0.1, room=r) for r in (None, 1, 0)]).k == [3, 1, 0]


def test_rows_of_one_group_get_different_k():
    p = policy(verify_per_token=0.002, verify_per_row_token=0.001)
    plan = p.plan([goodput.Row(0.9), goodput.Row(0.02), goodput.Row(0.85), goodput.Row(0.03)])
    assert plan.k[0] == plan.k[2] > 0
    assert plan.k[1] == plan.k[3] == 0  # the draft is not even run for them


def test_no_collapse_at_the_switching_threshold():
    """As acceptance rises across the point where drafting starts to pay, the planned goodput
    never falls below plain decoding's and never drops: the switch is continuous."""
    p = policy(verify_per_token=0.004, verify_per_row_token=0.002)
    plain = p._best_for([goodput.Row(0.5)] * 8, 0).tokens_per_s
    rates, ks = [], []
    for step in range(100):
        plan = p.plan([goodput.Row(step / 100)] * 8)
        rates.append(plan.tokens_per_s)
        ks.append(max(plan.k))
    assert min(rates) >= plain * (1 - 1e-9)
    assert all(b >= a - 1e-9 for a, b in zip(rates, rates[1:]))
    assert ks[0] == 0 and ks[-1] > 0  # it does switch, in this range


def test_a_long_catch_up_is_charged_spread_over_the_steps_it_serves():
    """A row idle for a while owes its draft the tokens it missed. That catch-up is paid
    once: charged whole to one step, a row that pays at a steady step's cost would stay plain
    the longer it idled, until it explores. Spread over cold_horizon steps, it resumes, unless
    the catch-up is so long that even its share loses."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    state = goodput.RowState()
    for _ in range(20):  # enough evidence over all rows: no row is forced to explore
        p.observe(goodput.RowState(), 2, 1)

    def row(catch_up):
        return goodput.Row(choices=(p.choice(state, catch_up, kind=0),))

    assert not row(1).choices[0].explore
    assert p.plan([row(1)]).k[0] > 0  # a steady row drafts
    assert p.plan([row(12)]).k[0] > 0  # and so does one twelve tokens behind
    steady = p._draft_s(0, 1, goodput.STEADY_WIDTH, 2)
    whole = p.drafts[0].predict(goodput.draft_calls(1, 12, 2))
    assert p._draft_s(0, 1, 12, 2) == pytest.approx(
        steady + (whole - steady) / p.config.cold_horizon)
    assert p._draft_s(0, 1, 1, 2) == pytest.approx(
        p.drafts[0].predict(goodput.draft_calls(1, 1, 2)))  # a steady step pays its own
    old = goodput.GoodputPolicy(goodput.GoodputConfig(cold_horizon=1), p.drafts, p.target)
    for _ in range(20):
        old.observe(goodput.RowState(), 2, 1)
    assert old.plan([goodput.Row(choices=(old.choice(state, 12, kind=0),))]).k[0] == 0  # whole
    assert p.plan([row(400)]).k[0] == 0  # too far behind even spread out


def test_a_kind_short_of_evidence_must_draft():
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    new_kind = p.choice(goodput.RowState(), catch_up=1, kind=0)
    assert new_kind.explore  # no evidence yet over all rows
    assert max(p.plan([goodput.Row(choices=(new_kind,))] * 2).k) >= 1


def test_a_kind_short_of_evidence_is_tried_by_a_few_rows_of_a_large_batch():
    """Evidence is bought with a few rows' drafts: forcing a new kind on every row of a large
    batch made a start-up step of 32 rows verify K = 4 for all of them (ten plain steps'
    time). The rows held and with least to catch up on explore; where drafting does not
    otherwise pay (acceptance at its prior here, wide verifies dear), the rest stay plain."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.0006, packs_positions=True)
    new_kind = p.choice(goodput.RowState(), catch_up=1, kind=0)
    assert new_kind.explore
    unforced = dataclasses.replace(new_kind, explore=False)
    assert p.plan([goodput.Row(choices=(unforced,))] * 32).k == [0] * 32  # it would not pay
    behind = dataclasses.replace(new_kind, catch_up=64)  # dear even spread over steps
    rows = [goodput.Row(choices=(behind,))] * 30 + [goodput.Row(choices=(new_kind,))] * 2
    plan = p.plan(rows)
    assert [i for i, k in enumerate(plan.k) if k] == [30, 31]
    assert p.config.explorers == 2
    unlimited = goodput.GoodputPolicy(goodput.GoodputConfig(explorers=32), p.drafts, p.target)
    assert min(unlimited.plan(rows).k) >= 1  # every row forced: the whole batch drafts
    # every row of a small cohort still explores when the limit allows it
    assert min(p.plan([goodput.Row(choices=(new_kind,))] * 2).k) >= 1


def test_evidence_is_not_bought_where_drafting_could_not_pay_at_all():
    """Where every extra verified token costs its full price (a large batch on a CPU),
    drafting loses even if every row accepted at the optimistic rate: a kind short of
    evidence, or starved of it, is not forced on such a group (nothing it could show would
    change a plan); the same kind is still forced on a small group, where it could pay."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    new_kind = p.choice(goodput.RowState(), catch_up=1, kind=0)
    assert new_kind.explore
    assert p.plan([goodput.Row(choices=(new_kind,))] * 32).k == [0] * 32
    for _ in range(p.config.starve_every):
        p.plan([goodput.Row(choices=(new_kind,))] * 32)
    starved = p.choice(goodput.RowState(idle_steps=100), catch_up=1, kind=0)
    assert starved.explore  # starved and short of evidence alike
    assert p.plan([goodput.Row(choices=(starved,))] * 32).k == [0] * 32
    assert max(p.plan([goodput.Row(choices=(starved,))] * 2).k) >= 1
    # a kind that could pay is still forced, even at a large batch
    cheap = policy(verify_per_token=0.004, verify_per_row_token=0.0001)
    assert max(cheap.plan([goodput.Row(choices=(new_kind,))] * 32).k) >= 1
    # but not a lookup with something to offer for 2 of the 32 rows: even perfect matches
    # there would not pay for widening all 32 rows' verify
    lookup = goodput.Option(new_kind.acceptance, explore=True, offered=4)
    few = [goodput.Row(choices=(lookup if i < 2 else None,)) for i in range(32)]
    assert cheap.plan(few).k == [0] * 32


def test_rows_idle_for_long_explore_together_and_never_one_widened_step_each():
    """Exploring one row widens the whole group's verify. A row idle for long is planned at
    an optimistic acceptance: alone among plain rows at a large batch it does not pay and
    waits; once enough rows are idle they draft together (one widened step for all)."""
    p = policy(verify_per_token=0.004, verify_per_row_token=0.001)
    verified(p, goodput.RowState(), 20, num_drafts=4, num_accepted=1)  # the kind drafts poorly
    poor = p.choice(goodput.RowState(rejected=5.0), catch_up=1, kind=0)
    # (a model draft would have 33 tokens to catch up on here, and that cost is priced: the
    # n-gram draft's catch-up is always one)
    idle = p.choice(goodput.RowState(rejected=5.0, idle_steps=32), catch_up=1, kind=0)
    assert not poor.explore and not idle.explore
    assert idle.acceptance == p.config.optimism > poor.acceptance
    assert max(p.plan([goodput.Row(choices=(idle,))] + [goodput.Row(choices=(poor,))] * 15).k) \
        == 0
    together = p.plan([goodput.Row(choices=(idle,))] * 16)
    assert min(together.k) >= 1  # all of them, in one step
    # at batch 1 a lone idle row is tried at once (a drafting step costs little there)
    assert max(p.plan([goodput.Row(choices=(idle,))]).k) >= 1


def verified(p, state, steps: int, num_drafts: int, num_accepted: int) -> float:
    """Feed `steps` identical verify outcomes; the acceptance estimate after them."""
    for _ in range(steps):
        p.observe(state, num_drafts=num_drafts, num_accepted=num_accepted)
    return p.acceptance(state)


def test_one_lucky_first_step_does_not_make_a_new_kind_look_perfect():
    """The running mean over all rows starts from the prior, weighed as min_evidence trials:
    one first step of two drafts, both accepted, once set it to 1.0, every row's estimate to
    0.99, and the next plan of a 28-row cohort drafted K = 4 for all of them (0.8 s against
    0.13 for a plain step, a third of its drafts accepted)."""
    p = policy(verify_per_token=0.002)
    verified(p, goodput.RowState(), 1, num_drafts=2, num_accepted=2)
    assert 0.6 < p.acceptance(goodput.RowState()) < 0.75
    verified(p, goodput.RowState(), 60, num_drafts=4, num_accepted=4)
    assert p.acceptance(goodput.RowState()) > 0.9  # evidence outweighs the prior


def test_acceptance_estimate_follows_the_evidence():
    p = policy(verify_per_token=0.002)
    state = goodput.RowState()
    high = verified(p, state, 30, num_drafts=4, num_accepted=4)
    assert high > 0.9 and verified(p, state, 30, num_drafts=4, num_accepted=0) < 0.3
    p.observe(state, num_drafts=0, num_accepted=0)
    assert state.idle_steps == 1


def test_without_calibration_every_row_drafts_k():
    p = goodput.GoodputPolicy(goodput.GoodputConfig(max_k=3), [], None)
    assert p.plan([goodput.Row(0.1)] * 3).k == [3, 3, 3]


# ---- the engine switching K --------------------------------------------------------------------
class Scripted(goodput.GoodputPolicy):
    """A policy whose K follows a script per engine step (same K for every row of a step, or
    alternating per row), to drive the engine through every kind of switch."""

    def __init__(self, script):
        super().__init__(goodput.GoodputConfig(max_k=4), [], None)
        self.script = script
        self.calls = 0

    def plan(self, rows):
        k = self.script(self.calls, len(rows))
        self.calls += 1
        return goodput.Plan(k, 0.0)


def stretches(step, batch):
    """Drafting, then 12 steps of K = 0, then per-row K (0 and 3 alternating), repeating."""
    phase = step % 30
    if phase < 8:
        return [4] * batch
    if phase < 20:
        return [0] * batch
    return [3 if (i + step) % 2 else 0 for i in range(batch)]


def engine_for(target_dir, draft_dir, script, batch_size, **config):
    from batchspec.runtime import models

    loaded = [models.load_causal_lm(d) for d in (target_dir, draft_dir)]
    eos = models.eos_token_ids(loaded[0])
    runners = [runner_lib.ModelRunner(m, name=d, device=torch.device("cpu"), eos_token_ids=eos,
                                      max_context_len=256)
               for m, d in zip(loaded, (target_dir, draft_dir))]
    engine = Engine(InProcessTarget(runners[0], "target"), [[InProcessDraft(runners[1], "draft")]],
                    EngineConfig(num_draft_tokens=4,
                                 cohort_policy=CohortPolicy(batch_size=batch_size),
                                 max_num_seqs=64, max_queue=64, **config),
                    eos, planner=Scripted(script))
    return engine, runners


def run_all(engine, requests, ignore_eos=False):
    handles = [engine.submit(p, m, ignore_eos=ignore_eos) for p, m in requests]
    while engine.pool.load():
        engine.step()
    out = []
    for handle in handles:
        tokens = []
        while not handle.events.empty():
            tokens += handle.events.get().token_ids
        out.append(tokens)
    return out, handles


class Recording(Scripted):
    """A scripted policy that keeps what it was told of each row's drafts."""

    def __init__(self, script):
        super().__init__(script)
        self.seen = []

    def observe(self, state, num_drafts, num_accepted, kind=0):
        self.seen.append((num_drafts, num_accepted))
        super().observe(state, num_drafts, num_accepted, kind)


@pytest.mark.parametrize("cut", [1.0, 1e-9])
def test_drafts_a_confidence_cut_declines_are_not_rejections(model_dirs, cut):
    """The target drafting for itself: every draft would be accepted. Cut to nothing (no
    probability reaches 1.0), the policy is told of no drafts at all, not of a rejection;
    barely cut, of drafts all accepted. Outputs exact either way."""
    target_dir, _ = model_dirs["llama"]
    recording = Recording(lambda step, batch: [3] * batch)
    engine, _ = engine_for(target_dir, target_dir, None, batch_size=2,
                           min_draft_confidence=cut)
    engine.policy.planner = recording
    drafted = run_self_drafted(engine, target_dir, seed=3, count=2, max_new=12)
    if cut == 1.0:
        assert drafted == 0 and set(recording.seen) == {(0, 0)}
    else:
        assert drafted > 0 and all(n == a > 0 for n, a in recording.seen)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_switching_k_per_row_and_step_stays_exact(model_dirs, arch):
    target_dir, draft_dir = model_dirs[arch]
    requests = random_requests(seed=41, count=12)
    engine, _ = engine_for(target_dir, draft_dir, stretches, batch_size=4)
    outputs, handles = run_all(engine, requests)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), tokens in zip(requests, outputs):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
    assert engine.stats.num_plain_steps > 0
    assert sum(h.seq.stats.num_drafted_tokens for h in handles) > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_acceptance_recovers_after_a_stretch_without_drafting(model_dirs, arch):
    """With the target as its own draft every draft must be accepted: a draft that missed the
    tokens committed while K was 0 (stale state) would be rejected after each stretch."""
    target_dir, _ = model_dirs[arch]
    engine, _ = engine_for(target_dir, target_dir, stretches, batch_size=3)
    drafted = run_self_drafted(engine, target_dir, seed=5, count=6, max_new=90)
    assert engine.stats.num_plain_steps >= 12 and drafted > 100


def run_self_drafted(engine, target_dir, seed: int, count: int, max_new: int) -> int:
    """Run random requests through an engine whose draft is the target itself: every output
    exact and every draft accepted. Returns the drafts verified."""
    rng = random.Random(seed)
    requests = [([rng.randrange(4, tiny_models.VOCAB) for _ in range(rng.randint(2, 12))],
                 max_new) for _ in range(count)]
    outputs, handles = run_all(engine, requests, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), tokens in zip(requests, outputs):
        assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, max_new)
    drafted = sum(h.seq.stats.num_drafted_tokens for h in handles)
    assert sum(h.seq.stats.num_accepted_tokens for h in handles) == drafted
    return drafted


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_draft_is_prefilled_only_when_a_step_first_gives_it_the_row(model_dirs, arch):
    """Plain decoding never prefills the draft; the first drafting step prefills it from the
    committed record (prompt and output so far), and with the target as its own draft every
    draft is then accepted (a wrong prefill would be rejected)."""
    target_dir, _ = model_dirs[arch]
    held = []  # sequences the draft holds when each step is planned

    def late(step, batch):
        held.append(len(runners[1].caches))
        return [0] * batch if step < 4 else [3 if i % 2 else 0 for i in range(batch)]

    # (its plain steps decode up to four tokens a row a command: the draft catches up on all)
    engine, runners = engine_for(target_dir, target_dir, late, batch_size=4)
    assert run_self_drafted(engine, target_dir, seed=9, count=4, max_new=40) > 0
    assert held[:5] == [0] * 5 and held[5] == 2  # then only the two rows that drafted
    assert not runners[1].caches  # released when they finished


def test_one_cold_row_explores_a_kind_starved_of_evidence():
    p = policy(verify_per_token=0.002, verify_per_row_token=0.001)
    idle = goodput.RowState(idle_steps=100)
    verified(p, goodput.RowState(), 1, num_drafts=4, num_accepted=0)  # one rejection
    first = p.choice(idle, catch_up=40, kind=0, cold=True, prefill=200)
    assert first.explore and first.cold and first.catch_up == 1  # too little evidence yet
    plan = p.plan([goodput.Row(choices=(first,))] * 16)
    assert sum(k > 0 for k in plan.k) == 1  # one prefill buys the evidence, not sixteen
    verified(p, goodput.RowState(), 10, num_drafts=4, num_accepted=0)  # it drafts badly
    # a row it holds, idle for long: optimistic, not forced
    held = p.choice(idle, catch_up=40, kind=0)
    assert held.acceptance == p.config.optimism and not held.explore
    cold = p.choice(idle, catch_up=40, kind=0, cold=True)
    assert not cold.explore and max(p.plan([goodput.Row(choices=(cold,))] * 16).k) == 0
    for _ in range(p.config.starve_every - 2):  # with the plan above: one short of starving
        p.plan([goodput.Row(choices=(cold,))] * 16)
    assert not p.choice(idle, catch_up=40, kind=0, cold=True).explore
    p.plan([goodput.Row(choices=(cold,))] * 16)
    starved = p.choice(idle, catch_up=40, kind=0, cold=True, prefill=200)
    assert starved.explore  # no row drafted with it for starve_every plans
    assert p.choice(idle, catch_up=40, kind=0).explore  # rows it holds, idle, are forced too
    assert not p.choice(goodput.RowState(), catch_up=1, kind=0).explore  # not a fresh row
    assert sum(k > 0 for k in p.plan([goodput.Row(choices=(starved,))] * 16).k) == 1


def test_cold_rows_join_a_widened_verify_only_for_the_price_of_their_prefill():
    """One row exploring widens a 32-row verify; the 31 rows the draft holds nothing of must
    not all be prefilled to ride along (a 2-core CPU spent a second there, near the end of
    the answers), unless they would pay for their prefill."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.0002)
    explorer = goodput.Row(choices=(goodput.Option(0.45, explore=True),))

    def drafting(acceptance, prefill):
        cold = goodput.Row(choices=(goodput.Option(acceptance, cold=True, prefill=prefill),))
        return sum(k > 0 for k in p.plan([explorer] + [cold] * 31).k)
    assert drafting(0.45, prefill=0) == 32  # were prefills free, all would join
    assert drafting(0.45, prefill=200) == 1  # the explorer alone
    assert drafting(0.95, prefill=200) == 32  # rows that pay for it still join


def test_cold_rows_of_a_plan_of_their_own_are_charged_their_prefill():
    """Cold rows nobody forces are charged their prefill too (spread over cold_horizon
    steps): a cohort back from a stretch aside, mostly new to the draft, drafts only the
    rows that pay for it; a lone row with a good draft still starts drafting."""
    p = policy(verify_per_token=0.002, verify_per_row_token=0.0002)

    def drafting(acceptance, prefill, rows=32):
        cold = goodput.Row(choices=(goodput.Option(acceptance, cold=True, prefill=prefill),))
        return sum(k > 0 for k in p.plan([cold] * rows).k)
    assert drafting(0.6, prefill=0) == 32  # were prefills free, every row would draft
    assert drafting(0.6, prefill=200) == 0
    assert drafting(0.8, prefill=200, rows=1) == 1
    assert drafting(0.5, prefill=200, rows=1) == 0  # would not pay back its prefill


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_goodput_policy_over_grpc_is_exact(model_dirs, arch):
    """The default policy, with the costs the services measured at start-up."""
    target_dir, draft_dir = model_dirs[arch]
    requests = random_requests(seed=17, count=24)
    with running_stack(target_dir, draft_dir, batch_size=8, num_draft_tokens=4,
                       draft_policy="goodput") as stack:
        results = generate_all(stack.stub(), requests)
        assert stack.router.engines[0].policy.planner.calibrated
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), (tokens, _) in zip(requests, results):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)


def test_a_row_turned_off_drifts_back_to_the_running_mean():
    p = policy(verify_per_token=0.002)
    verified(p, goodput.RowState(), 50, num_drafts=4, num_accepted=3)  # other rows: ~0.75
    state = goodput.RowState()
    low = verified(p, state, 5, num_drafts=2, num_accepted=0)
    assert low < 0.4 < verified(p, state, 20, num_drafts=0, num_accepted=0)


# ---- the pipeline: drafting the next cohort while the target verifies --------------------------
class FlakyDraft(InProcessDraft):
    """Runs every proposal, but the answers of some never arrive (the service lost while the
    proposal was in flight): its caches moved on while the coordinator's record did not."""

    def __init__(self, runner, lose_at):
        super().__init__(runner, "flaky draft")
        self.calls, self.lose_at = 0, set(lose_at)

    def propose(self, *args, **kwargs):
        self.calls += 1
        result = super().propose(*args, **kwargs)
        if self.calls in self.lose_at:
            from batchspec import errors
            raise errors.Unavailable("stream broke")
        return result


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_overlapped_pipeline_survives_a_draft_lost_mid_proposal(model_dirs, arch):
    target_dir, draft_dir = model_dirs[arch]
    engine, runners = engine_for(target_dir, draft_dir, lambda step, batch: [3] * batch,
                                 batch_size=2, overlap="on", reconnect_backoff_s=(0.0, 0.0))
    engine.peers.kinds[0].replicas = [FlakyDraft(runners[1], lose_at={4, 9, 15})]
    requests = random_requests(seed=23, count=10)
    outputs, handles = run_all(engine, requests)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    for (prompt, max_new), tokens in zip(requests, outputs):
        assert tokens == tiny_models.reference_greedy(model, prompt, max_new)
    assert engine.peers.kinds[0].client.calls > 15  # lost three times, back each time
    assert engine.stats.num_overlapped_steps > 10
    assert engine.stats.num_draft_fallback_steps > 0
    assert not runners[0].caches and not runners[1].caches


def test_overlap_auto_is_off_when_both_services_share_the_cpu(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    engine, _ = engine_for(target_dir, draft_dir, lambda step, batch: [1] * batch, batch_size=1)
    engine.configure()
    assert engine.config.overlap == "auto" and not engine.verifier.overlapping()
    gpu = dataclasses.replace(engine.peers.target.describe(), device="cuda:0")
    engine.peers.target.describe = lambda timeout=0.0: gpu
    engine.configure()
    assert engine.verifier.overlapping()


def test_a_calibration_wrong_in_its_slope_is_corrected_per_command_size():
    """Verifying 3 tokens turns out to cost twice what start-up measured, 1 token as measured:
    after a few steps of each, K = 2 is no longer taken for cheap."""
    cost = goodput.ServiceCost(goodput.ForwardCosts([(8, 1, 0.05), (8, 3, 0.06)]))
    for _ in range(40):
        cost.observe([(8, 1)], forward_s=0.05, round_trip_s=0.05)
        cost.observe([(8, 3)], forward_s=0.12, round_trip_s=0.12)
    assert cost.predict([(8, 1)]) == pytest.approx(0.05, rel=0.05)
    assert cost.predict([(8, 3)]) == pytest.approx(0.12, rel=0.05)


@pytest.mark.parametrize("bad", [{"max_k": 0}, {"explore_every": 0}, {"starve_every": 0},
                                 {"explorers": 0},
                                 {"measure_plain_every": 0}, {"optimism": 1.0},
                                 {"optimism": -0.1}, {"decay": 0.0}, {"prior_weight": 0.0},
                                 {"margin": -0.1}, {"explore_margin": -0.1}])
def test_a_goodput_config_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        goodput.GoodputConfig(**bad)


def test_acceptance_is_pooled_per_sampling_band():
    """Each row starts from its kind's running mean over rows of its sampling band: a draft
    that greedy rows accept says little of what rows sampling at temperature 1 accept."""
    from batchspec.params import SamplingParams

    bands = [goodput.sampling_band(SamplingParams(temperature=t)) for t in (0, 0.3, 0.7, 1.0)]
    assert bands == [0, 1, 2, 3]
    p = policy(verify_per_token=0.002, verify_per_row_token=0.004)
    greedy, hot = goodput.RowState(band=0), goodput.RowState(band=3)
    for _ in range(40):
        p.observe(greedy, 4, 4)  # greedy rows accept every draft
        p.observe(hot, 4, 0)  # hot sampled rows none
    fresh_greedy, fresh_hot = goodput.RowState(band=0), goodput.RowState(band=3)
    assert p.acceptance(fresh_greedy) > 0.8 and p.acceptance(fresh_hot) < 0.2
    assert p.acceptance(goodput.RowState(band=2)) == p.config.prior_acceptance  # no evidence


def test_plain_decoding_is_priced_at_its_steps_a_command():
    """Where a command that drafts nothing decodes several tokens a row (--plain-steps), its
    overhead is paid once for them: plain decoding is priced so, and a draft that beats one
    token a command but not several is not planned, nor are its tokens kept below what a
    plain token then costs (the break-even confidence)."""
    def target():
        cost = goodput.ServiceCost(goodput.ForwardCosts(
            [(1, 1, 0.005), (1, 2, 0.0055), (1, 5, 0.008)]))
        cost.observe([(1, 1)], 0.005, 0.008)  # 3 ms a command beside its forward
        return cost

    lookup = goodput.ServiceCost(goodput.ForwardCosts([(1, 1, 1e-5), (1, 5, 1e-5)]))
    row = goodput.Row(choices=(goodput.Option(0.45, offered=1),))
    plans = {steps: goodput.GoodputPolicy(goodput.GoodputConfig(max_k=4, plain_steps=steps),
                                          [lookup], target()).plan([row]).k
             for steps in (1, 4)}
    assert plans == {1: [1], 4: [0]}
    one, four = (goodput.break_even_confidence(target(), lookup, 1, 1, 1, steps)
                 for steps in (1, 4))
    assert 0 < one < four
