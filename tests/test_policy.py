"""The drafting policy alone: one plan per step from a cohort's rows, no service involved."""
import types

import pytest

from coordinator import evidence as evidence_lib
from coordinator.policy import CohortRow, DraftingConfig, DraftingPolicy

GRID = [(r, t) for r in (1, 8) for t in (1, 2, 5)]


def info(seconds: float, calibrated: bool = False):
    """A service's ModelInfo as the policy reads it: what its forwards cost (`seconds` for
    one position, a tenth of that for each further one)."""
    return types.SimpleNamespace(
        step_costs=[(r, t, seconds * (0.9 + 0.1 * r * t)) for r, t in GRID],
        packs_positions=False, calibrated=calibrated)


def policy(evidence=None) -> DraftingPolicy:
    """Kind 0 a model draft at a fifth of the target's cost, kind 1 a lookup at next to
    nothing."""
    made = DraftingPolicy(DraftingConfig(4, "goodput", None), 2, evidence=evidence)
    made.calibrate(info(0.05), [info(0.01), info(0.0001)])
    return made


def row(seq_id: int, catch_up=(1, 1), band: int = 0) -> CohortRow:
    return CohortRow(seq_id, band, catch_up, cold=(False, False), prefill=8)


class Asked:
    """An `ask` that records the kinds asked and offers `offers` ({row: tokens})."""

    def __init__(self, offers):
        self.offers, self.kinds = offers, []

    def __call__(self, kind):
        self.kinds.append(kind)
        return dict(self.offers)


def test_the_lookup_is_asked_first_and_drafts_only_what_it_offered():
    p = policy()
    ask = Asked({0: 3})
    plan = p.plan([row(1), row(2)], ask)
    assert ask.kinds == [1] and plan.asked_first == (1,) and not plan.aside
    assert plan.kind(1) != 1  # offered nothing: the lookup cannot draft for row 1


def test_a_kind_that_cannot_draft_for_a_row_is_never_planned_for_it():
    p = policy()
    for _ in range(20):
        plan = p.plan([row(1, catch_up=(None, None)), row(2, catch_up=(1, None))],
                      Asked({}))
        assert plan.kind(0) is None and plan.kind(1) in (0, None) and plan.k[0] == 0


def test_a_cohort_the_evidence_steps_aside_asks_no_draft():
    class Aside:
        def choose(self, rows, sampled=False):
            assert sampled  # a row of band 2 makes the cohort a sampled one
            return evidence_lib.Decision.PLAIN

        def room(self, rows, sampled=False):
            return 5 if sampled and rows == 2 else 1

    ask = Asked({0: 3})
    plan = policy(Aside()).plan([row(1), row(2, band=2)], ask)
    assert plan.aside and plan.k == (0, 0) and ask.kinds == []
    assert plan.room == 5  # its command may decode what the evidence lets before its probe


class AsideWithLookups:
    """Evidence that steps every cohort aside; cohorts of at most two rows draft lookups."""

    def __init__(self):
        self.observed = []

    def choose(self, rows, sampled=False):
        return evidence_lib.Decision.PLAIN

    def room(self, rows, sampled=False):
        return 3

    def lookups_aside(self, rows):
        return rows <= 2

    def observe(self, rows, drafted, tokens, seconds, carried, sampled, steps, weighed):
        self.observed.append((drafted, steps, weighed))


def test_a_small_cohort_aside_drafts_only_what_its_lookups_offer():
    """Aside, no model draft is planned; a cohort of one or two rows still drafts what the
    lookup offers, a larger one asks nothing. Its step is weighed on neither side and counts
    as plain steps for the drafts' catch-up."""
    p = DraftingPolicy(DraftingConfig(4, "goodput", None), 2, evidence=AsideWithLookups())
    p.calibrate(info(0.05), [info(0.01), info(0.0001)], lookups=frozenset({1}))
    ask = Asked({0: 4})
    plan = p.plan([row(1), row(2)], ask)
    assert ask.kinds == [1] and plan.aside_lookups and not plan.aside and plan.room == 3
    assert plan.kinds == (1, None) and plan.k[0] > 0 and plan.k[1] == 0
    ask = Asked({})  # offered nothing: the cohort decodes plainly
    plan = p.plan([row(1), row(2)], ask)
    assert ask.kinds == [1] and plan.aside and plan.k == (0, 0) and plan.kinds == (None, None)
    ask = Asked({0: 4})
    plan = p.plan([row(1), row(2), row(3)], ask)
    assert ask.kinds == [] and plan.aside and plan.k == (0, 0, 0)
    p.observe_step((1, 2), True, True, False, 9, 0.1, 0.0, steps=5, aside_lookups=True)
    assert p.evidence.observed == [(False, 5, False)]
    # the row's lookup evidence is weighed; the model's, kept from it by the evidence, stays
    model = p._states(1, 0)[0]
    p.observe_row(1, 0, 1, (4, 4), fade_others=False)
    assert model.idle_steps == 0 and p._states(1, 0)[1].accepted == 4
    p.observe_row(1, 0, 1, (4, 4))  # planned: the model was idle
    assert model.idle_steps == 1


def test_what_a_row_accepted_moves_its_plan_and_is_forgotten_with_it():
    p = policy()
    for _ in range(30):  # kind 0 accepted every draft of row 1, none of row 2's
        p.observe_row(1, 0, 0, (4, 4))
        p.observe_row(2, 0, 0, (4, 0))
    assert p.acceptance_state(1, 0).accepted > 10 and p.acceptance_state(2, 0).accepted == 0
    assert p.acceptance_state(1, 1).idle_steps == 30  # the kind not asked: its evidence fades
    plan = p.plan([row(1, catch_up=(1, None)), row(2, catch_up=(1, None))], Asked({}))
    assert plan.k[0] > 0 and plan.kind(0) == 0 and plan.k[1] == 0
    p.forget([1, 2])
    assert p.acceptance_state(1, 0) is None and p.acceptance_state(2, 0) is None


def test_without_measured_costs_every_row_drafts_k():
    p = DraftingPolicy(DraftingConfig(3, "fixed", None), 1)
    p.calibrate(info(0.05), [info(0.01)])
    plan = p.plan([row(1, catch_up=(1,)), row(2, catch_up=(1,))], Asked({}))
    assert plan.k == (3, 3) and plan.kinds == (0, 0) and plan.asked_first == ()


def test_a_row_falls_back_to_its_next_kind_only_where_that_costs_nothing_more():
    """Without measured costs a row whose kind proposes nothing drafts with its next best;
    with them, only with what a lookup asked first offered it (paid for already)."""
    fixed = DraftingPolicy(DraftingConfig(3, "fixed", None), 2)
    fixed.calibrate(info(0.05), [info(0.01), info(0.01)])
    plan = fixed.plan([row(1)], Asked({}))
    assert plan.kind(0) is not None and plan.fallback == (1 - plan.kind(0),)
    measured = policy()
    for _ in range(30):  # the model draft accepts every draft of row 1, the lookup none
        measured.observe_row(1, 0, 0, (4, 4))
        measured.observe_row(1, 0, 1, (4, 0))
    offered = measured.plan([row(1)], Asked({0: 2}))
    assert offered.kind(0) == 0 and offered.fallback == (1,)
    nothing = measured.plan([row(1)], Asked({}))
    assert nothing.kind(0) == 0 and nothing.fallback == (None,)


def test_a_command_of_plain_steps_is_priced_as_one_of_its_forwards_beside_its_overhead():
    """Four plain steps in one command of 50 ms, 40 ms of it forwards: the target's model
    learns a plain forward of 10 ms and a command's overhead of 10 ms, and a plain forward
    is measured (not stale), so the planner does not spend its next step measuring one."""
    from coordinator.clients import Timing
    from coordinator.drafting import DraftedCohort, Drafter, RowDraft
    from coordinator.sequence import Sequence

    p = policy()
    target = p.planner.target
    target.observe([(2, 5)], 0.05, 0.06)  # live timings flow: a plain forward is now stale
    assert target.stale(1, 1)
    rows = [RowDraft(Sequence(i, [1, 2, 3], 8, frozenset())) for i in range(2)]
    Drafter(None, p, None).observe_verify(DraftedCohort(rows), Timing(0.045, 0.0, 0.04), 0.05,
                                          plain_steps=4)
    assert not target.stale(1, 1)
    assert target.shapes[((2, 1),)] * target._forward_s([(2, 1)]) == pytest.approx(0.01)
    assert target.overhead_s == pytest.approx(0.01)  # the whole command's, once


def test_a_lookup_is_asked_for_a_line_only_where_a_command_may_run_rounds():
    """With --draft-rounds R, a lookup's ask covers what R rounds of K drafts verify, the K a
    row drafts and its continuation; while a request waits (no command runs rounds), K."""
    from coordinator.drafting import Drafter

    config = DraftingConfig(num_draft_tokens=4, draft_policy="goodput",
                            min_draft_confidence=None, draft_rounds=3)
    waiting = []
    drafter = Drafter(None, DraftingPolicy(config, 1), None, quiet=lambda: not waiting)
    assert drafter._line(4) == 4 + 2 * 5 and drafter._line(2) == 2 + 2 * 3
    waiting.append("a request")
    assert drafter._line(4) == 4


def test_only_a_lookup_asked_first_drafts_a_line():
    """A model draft cheap enough to be asked before planning drafts K, never a line: its
    tokens carry the distributions they were drawn from, a line's continuation none. The
    lookup is asked for a line and its rows verify it in rounds."""
    from coordinator.clients import Proposal
    from coordinator.drafting import Drafter, _Step, take_offer
    from coordinator.drafts import DraftKind
    from coordinator.sequence import Sequence

    config = DraftingConfig(num_draft_tokens=4, draft_policy="goodput",
                            min_draft_confidence=None, draft_rounds=3)
    kinds = [DraftKind(0, []), DraftKind(1, [])]
    kinds[0].name, kinds[1].name = "a-small-model", "ngram"
    drafter = Drafter(types.SimpleNamespace(kinds=kinds), DraftingPolicy(config, 2), None)
    asked = []

    def propose(kind, step, rows, num_drafts, timeout):
        asked.append((kind.index, num_drafts))
        return {i: Proposal(step.seqs[i].seq_id, [7] * num_drafts, 0) for i in rows}

    drafter._propose = propose
    for index in (0, 1):
        step = _Step([Sequence(1, [1, 2, 3], 8, frozenset())])
        assert drafter._ask(step, index, None) == {0: 4}
        take_offer(step, 0, index, 4)
        assert step.drafted[0] == (index, 4) and step.result().rows[0].lined == bool(index)
    assert asked == [(0, 4), (1, 4 + 2 * 5)]
    assert not kinds[0].lookup and kinds[1].lookup
