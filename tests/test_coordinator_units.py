"""Pure coordinator parts: sequence bookkeeping, group selection and reconnection (no torch,
no gRPC)."""
import logging
import subprocess
import sys
import threading
import time

import pytest

from batchspec import errors
from batchspec.v1 import cache_pb2
from coordinator import features as features_lib
from coordinator import peers as peers_module
from coordinator import scheduler
from coordinator.clients import ModelInfo
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.router import Router
from coordinator.sequence import DraftState, Finish, Sequence


def seq(seq_id, length, generated=0, last_step=0, max_new=100, stop=(3,)):
    s = Sequence(seq_id, list(range(10, 10 + length)), max_new, frozenset(stop))
    s.token_ids += [50] * generated
    s.last_step = last_step
    s.drafts = [DraftState(s.committed_len - 1, s.committed_len - 1)]
    return s


def test_commit_stops_at_first_eos_and_keeps_it():
    s = seq(1, 4)
    assert s.commit([7, 3, 8]) == [7, 3]
    assert s.finish is Finish.STOP and s.generated_token_ids == [7, 3]


def test_commit_never_exceeds_the_requests_own_max_new_tokens():
    s = seq(1, 4, max_new=3)
    assert s.commit([5, 6]) == [5, 6] and s.finish is None
    assert s.commit([7, 8, 9]) == [7]
    assert s.finish is Finish.LENGTH and s.num_generated == 3


class ForcingGrammar:
    """A constraint that allows every draft and forces as many tokens as it is let."""

    def cut(self, draft_token_ids, extend):
        forced = [9] * extend
        return [b""] * (len(draft_token_ids) + extend + 1), len(draft_token_ids), forced

    def advance(self, token_ids):
        pass


def test_forced_tokens_fill_a_constrained_row_up_to_k_but_never_past_its_end():
    from coordinator.drafting import DraftedCohort, RowDraft
    far, near, last = seq(1, 4, max_new=20), seq(2, 4, max_new=3), seq(3, 4, max_new=1)
    for s in (far, near, last):
        s.constraint = ForcingGrammar()
    near.commit([5])  # 2 tokens left: at most 1 draft, forced ones included
    cohort = DraftedCohort([RowDraft(far), RowDraft(near), RowDraft(last)]).constrained(4)
    assert [len(row.forced) for row in cohort.rows] == [4, 1, 0]
    assert [s.draft_room for s in (far, near, last)] == [19, 1, 0]


def test_eos_equal_to_pad_like_ids_is_found_by_position_not_by_value():
    s = seq(1, 3, stop=())  # ignore_eos: token 3 is an ordinary token
    assert s.commit([3, 3]) == [3, 3] and s.finish is None


def test_draft_append_need_follows_the_valid_prefix():
    s = seq(1, 5)
    assert s.draft_append_need() == 1  # only the last committed token
    s.drafts[0].valid_len = s.committed_len - 2  # the previous step accepted all drafts
    assert s.draft_append_need() == 2


def ids(group):
    return [s.seq_id for s in group.sequences]


def step_round(active, policy, step):
    """Pick a group and advance it as the engine would (one token each, this step)."""
    group = scheduler.pick_cohort(active, policy, step)
    for s in group.sequences:
        s.token_ids.append(50)
        s.last_step = step
    return group


def test_new_sequences_form_cohorts_of_equal_length_first():
    active = [seq(1, 5), seq(2, 7), seq(3, 7), seq(4, 9), seq(5, 7), seq(6, 7), seq(7, 6)]
    group = scheduler.pick_cohort(active, scheduler.CohortPolicy(batch_size=4), step=1)
    assert ids(group) == [1, 4, 7] and group.mixed  # the leftovers, holding the lowest id
    sevens = {s.cohort for s in active if s.committed_len == 7}
    assert len(sevens) == 1 and sevens.isdisjoint({s.cohort for s in group.sequences})
    for s in group.sequences:
        s.last_step = 1
    group = scheduler.pick_cohort(active, scheduler.CohortPolicy(batch_size=4), step=2)
    assert ids(group) == [2, 3, 5, 6] and not group.mixed  # the four of length 7 (EXSPEC)


def test_a_cohort_keeps_its_rows_and_order_while_lengths_diverge():
    policy = scheduler.CohortPolicy(batch_size=3)
    active = [seq(i, 6) for i in range(1, 7)]
    seen = []
    for step in range(1, 9):
        group = step_round(active, policy, step)
        seen.append(ids(group))
        group.sequences[0].token_ids.append(51)  # it accepted one token more than the others
    assert seen[0::2] == [[1, 2, 3]] * 4 and seen[1::2] == [[4, 5, 6]] * 4  # turns, unchanged
    assert scheduler.pick_cohort(active, policy, 9).mixed  # different lengths, same rows


def test_cohorts_take_turns_so_none_waits_longer_than_a_round():
    policy = scheduler.CohortPolicy(batch_size=4)
    active = [seq(i, 4 + i % 5) for i in range(1, 21)]
    last = {}
    for step in range(1, 31):
        for s in step_round(active, policy, step).sequences:
            if s.seq_id in last:
                assert step - last[s.seq_id] <= 5  # 20 sequences, 5 cohorts of 4
            last[s.seq_id] = step
    assert len(last) == 20


def test_short_cohorts_merge_and_newcomers_fill_them():
    policy = scheduler.CohortPolicy(batch_size=4)
    active = [seq(i, 6) for i in range(1, 9)]
    scheduler.pick_cohort(active, policy, 1)
    assert len({s.cohort for s in active}) == 2
    active = [s for s in active if s.seq_id not in (1, 2, 7)]  # finished: both cohorts short
    group = scheduler.pick_cohort(active, policy, 2)
    assert len({s.cohort for s in active}) == 2 and len(group.sequences) == 4
    active.append(seq(9, 6))  # an arrival joins the short cohort
    scheduler.pick_cohort(active, policy, 3)
    sizes = sorted(sum(s.cohort == c for s in active) for c in {s.cohort for s in active})
    assert sizes == [2, 4]


def test_draft_plan_widens_appends_and_drops_rows_too_short_for_them():
    a, b, c = seq(1, 6), seq(2, 6), seq(3, 1)
    b.drafts[0].valid_len = b.committed_len - 2
    rows, width = scheduler.draft_plan([a, b, c])
    assert width == 2 and [s.seq_id for s in rows] == [1, 2]


class FakeProbe:
    def __init__(self, service):
        self.service = service

    def done(self):
        return self.service.answering.is_set()

    def info(self):
        return self.service.describe()


class FakeService:
    """A service stand-in whose probe goes unanswered until `answering` is set."""

    def __init__(self, address):
        self.address = address
        self.answering = threading.Event()
        self.prefills = []  # prefix lengths of each prefill command
        self.instance = None
        self.features_for_drafts = False

    def probe(self, timeout=None):
        return FakeProbe(self)

    def reset(self):
        pass

    def close(self):
        pass

    def describe(self, timeout=0.0):
        return ModelInfo("fake", 100, [3], 1000, 0, 0)

    def prefill(self, entries, copies=None):
        self.prefills.append([len(tokens) for _, tokens in entries])
        return self.prefills[-1]


def test_a_hung_service_is_probed_off_the_engine_thread():
    target, draft = FakeService("target"), FakeService("draft")
    target.answering.set()
    health = []
    router = Router(max_queue=4)
    engine = router.add(Engine(target, [[draft]], EngineConfig(reconnect_backoff_s=(0.0, 0.0)),
                               [3], handover=router.handover))
    router.start(on_health=health.append)
    peers = engine.peers
    try:
        peers.draft_lost(peers.kinds[0], "the draft stopped answering")
        assert health == [True] and router.healthy()  # still serving, with the target alone
        started = time.monotonic()
        for _ in range(5):
            assert peers.ensure()  # the target is up: decoding goes on
            assert not peers.draft_up
        assert time.monotonic() - started < 1.0  # the probe left hanging blocked nothing
        draft.answering.set()
        end = time.monotonic() + 5
        while not peers.draft_up and time.monotonic() < end:
            peers.ensure()
            time.sleep(0.01)
        assert peers.draft_up  # it answers again: reconnected
    finally:
        router.stop()


def test_a_request_finding_no_target_has_the_lost_ones_probed_at_once():
    """A target lost long enough to be retried only every few seconds answers again: a
    request that finds no engine accepting makes the engine probe it now and is taken, not
    refused; where no target answers, it is refused once the router's wait is over, and at
    once where no target is lost (the only one drains)."""
    target, draft = FakeService("target"), FakeService("draft")
    draft.answering.set()
    router = Router(max_queue=4, revive_s=0.5)
    engine = router.add(Engine(target, [[draft]], EngineConfig(reconnect_backoff_s=(30.0, 30.0)),
                               [3], handover=router.handover))
    router.start()
    try:
        engine.peers.target_lost("the target went away")
        assert engine.peers.reconnect.next_retry > time.monotonic() + 10  # its retry backed off
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="no target service is reachable"):
            router.submit([5, 6, 7], 4)
        assert 0.5 <= time.monotonic() - started < 5  # it waited, then refused
        target.answering.set()  # back, but not due for a retry for half a minute
        handle = router.submit([5, 6, 7], 4)
        assert engine.accepting and handle is not None
        engine.peers.target_draining = True  # up but leaving: nothing to probe, no wait
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="no target service is reachable"):
            router.submit([5, 6, 7], 4)
        assert time.monotonic() - started < 0.4
    finally:
        router.stop()


class HoldingService(FakeService):
    """Holds some sequence ids; a release is all-or-nothing, as the runner's is."""

    def __init__(self, held):
        super().__init__("held")
        self.held = set(held)
        self.releases = []

    def release(self, seq_ids):
        self.releases.append(list(seq_ids))
        if not set(seq_ids) <= self.held:
            raise errors.NotFound("not cached")
        self.held -= set(seq_ids)
        return len(self.held)


def test_stale_sequences_are_released_in_one_command_or_one_by_one():
    forget_stale = peers_module.forget_stale
    service = HoldingService({1, 2, 3, 9})
    forget_stale(service, {1, 2, 3})
    assert service.releases == [[1, 2, 3]] and service.held == {9}
    service = HoldingService({1, 3, 9})  # 2 is gone already: the rest one by one
    forget_stale(service, {1, 2, 3})
    assert service.releases == [[1, 2, 3], [1], [2], [3]] and service.held == {9}
    forget_stale(service, set())
    assert len(service.releases) == 4  # nothing to release, no command


def test_split_by_tokens_bounds_each_run_and_keeps_order():
    seqs = [seq(i, n) for i, n in enumerate([4, 5, 3, 20, 2, 2], start=1)]  # prefixes n - 1
    runs = scheduler.split_by_tokens(seqs, budget=8)
    assert [[s.seq_id for s in run] for run in runs] == [[1, 2], [3], [4], [5, 6]]
    assert all(sum(s.committed_len - 1 for s in run) <= 8 for run in runs if len(run) > 1)
    assert scheduler.split_by_tokens([], budget=8) == []


def test_admission_and_resync_prefill_in_bounded_commands():
    target, draft = FakeService("target"), FakeService("draft")
    engine = Engine(target, [[draft]], EngineConfig(max_prefill_tokens=10), [3])
    for length in (5, 5, 5, 30):  # prefixes of 4 tokens, and one of 29
        engine.submit(list(range(10, 10 + length)), 4)
    pool, peers = engine.pool, engine.peers
    engine._admit()
    assert target.prefills == [[4, 4]] and pool.num_running() == 2 and pool.num_waiting() == 2
    assert draft.prefills == []  # a draft is prefilled with a row when a step first picks it
    engine._admit()
    engine._admit()
    assert target.prefills == [[4, 4], [4], [29]] and pool.num_running() == 4
    target.prefills.clear()
    peers._resync_target()  # after a restart: the same bounded runs
    assert target.prefills == [[4, 4], [4], [29]]
    seqs = pool.active_sequences()
    peers.warm(peers.kinds[0], seqs[:2])
    peers.warm(peers.kinds[0], seqs)  # only the rows it holds nothing of yet
    assert draft.prefills == [[4, 4], [4], [29]]
    assert all(s.drafts[0].cache_len == s.drafts[0].valid_len == s.committed_len - 1
               for s in seqs)


def test_a_flag_value_the_config_refuses_is_a_usage_error_not_a_traceback(capsys):
    from coordinator import __main__ as coordinator_main

    for flags in (["--stall-timeout", "0"], ["--max-prefill-tokens", "0"], ["--batch-size", "0"],
                  ["--step-log", "/no/such/directory/steps.jsonl"]):
        try:
            coordinator_main.main(["--target", "127.0.0.1:1"] + flags)
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{flags} was accepted")
        assert "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_coordinator_does_not_import_torch():
    code = ("import sys, coordinator.__main__, coordinator.engine, coordinator.servicer, "
            "coordinator.http; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class CopyingTarget:
    """A target answering prefills with features (two float16 zeros per position); the
    command with copies fails when told to."""

    def __init__(self, refuse_copies=False):
        self.refuse_copies = refuse_copies
        self.commands, self.released = [], []

    def prefill(self, entries, copies=None, return_features=False):
        self.commands.append(([s for s, _ in entries], dict(copies or {}), return_features))
        if copies and self.refuse_copies:
            raise errors.ResourceExhausted("full")
        if not return_features:
            return [len(t) for _, t in entries]
        return [len(t) for _, t in entries], [cache_pb2.Features(
            num_positions=len(t), width=1, values_f16=bytes(2 * len(t))) for _, t in entries]

    def release(self, seq_ids):
        self.released.append(list(seq_ids))


def test_copies_of_a_prompt_follow_the_prefill_that_returns_features_all_or_nothing():
    first, again, other = seq(1, 6), seq(2, 6), seq(3, 4)
    target = CopyingTarget()
    features_lib.prefill_target(target, [first, again, other], {2: 1})
    assert target.commands == [([1, 3], {}, True), ([2], {2: 1}, False)]
    assert again.features.length == first.features.length == 5 and other.features.length == 3
    target = CopyingTarget(refuse_copies=True)
    with pytest.raises(errors.ResourceExhausted):
        features_lib.prefill_target(target, [seq(4, 6), seq(5, 6)], {5: 4})
    assert target.released == [[4]]  # computed, then released: admitted again later


def test_a_draft_of_another_vocabulary_is_refused_at_start(caplog):
    """check_draft: a draft whose ids mean other tokens than the target's (another digest,
    whatever its size) is refused with a message that says how to serve it (translated to
    the target's tokens); one that matches, or whose service knows no tokenizer, is taken
    silently."""
    import logging

    from coordinator import fleet

    def info(size, vocabulary):
        return ModelInfo("m", size, [2], 256, 0, 0, vocabulary=vocabulary)

    target = info(96, "words")
    for other in (info(28, "characters"), info(96, "other words")):
        with pytest.raises(errors.FailedPrecondition, match="--target-tokenizer"):
            fleet.check_draft(other, target, "draft:1")
    with pytest.raises(errors.FailedPrecondition):
        fleet.check_draft(info(100, ""), target, "draft:1")  # larger: never
    with caplog.at_level(logging.WARNING, logger="coordinator.fleet"):
        fleet.check_draft(info(96, "words"), target, "draft:1")
        fleet.check_draft(info(28, ""), target, "draft:1")  # unknown: the runtime refuses rows
        assert not caplog.text


@pytest.mark.parametrize("request_id, shown", [
    ("abc-1", "request abc-1 "),
    ("a\nFAKE LOG LINE", "request a\\nFAKE LOG LINE "),  # one record stays one line
    ("x" * 1000, "request " + "x" * 128 + "... "),  # a client's id is bounded in the log
], ids=["plain", "newline", "long"])
def test_a_requests_log_line_shows_its_id_on_one_bounded_line(caplog, request_id, shown):
    from coordinator.requests import Ending
    with caplog.at_level(logging.INFO, logger="coordinator"):
        Ending("grpc", request_id, time.monotonic(), reason="finished (length)").log()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(shown) and "\n" not in line
