"""The step-aside evidence (coordinator/evidence.py), fed hand-made step timings: it steps aside
where drafted steps measure slower than plain ones, comes back where they measure faster, keeps
both sides measured, does not flip on noise within its margin, and compares adjacent steps, so
a machine whose speed drifts does not decide for it."""
import random

import pytest

from coordinator.evidence import Bucket, Decision, Evidence, EvidenceConfig, bucket_of
from coordinator.policy import DraftingConfig

CONFIG = DraftingConfig(num_draft_tokens=4, draft_policy="goodput", min_draft_confidence=None)


def run(evidence: Evidence, rows: int, steps: int, drafted_rate: float, plain_rate: float,
        noise=lambda i: 1.0) -> list[Decision]:
    """Drive `steps` steps: each choice is followed by a step that measured the given rate
    (tokens per second) for its side."""
    choices = []
    for i in range(steps):
        choice = evidence.choose(rows)
        choices.append(choice)
        rate = (drafted_rate if choice is Decision.PLAN else plain_rate) * noise(i)
        evidence.observe(rows, choice is Decision.PLAN, tokens=rows, seconds=rows / rate)
    return choices


def test_buckets_group_batch_sizes_by_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_it_measures_the_plain_yardstick_first_then_plans():
    evidence = Evidence()
    choices = run(evidence, 8, 40, drafted_rate=150.0, plain_rate=100.0)
    assert choices[:6] == [Decision.PLAIN] * 6  # min_steps plain steps before any drafting
    assert choices[6] is Decision.PLAN
    assert choices[-12:].count(Decision.PLAN) >= 10  # drafting pays: it keeps planning
    assert evidence.ratio(8) == pytest.approx(1.5)
    # another bucket starts from its own yardstick
    assert [evidence.choose(32) for _ in range(3)] == [Decision.PLAIN] * 3


def test_where_drafting_loses_at_start_up_few_drafted_steps_are_paid():
    """A new bucket where drafting clearly loses pays for four drafted steps (after the
    yardstick, a warm-up that catches the draft up, weighed on neither side; then steps
    alternate, and three pairs decide), not for a stretch of the plan's guesses while plain
    evidence trickles in."""
    evidence = Evidence()
    choices = run(evidence, 32, 40, drafted_rate=50.0, plain_rate=100.0)  # no probe yet
    plain, plan = Decision.PLAIN, Decision.PLAN
    assert choices[:12] == [plain] * 6 + [plan, plan, plain, plan, plain, plan]
    assert choices.count(Decision.PLAN) == 4
    assert evidence.buckets[bucket_of(32)].aside


def test_where_drafting_measures_slower_it_steps_aside_and_keeps_probing():
    evidence = Evidence()
    choices = run(evidence, 8, 200, drafted_rate=80.0, plain_rate=100.0)
    late = choices[100:]
    assert late.count(Decision.PLAIN) > 0.85 * len(late)  # aside
    assert Decision.PLAN in late  # drafting is still tried now and then
    assert evidence.ratio(8) == pytest.approx(0.8)


def test_it_comes_back_when_drafting_measures_faster_again():
    evidence = Evidence()
    run(evidence, 8, 100, drafted_rate=80.0, plain_rate=100.0)
    assert evidence.buckets[bucket_of(8)].aside
    choices = run(evidence, 8, 400, drafted_rate=160.0, plain_rate=100.0)
    assert not evidence.buckets[bucket_of(8)].aside
    assert choices[-24:].count(Decision.PLAN) >= 20


def test_noise_within_the_margin_does_not_flip_the_choice():
    """A break-even draft under +-3% noise: once decided, the choice holds."""
    evidence = Evidence(EvidenceConfig(margin=0.05))
    rng = random.Random(5)
    wobble = lambda i: rng.uniform(0.97, 1.03)  # noqa: E731
    choices = run(evidence, 8, 300, drafted_rate=92.0, plain_rate=100.0, noise=wobble)
    assert choices[-100:].count(Decision.PLAIN) > 85
    choices = run(evidence, 8, 300, drafted_rate=100.0, plain_rate=100.0, noise=wobble)
    assert choices.count(Decision.PLAIN) > 0.85 * len(choices)  # stays aside: within the margin


def test_each_batch_size_bucket_decides_for_itself():
    evidence = Evidence()
    run(evidence, 1, 200, drafted_rate=130.0, plain_rate=100.0)
    run(evidence, 16, 200, drafted_rate=70.0, plain_rate=100.0)
    assert [evidence.choose(1) for _ in range(5)].count(Decision.PLAN) >= 4
    assert [evidence.choose(16) for _ in range(5)].count(Decision.PLAIN) >= 4


def test_a_clear_case_is_probed_less_often_than_a_close_one():
    clear, close = Evidence(), Evidence()
    clear_choices = run(clear, 1, 600, drafted_rate=200.0, plain_rate=100.0)[200:]
    close_choices = run(close, 1, 600, drafted_rate=110.0, plain_rate=100.0)[200:]
    assert 0 < clear_choices.count(Decision.PLAIN) < close_choices.count(Decision.PLAIN) / 2


def test_probes_of_a_settled_decision_grow_rarer_until_it_flips():
    evidence = Evidence(EvidenceConfig(max_backoff=4))
    choices = run(evidence, 16, 700, drafted_rate=50.0, plain_rate=100.0)  # a clear loss
    bucket = evidence.buckets[bucket_of(16)]
    assert bucket.aside and bucket.backoff == 4
    # (once decided) a probe from aside is two drafted steps: a warm-up, then the one weighed
    probes = [i for i, c in enumerate(choices)
              if c is Decision.PLAN and choices[i - 1] is Decision.PLAIN and i > 30]
    assert all(choices[i + 1] is Decision.PLAN for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1] == 12 * 4 * 4  # clear x4, settled x4
    # drafting pays now: the next probe disagrees, so the ones after come soon again
    later = run(evidence, 16, 700, drafted_rate=300.0, plain_rate=100.0)
    probes = [i for i, c in enumerate(later) if c is Decision.PLAN]
    assert max(b - a for a, b in zip(probes, probes[1:])) <= 12 * 4  # no backoff
    assert not bucket.aside and later[-200:].count(Decision.PLAN) > 0.9 * 200


def test_a_clearly_losing_draft_is_stepped_around_after_few_drafted_steps():
    """Drafted steps cost most where drafting loses: a clear loss needs only a few pairs
    of adjacent steps, a close one the full count. A step is weighed once the step after it
    came (which may carry seconds paid for it); the first drafted step after the yardstick is
    a warm-up, weighed on neither side."""
    def steps(evidence, drafted_seconds, sides):
        for drafted in sides:
            evidence.observe(8, drafted, tokens=8, seconds=drafted_seconds if drafted else 0.05)
        return evidence.buckets[bucket_of(8)]

    yardstick = [False] * 6
    clear = Evidence()
    warm_up = [True]
    assert not steps(clear, 0.1, yardstick + warm_up + [True, False, True, False]).aside  # 2
    assert steps(clear, 0.1, [True]).aside  # half the plain rate, three pairs
    close = Evidence()
    assert not steps(close, 0.058, yardstick + warm_up + [True, False] * 3 + [True]).aside
    assert close.buckets[bucket_of(8)].pairs.count == 5  # 14% slower: five pairs do not
    assert steps(close, 0.058, [False]).aside  # the full count: six


def test_what_a_step_pays_for_the_drafted_step_before_it_is_charged_to_that_one():
    """After a drafted step the next one compacts the holes its rejected drafts left: those
    seconds are drafting's. Charged to the plain step that paid them, they made drafting
    look faster than plain decoding; carried back, they count against it."""
    charged, carried = Evidence(), Evidence()
    for evidence, carry in ((charged, 0.0), (carried, 0.04)):
        for _ in range(6):
            evidence.observe(8, False, tokens=8, seconds=0.08)
        for i in range(12):  # a drafted step: 12 tokens in 0.1 s; the plain one after it
            evidence.observe(8, True, tokens=12, seconds=0.1)  # pays 0.04 s of compaction
            evidence.observe(8, False, tokens=8, seconds=0.12, carried=carry)
    assert not charged.buckets[bucket_of(8)].aside and charged.ratio(8) > 1.3
    assert carried.buckets[bucket_of(8)].aside and carried.ratio(8) < 0.95


def test_a_machine_that_slows_down_during_the_yardstick_does_not_make_drafting_look_good():
    """The yardstick's plain steps ran while the machine was at half speed; afterwards it
    runs at full speed, and drafted steps deliver 30% less than plain ones there. Compared as
    sums of each side's steps, the slow yardstick made drafted steps look faster; compared
    in pairs of adjacent steps, drafting loses, and the bucket steps aside."""
    evidence = Evidence()
    slow = lambda i: 0.5 if i < 6 else 1.0  # noqa: E731
    choices = run(evidence, 8, 200, drafted_rate=70.0, plain_rate=100.0, noise=slow)
    assert evidence.buckets[bucket_of(8)].aside
    assert evidence.ratio(8) == pytest.approx(0.7, rel=0.1)
    assert choices[100:].count(Decision.PLAN) < 10
    # and the other way round: a machine slow while drafting is first tried
    evidence = Evidence()
    slow = lambda i: 0.5 if 6 <= i < 12 else 1.0  # noqa: E731
    run(evidence, 8, 200, drafted_rate=130.0, plain_rate=100.0, noise=slow)
    assert not evidence.buckets[bucket_of(8)].aside and evidence.ratio(8) > 1.1


def test_a_config_out_of_range_is_refused():
    for bad in ({"min_steps": 0}, {"probe_every": 1}, {"pair_decay": 1.0}, {"margin": 1.0},
                {"max_backoff": 0},
                {"clear_factor": 0}, {"min_clear_pairs": 0}, {"min_clear_pairs": 7}):
        with pytest.raises(ValueError):
            EvidenceConfig(**bad)


def test_a_step_that_asked_a_draft_counts_as_drafted_even_with_nothing_verified():
    """The plain side is only steps that cost what decoding without drafts does: a step whose
    drafts found nothing to verify still paid for asking them. One that then decoded several
    plain steps is weighed on neither side."""
    from coordinator.clients import Timing
    from coordinator.drafting import DraftedCohort, Drafter, RowDraft
    from coordinator.policy import DraftingPolicy
    from coordinator.sequence import Sequence

    seen = []

    class Recording:
        def observe(self, rows, drafted, tokens, seconds, carried=0.0, sampled=False, steps=1,
                    weighed=True):
            seen.append((drafted, weighed))

    drafter = Drafter(None, DraftingPolicy(CONFIG, 0, evidence=Recording()), None)
    rows = [RowDraft(Sequence(i, [1, 2, 3], 8, frozenset())) for i in range(2)]
    drafter.observe_step(DraftedCohort(rows, Timing(0.01)), 2, 0.05)  # asked, nothing found
    drafter.observe_step(DraftedCohort(rows), 2, 0.04)  # stepped aside: no draft asked
    drafter.observe_step(DraftedCohort([RowDraft(rows[0].seq, 2, 0)], Timing(0.01)), 3, 0.06)
    drafter.observe_step(DraftedCohort(rows, Timing(0.01)), 8, 0.1, plain_steps=4)
    drafter.observe_step(DraftedCohort(rows), 8, 0.09, plain_steps=4)  # aside, four a row
    assert seen == [(True, True), (False, True), (True, True), (True, False), (False, True)]
def test_rows_of_a_cohort_aside_are_not_idle_for_the_plan():
    """Idle rows are planned at an optimistic acceptance (exploration). Rows the evidence kept
    plain were not idle in that sense: counted idle, the step that tries drafting again after
    a stretch aside would draft K for every row, far dearer than drafting as planned."""
    from coordinator import goodput
    from coordinator.clients import VerifyOutcome
    from coordinator.drafting import Drafter, RowDraft
    from coordinator.policy import DraftingPolicy
    from coordinator.sequence import DraftState, Sequence

    planner = goodput.GoodputPolicy(goodput.GoodputConfig(explore_every=4), [], None)
    policy = DraftingPolicy(CONFIG, 1, planner=planner)
    drafter = Drafter(None, policy, None)
    aside = Sequence(1, [1, 2, 3], 8, frozenset(), drafts=[DraftState()])
    planned = Sequence(2, [1, 2, 3], 8, frozenset(), drafts=[DraftState()])
    for _ in range(6):
        drafter.observe(RowDraft(aside, aside=True), VerifyOutcome(1, 0, [5], 4))
        drafter.observe(RowDraft(planned), VerifyOutcome(2, 0, [5], 4))
    assert policy.acceptance_state(1, 0) is None  # nothing observed of it
    assert policy.acceptance_state(2, 0).idle_steps == 6
    assert planner.choice(policy.acceptance_state(2, 0), 1, 0).acceptance == \
        planner.config.optimism
    assert planner.choice(goodput.RowState(), 1, 0).acceptance < planner.config.optimism
    policy.forget([2])  # the sequence ended: its state goes
    assert policy.acceptance_state(2, 0) is None


def test_turnover_copies_are_left_out_and_compaction_is_charged_to_the_drafted_step():
    """A verify whose rows are not the batch they last ran in (a request joined or left)
    pays for re-stacking them whatever the server drafts: those seconds are left out of the
    evidence. In an unchanged batch after a step that verified drafts, the target's
    realignment compacts the holes the rejected drafts left: that is drafting's cost, carried
    back to the drafted step; after a plain step it is the step's own."""
    from coordinator.clients import Timing
    from coordinator.drafting import DraftedCohort, Drafter, RowDraft
    from coordinator.policy import DraftingPolicy
    from coordinator.sequence import Sequence

    seen = []

    class Recording:
        def observe(self, rows, drafted, tokens, seconds, carried=0.0, sampled=False, steps=1,
                    weighed=True):
            seen.append((round(seconds, 3), round(carried, 3)))

    drafter = Drafter(None, DraftingPolicy(CONFIG, 0, evidence=Recording()), None)
    seqs = [Sequence(i, [1, 2, 3], 8, frozenset()) for i in range(3)]
    verify = Timing(compute_seconds=0.3, realign_seconds=0.24)
    step = [RowDraft(s) for s in seqs[:2]]
    drafter.observe_step(DraftedCohort(step), 2, 0.32, verify)  # a new batch: copied
    drafter.observe_step(DraftedCohort(step), 2, 0.32, verify)  # the same batch, after plain
    drafter.observe_step(DraftedCohort([RowDraft(s) for s in seqs]), 3, 0.32, verify)  # joined
    drafter.observe_step(DraftedCohort(step[::-1]), 2, 0.32, verify)  # reordered: a copy
    drafter.observe_step(DraftedCohort(step[::-1]), 2, 0.32)  # no timing: nothing to take off
    drafted = [RowDraft(seqs[1], forced=(7,)), RowDraft(seqs[0])]  # verifies a draft
    drafter.observe_step(DraftedCohort(drafted), 2, 0.32, verify)
    drafter.observe_step(DraftedCohort(step[::-1]), 2, 0.32, verify)  # compacts its holes
    drafter.observe_step(DraftedCohort(step[::-1]), 2, 0.32, verify)  # after plain again
    assert seen == [(0.08, 0.0), (0.32, 0.0), (0.08, 0.0), (0.08, 0.0), (0.32, 0.0),
                    (0.32, 0.0), (0.32, 0.24), (0.32, 0.0)]



def run_lone_row(evidence: Evidence, steps: int, tokens: list[int],
                 drafted_seconds: float) -> list[Decision]:
    """A lone row: a plain step commits one token in 40 ms; drafted steps take
    drafted_seconds and commit `tokens` in turn, over and over."""
    choices, drafted_steps = [], 0
    for _ in range(steps):
        choice = evidence.choose(1)
        choices.append(choice)
        drafted = choice is Decision.PLAN
        committed = tokens[drafted_steps % len(tokens)] if drafted else 1
        drafted_steps += drafted
        evidence.observe(1, drafted, tokens=committed,
                         seconds=drafted_seconds if drafted else 0.04)
    return choices


def test_a_lone_rows_uneven_drafted_steps_are_judged_by_the_tokens_they_deliver():
    """One row's drafted steps commit one token most of the time and several now and then:
    here 1, 1, 1, 1, 3 tokens in turn, each step in 1.2x a plain step's time: 1.17x the plain
    steps' tokens per second. A mean of each pair's ratio of rates (geometric) puts that at
    1.04x, since the one-token steps outnumber the tokens they bring: once aside after a hard
    stretch, the bucket stayed aside (coming back takes 1 + margin). Judged by the tokens
    they deliver, it comes back and drafts on most steps."""
    evidence = Evidence()
    run_lone_row(evidence, 60, [1, 1, 1, 2], drafted_seconds=0.066)  # 1.25 tokens in 1.65x
    assert evidence.buckets[bucket_of(1)].aside
    choices = run_lone_row(evidence, 900, [1, 1, 1, 1, 3], drafted_seconds=0.048)
    assert not evidence.buckets[bucket_of(1)].aside
    assert choices[100:].count(Decision.PLAN) > 0.85 * 800  # back within 100 steps: probes of
    # a one-row bucket aside are cheap, so they come every 12 steps
    assert evidence.ratio(1) > 1.05  # 1.17x, as the last pairs sample the turns


def test_a_lone_row_steps_aside_where_more_tokens_come_too_slowly():
    """The other way round: 1.5 tokens a drafted step, in 1.7x a plain step's time (0.88x
    the plain steps' tokens per second), steps aside. (Tokens 1, 2, 2, 1 in turn: aside,
    each probe is a warm-up and a weighed step, so the weighed ones see 2 and 1 in turn.)"""
    evidence = Evidence()
    choices = run_lone_row(evidence, 300, [1, 2, 2, 1], drafted_seconds=0.068)
    assert evidence.buckets[bucket_of(1)].aside
    assert evidence.ratio(1) == pytest.approx(1.5 / 1.7, rel=0.05)
    assert choices[-200:].count(Decision.PLAIN) > 0.8 * 200  # probes: 2 steps in 13


def test_cohorts_with_a_sampled_row_keep_their_own_buckets():
    """A draft matches sampled choices less often than greedy ones: a lone greedy row's
    bucket stepping aside leaves the sampled rows' bucket of the same size as it was, and
    their steps decide it alone."""
    evidence = Evidence()
    run_lone_row(evidence, 300, [1, 2], drafted_seconds=0.068)  # greedy: steps aside
    assert evidence.buckets[bucket_of(1)].aside
    assert bucket_of(1) not in evidence.sampled_buckets and evidence.ratio(1, sampled=True) is None
    choices = []
    for _ in range(300):  # sampled: 2 or 3 tokens a drafted step in 1.2x a plain one's time
        choice = evidence.choose(1, sampled=True)
        choices.append(choice)
        drafted = choice is Decision.PLAN
        evidence.observe(1, drafted, tokens=3 if drafted and len(choices) % 2 else 1 + drafted,
                         seconds=0.048 if drafted else 0.04, sampled=True)
    assert not evidence.sampled_buckets[bucket_of(1)].aside
    assert evidence.ratio(1, sampled=True) > 1.05
    assert evidence.buckets[bucket_of(1)].aside  # the greedy bucket untouched


def test_a_lone_row_is_not_kept_aside_by_what_its_probes_pay_to_catch_the_draft_up():
    """Aside, a lone row's draft misses every token; the probe's drafted step first catches
    it up (here 4 ms a missed token over a steady drafted step's 44 ms for 1.5 tokens, against
    a plain step's 40 ms for one: steady drafting delivers 1.36x). Weighed as the probe, the
    catch-up made drafting look like 0.68x, and the row stayed aside for good; the warm-up
    pays it unweighed and the step after it is the one compared, so the row comes back."""
    evidence, missed, drafted_steps, choices = Evidence(), 0, 0, []

    def step(steady_seconds: float) -> None:
        nonlocal missed, drafted_steps
        choice = evidence.choose(1)
        choices.append(choice)
        drafted = choice is Decision.PLAN
        tokens = (1, 2)[drafted_steps % 2] if drafted else 1
        seconds = steady_seconds + 0.004 * missed if drafted else 0.04
        missed, drafted_steps = 0 if drafted else missed + 1, drafted_steps + drafted
        evidence.observe(1, drafted, tokens=tokens, seconds=seconds)

    for _ in range(60):  # a hard stretch: drafted steps cost 2x, it steps aside
        step(0.08)
    assert evidence.buckets[bucket_of(1)].aside
    for _ in range(400):
        step(0.044)
    assert not evidence.buckets[bucket_of(1)].aside
    assert choices[-200:].count(Decision.PLAN) > 0.85 * 200
    assert evidence.ratio(1) > 1.2


@pytest.mark.parametrize("rows", [1, 8])
def test_a_bucket_aside_is_probed_as_often_in_tokens_when_its_commands_decode_several(rows):
    """Aside, plain commands of up to four tokens a row (as many as `room` lets) reach each
    probe after the same tokens a row as commands of one token do: the draft catches up as
    much at each probe, and probes come no rarer."""

    def tokens_between_probes(max_steps: int) -> list[int]:
        evidence, since, gaps = Evidence(), 0, []
        for _ in range(400):
            choice = evidence.choose(rows)
            drafted = choice is Decision.PLAN
            room = evidence.room(rows)
            steps = 1 if drafted else min(max_steps, max_steps if room is None else room)
            if drafted and since:
                gaps.append(since)
            since = 0 if drafted else since + steps
            rate = 80.0 if drafted else 100.0  # drafting loses: it steps aside
            evidence.observe(rows, drafted, tokens=rows * steps, seconds=rows * steps / rate,
                             steps=steps)
        assert evidence.buckets[bucket_of(rows)].aside
        return gaps[-4:]

    one, four = tokens_between_probes(1), tokens_between_probes(4)
    assert len(four) == 4 and max(one) >= 10  # probes of a bucket aside, far apart
    assert four == one


def test_plain_probes_come_as_often_in_tokens_when_plan_steps_decode_several():
    """Drafting pays, so the bucket plans; every other plan step asked drafts that proposed
    nothing and decoded four tokens a row in one command (Verifier.plain_steps). Such a step
    counts its tokens toward the next plain probe, so probes come after about as many tokens
    a row as where each of those steps decoded one."""

    def tokens_between_plain_probes(nothing_steps: int) -> list[int]:
        evidence, since, gaps = Evidence(), 0, []
        for i in range(600):
            drafted = evidence.choose(1) is Decision.PLAN
            steps = nothing_steps if drafted and i % 2 else 1
            if not drafted and since:
                gaps.append(since)
            since = since + steps if drafted else 0
            rate = 120.0 if drafted else 100.0  # drafting pays: it plans
            evidence.observe(1, drafted, tokens=steps, seconds=steps / rate, steps=steps)
        assert not evidence.buckets[bucket_of(1)].aside
        return gaps[-3:]

    one, four = tokens_between_plain_probes(1), tokens_between_plain_probes(4)
    assert len(four) == 3 and min(one) >= 12  # probes of a settled bucket, far apart
    assert all(a <= b + 3 for a, b in zip(four, one))  # overshot by one command at most


def test_a_plan_step_that_verified_no_draft_is_weighed_on_neither_side():
    """A drafted step that verified no draft and decoded four tokens a row at the plain rate
    says nothing of what drafted steps deliver: it is paired with neither neighbour, so the
    pairs that decide are those of steps that verified drafts (here at 0.8x the plain rate)."""
    evidence = Evidence(EvidenceConfig(min_steps=1))
    bucket = evidence.buckets.setdefault(bucket_of(1), Bucket())
    evidence.observe(1, False, tokens=1, seconds=0.01)  # the yardstick
    evidence.observe(1, True, tokens=4, seconds=0.04, steps=4, weighed=False)
    evidence.observe(1, False, tokens=1, seconds=0.01)
    evidence.observe(1, True, tokens=1, seconds=0.0125)  # verified drafts: 0.8x
    assert bucket.pairs.count == 0  # (a step is paired once the step after it came)
    evidence.observe(1, False, tokens=1, seconds=0.01)
    evidence.observe(1, False, tokens=1, seconds=0.01)
    assert bucket.pairs.count == 2 and bucket.pairs.ratio == pytest.approx(0.8)
