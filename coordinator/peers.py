"""The peers part: the model services one engine talks to, and what it does when one is lost.

It owns the target client and the draft kinds (each a list of replicas), knows which are
reachable, and handles every way a service comes and goes: a loss (the stream is dropped, every
sequence must be prefilled there again), a probe off the engine thread while it is down, the
reconnection (what it still holds of ours released first, the target refilled from the
committed record), the hand-off of a lost target's requests to another engine, and releases
(a release that fails is retried once the service answers again). Live membership grows here.

Invariant: for every service and active sequence, the sequence's record of that service's
cache (`Sequence.target`, `Sequence.drafts[i]`) is None unless the service holds exactly that
many of its committed tokens; after a loss every record of that service is None.
"""
import dataclasses
import logging
import time

from batchspec import errors
from coordinator import features as features_lib
from coordinator import scheduler
from coordinator.clients import ModelInfo, VerifySpec
from coordinator.commit import keep_features
from coordinator.drafts import DraftKind
from coordinator.pool import RequestPool
from coordinator.reconnect import Reconnect
from coordinator.sequence import EVERY_KIND, DraftState, Sequence, forget_caches
from coordinator.stats import Recorder

log = logging.getLogger(__name__)

# How long a service that refused new sequences for capacity is left alone before asking again.
FULL_BACKOFF_S = 0.5


@dataclasses.dataclass(frozen=True)
class PeersConfig:
    reconnect_backoff_s: tuple[float, float]  # first and longest retry delay
    max_prefill_tokens: int  # prompt tokens per prefill command when refilling a cache


class Peers:
    def __init__(self, target, kinds: list[DraftKind], pool: RequestPool, config: PeersConfig,
                 recorder: Recorder, handover=None):
        """handover: the engines' coordinator.handover.Handover (requests moved to other
        target replicas, health), or None for a lone engine."""
        self.target = target
        self.kinds = kinds
        self.pool = pool
        self.config = config
        self.recorder = recorder
        self.handover = handover
        self.target_up = True
        self.target_draining = False  # it drains: admit nothing; until a fresh instance answers
        # service address -> ids of sequences that may still hold caches there although we
        # lost the stream (a release that failed, or a loss while they were cached); released
        # when the service answers again, unless it restarted empty
        self._stale: dict[str, set[int]] = {}
        self.reconnect = Reconnect(config.reconnect_backoff_s)

    @property
    def draft_up(self) -> bool:
        """Some draft kind is reachable."""
        return any(kind.up for kind in self.kinds)

    def all_up(self) -> bool:
        """The target and every kind that has replicas are reachable."""
        return self.target_up and all(kind.up for kind in self.kinds if kind.replicas)

    def describe(self) -> tuple[ModelInfo | None, list[ModelInfo | None]]:
        """The target's and each draft kind's ModelInfo (None, logged, where one does not
        answer); each kind takes the model name its service reported."""
        target = _describe(self.target)
        infos = [_describe(kind.client) for kind in self.kinds]
        for client, info in zip([self.target] + [k.client for k in self.kinds],
                                [target] + infos):
            if info is not None and client.instance is None:
                client.instance = info.instance_id
        for kind, info in zip(self.kinds, infos):
            kind.name = info.model if info is not None else kind.name
        features_lib.note_readers(self.target, target, self.kinds, infos)
        return target, infos

    # ---- caches ---------------------------------------------------------------------------------
    def prefill_target(self, seqs: list[Sequence], chunk: int = 0) -> None:
        """Prefill newly admitted rows in the target (one command) and give each a fresh
        record of every draft: drafts are prefilled only when a step first uses them. A
        prompt longer than `chunk` tokens (0: none is) gets its first `chunk` only; the engine
        feeds the rest (extend_target)."""
        with self.recorder.prefill("target"):
            cached = prefill_fresh(self.target, seqs, self.pool.active_sequences(), chunk)
        for s in seqs:
            s.target.cache_len = cached.get(s.seq_id, s.committed_len - 1)
            s.drafts = [DraftState() for _ in self.kinds]

    def extend_target(self, seq: Sequence, chunk: int, timeout: float | None) -> None:
        """Feed the target the next `chunk` tokens (at most) of a prompt it holds in part
        (seq.prefilling): a verify of those tokens with no drafts, whose output, a token
        after a part of the prompt, is dropped (a seeded sample is a function of its position:
        dropping one changes no other)."""
        start = seq.target.cache_len
        end = min(start + chunk, seq.committed_len - 1)
        spec = VerifySpec(seq.seq_id, start, seq.token_ids[start:end], [], seq.sampling)
        with self.recorder.prefill("target"):
            [outcome], _ = self.target.verify(False, [spec], timeout=timeout)
        if outcome.seq_id != seq.seq_id or outcome.cache_len != end:
            raise errors.FailedPrecondition(
                f"target answered seq {outcome.seq_id} with cache {outcome.cache_len}; "
                f"expected seq {seq.seq_id} with {end}")
        keep_features(seq, outcome)
        seq.target.cache_len = end

    def warm(self, kind: DraftKind, seqs: list[Sequence]) -> bool:
        """Prefill, from the committed record, the rows draft `kind` holds nothing of;
        False when the draft was lost doing so. InvalidArgument where it refused their
        tokens (see drafting.refuse)."""
        cold = [s for s in seqs if s.drafts[kind.index].cache_len is None]
        if not kind.up or not cold:
            return kind.up
        if time.monotonic() < kind.full_until:
            return False
        if kind.reads_features and not features_lib.ensure(self.target, cold):
            return False
        try:
            with self.recorder.prefill("draft"):
                prefill_in_runs(kind.client, cold, self.config.max_prefill_tokens,
                                kind.reads_features)
        except errors.Draining:
            self.draft_leaving(kind)
            return False
        except errors.ResourceExhausted as error:  # full with other clients' sequences
            log.info("draft %s is full (%s): these rows decode without it for now",
                     kind.client.address, error)
            kind.full_until = time.monotonic() + FULL_BACKOFF_S
            return False
        except errors.Unavailable as error:
            self.draft_lost(kind, error)
            return False
        for s in cold:
            s.drafts[kind.index] = DraftState(s.committed_len - 1, s.committed_len - 1)
        return True

    def release(self, seqs: list[Sequence]) -> None:
        """Free what every reachable service holds of `seqs` (no longer active)."""
        if not seqs:
            return
        if self.target_up:
            self._release_in(self.target, [s for s in seqs if s.target.cache_len is not None])
        self._release_drafts(seqs)

    def _release_drafts(self, seqs: list[Sequence]) -> None:
        for kind in self.kinds:
            if kind.up:
                self._release_in(kind.client, [s for s in seqs
                                               if s.drafts[kind.index].cache_len is not None])

    def _free_drafts(self, seqs: list[Sequence]) -> None:
        """Release what the drafts hold of `seqs` and forget those records."""
        self._release_drafts(seqs)
        forget_caches(seqs, drafts=EVERY_KIND)

    def _release_in(self, client, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        try:
            client.release([s.seq_id for s in seqs])
        except errors.Unavailable as error:
            log.warning("release on %s failed (%s); retried when it answers again",
                        client.address, error)
            self._mark_stale(client, seqs)

    def _mark_stale(self, client, seqs: list[Sequence]) -> None:
        self._stale.setdefault(client.address, set()).update(s.seq_id for s in seqs)

    # ---- losses ---------------------------------------------------------------------------------
    def draft_lost(self, kind: DraftKind, error) -> None:
        log.warning("draft %s (%s) lost (%s): decoding %s", kind.client.address, kind.name,
                    error, "with the other drafts" if self.draft_up else "with the target alone")
        kind.up = False
        self._health_changed()
        self._lost(kind.client, kind.index)

    def replica_gone(self, address: str) -> None:
        """A service left the membership for good: nothing of it is retried or released."""
        self._stale.pop(address, None)
        self._health_changed()

    def draft_leaving(self, kind: DraftKind) -> None:
        """The kind's current replica drains or left: free ours there while it answers; go on
        with the next replica, found by probing (a draining one's probe is no answer)."""
        log.info("draft %s (%s) is leaving: its sequences are drafted elsewhere",
                 kind.client.address, kind.name)
        self._release_in(kind.client, [s for s in self.pool.active_sequences()
                                       if s.drafts[kind.index].cache_len is not None])
        kind.client.reset()
        forget_caches(self.pool.active_sequences(), drafts=[kind.index])
        kind.up = False
        kind.next_replica()
        self.reconnect.schedule(soon=True)

    def target_lost(self, error) -> None:
        self.target_up = False
        self._health_changed()
        self._lost(self.target)
        if self.hand_off():
            log.warning("target %s lost (%s): its requests moved to other replicas",
                        self.target.address, error)
        else:
            log.warning("target %s lost (%s): requests wait for it", self.target.address, error)

    def _health_changed(self) -> None:
        if self.handover is not None:
            self.handover.health_changed()

    def _lost(self, client, kind: int | None = None) -> None:
        """What losing any service means (the target, or draft kind `kind`'s replica). Its
        stream is dropped; what it may still hold of ours is stale (released when it is
        back); every sequence must be prefilled there again; a retry is due."""
        client.reset()
        seqs = self.pool.active_sequences()
        self._mark_stale(client, [s for s in seqs if (
            s.target if kind is None else s.drafts[kind]).cache_len is not None])
        forget_caches(seqs, target=kind is None, drafts=() if kind is None else [kind])
        self.reconnect.schedule()

    def hand_off(self) -> bool:
        """Give every request to other engines, if there are any to take them."""
        handles = self.pool.handles()
        if not handles or self.handover is None:
            return False
        # Drafts may be shared with the adopting engines (one n-gram draft for every target
        # replica): release ours before another engine can prefill the same ids there.
        self._free_drafts(self.pool.active_sequences())
        return self.handover.move(self, handles)  # else they wait here (drafts refilled)

    def target_left(self) -> None:
        """The target is left on purpose (it drains or left) while it answers: free ours there
        and in the drafts, then wait for it like a lost one (a draining probe is no answer)."""
        active = self.pool.active_sequences()
        self._release_in(self.target, [s for s in active if s.target.cache_len is not None])
        self._free_drafts(active)
        forget_caches(active, target=True)  # released (or marked stale): the loss finds none
        self.target_up = False
        self._health_changed()
        self._lost(self.target)

    # ---- reconnection ---------------------------------------------------------------------------
    def retry_now(self) -> None:
        """Make the next `ensure` (on the engine thread) probe lost services at once."""
        self.reconnect.now()
        self.pool.wake()

    def ensure(self) -> bool:
        """Reconnect lost services when their retry is due; True when the target is usable."""
        if self.all_up() or not self.reconnect.due():
            return self.target_up
        if not self.target_up:
            self.target_up = self._reconnect(self.target, self._resync_target)
            if self.target_up:
                self.target_draining = False
                self._health_changed()
        for kind in self.kinds:
            if not kind.up and kind.replicas:
                kind.up = self._reconnect_draft(kind)
        if self.all_up():
            self.reconnect.settled()
        else:
            self.reconnect.schedule()
        return self.target_up

    def _reconnect_draft(self, kind: DraftKind) -> bool:
        """Try the kind's replicas in turn, starting with the current one."""
        for _ in range(len(kind.replicas)):
            # nothing to refill now: every row is cold there and prefilled when next picked
            if self._reconnect(kind.client, lambda: None):
                return True
            kind.next_replica()
        return False

    def _reconnect(self, client, resync) -> bool:
        info = self.reconnect.answer(client)
        if info is None or info.draining:
            return False
        try:
            client.reset()
            restarted = client.instance not in (None, info.instance_id)
            client.instance = info.instance_id
            if restarted:
                log.info("%s restarted (instance %s): it holds none of our caches",
                         client.address, info.instance_id)
            elif info.num_sequences:
                forget_stale(client, self._stale.get(client.address, set())
                             | set(self.pool.active))
            self._stale.pop(client.address, None)
            resync()
        except errors.Unavailable as error:
            log.info("%s still unavailable: %s", client.address, error)
            client.reset()
            return False
        log.info("%s is back: caches refilled from the coordinator's record", client.address)
        return True

    def _resync_target(self) -> None:
        seqs = self.pool.active_sequences()
        try:
            prefill_in_runs(self.target, seqs, self.config.max_prefill_tokens)
        except errors.ResourceExhausted:  # it fills up with other clients' sequences
            self._readmit(seqs)
            return
        for s in seqs:
            s.target.cache_len = s.committed_len - 1

    def _readmit(self, seqs: list[Sequence]) -> None:
        """Send active sequences back to the head of the queue, holding nothing anywhere:
        admission prefills them again from their committed tokens as capacity allows."""
        forget_stale(self.target, {s.seq_id for s in seqs})
        self._free_drafts(seqs)
        handles = self.pool.handles_of(seqs)
        for seq in seqs:
            self.pool.deactivate(seq)
        forget_caches(seqs, target=True)
        self.pool.requeue(handles)
        log.info("%s is full: %d requests wait to be admitted again", self.target.address,
                 len(handles))


def prefill_in_runs(client, seqs: list[Sequence], max_tokens: int,
                    features: bool = False) -> None:
    """Prefill from the committed record, one bounded command per run (with each token's
    features, for a draft that reads them). If a run fails, those before it stay cached
    there: the next reconnection releases them first."""
    for run in scheduler.split_by_tokens(seqs, max_tokens):
        client.prefill([s.prefill_entry() for s in run],
                       **(features_lib.prefill_args(run) if features else {}))


def forget_stale(client, seq_ids: set[int]) -> None:
    """The service kept running while its stream broke: drop what it still holds of
    ours (finished, cancelled or active sequences), since the record here is the truth.
    One command for all of them; a release is all-or-nothing, so if some are gone
    already, the rest go one by one."""
    if not seq_ids:
        return
    try:
        client.release(sorted(seq_ids))
        return
    except errors.NotFound:
        pass
    for seq_id in sorted(seq_ids):
        try:
            client.release([seq_id])
        except errors.NotFound:
            pass


def prefill_fresh(target, seqs: list[Sequence], active: list[Sequence],
                  chunk: int = 0) -> dict[int, int]:
    """Prefill fresh sequences in the target; those whose prompt another sequence caches or
    computes start from its cache (`shared_prompts`), and where a draft reads features every
    sequence keeps those of its positions. Prompts to score are scored as they are cached,
    once: before the sequence's first step (one command, copying nothing). A prompt longer
    than `chunk` (0: none) that no active sequence caches whole is cached up to its first
    `chunk` tokens. Returns {seq_id: positions cached} of those."""
    scoring = {s.seq_id: (s.prompt_logprobs_top, s.token_ids[-1]) for s in seqs
               if s.prompt_logprobs_top is not None and s.prompt_logprobs is None
               and s.stats.num_target_forward_passes == 0}
    if scoring:
        scored = target.prefill_scored([s.prefill_entry() for s in seqs], scoring)
        for s in seqs:
            s.prompt_logprobs = scored.get(s.seq_id, s.prompt_logprobs)
        return {}
    copies = shared_prompts(seqs, active)
    parts = {s.seq_id: chunk for s in seqs
             if chunk and s.committed_len - 1 > chunk and s.seq_id not in copies}
    # a prompt fed in chunks is no source within its own prefill: its copies are fed too
    for seq_id in [s for s, source in copies.items() if source in parts]:
        del copies[seq_id]
        parts[seq_id] = chunk
    if target.features_for_drafts:
        features_lib.prefill_target(target, seqs, copies, active, parts)
    else:
        target.prefill([s.prefill_entry(parts.get(s.seq_id)) for s in seqs], copies)
    return parts


def shared_prompts(new: list[Sequence], active: list[Sequence]) -> dict[int, int]:
    """{seq_id: source} for the new sequences whose prompt another sequence already caches
    in the target, or computes in the same prefill (n choices of one request, the same prompt
    asked again): they start from its cache instead of running the prompt again. Sources are
    active sequences (their cache holds the prompt, then what they generated) and new ones that
    are computed; only fresh sequences with more than a token to cache are copied."""
    sources: dict[int, list[Sequence]] = {}  # by prompt hash; a hit is compared in full
    for s in active:
        if s.target.cache_len is not None and not s.prefilling:
            sources.setdefault(s.prompt_hash, []).append(s)
    copies = {}
    for s in new:
        same = [t for t in sources.get(s.prompt_hash, []) if s.shares_prompt(t)]
        if same:
            copies[s.seq_id] = same[0].seq_id
        elif not s.num_generated:
            sources.setdefault(s.prompt_hash, []).append(s)
    return copies


def _describe(client) -> ModelInfo | None:
    """The service's ModelInfo, or None (logged) when it does not answer."""
    try:
        return client.describe()
    except errors.BatchspecError as error:
        log.warning("%s did not describe itself (%s): drafting K every step, no overlap",
                    client.address, error)
        return None
