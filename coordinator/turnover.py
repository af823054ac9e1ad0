"""How one engine's services come and go on purpose, beside losses (peers.py): a service that
drains (SIGTERM) or leaves the membership, a draft replica that joins, a target full with other
coordinators' sequences. Engine thread only; membership changes are posted to it.

Invariants: a target is left only once another engine takes its requests (until then it still
serves the sequences it holds and admits nothing); what a leaving service holds of ours is
released while it still answers; capacity refusals never fail a request, they make admission
smaller and later.
"""
import logging
import queue
import time

from coordinator.clients import Probe
from coordinator.drafts import DraftKind
from coordinator.peers import FULL_BACKOFF_S, Peers
from coordinator.pool import RequestPool

log = logging.getLogger(__name__)

# How often an engine asks its target and current drafts, off its thread, whether they drain.
WATCH_EVERY_S = 1.0


class Turnover:
    def __init__(self, peers: Peers, pool: RequestPool, max_num_seqs: int):
        self.peers = peers
        self.pool = pool
        self.handover = peers.handover
        self.max_num_seqs = max_num_seqs
        self.full_until = 0.0  # the target refused new sequences for capacity: not before
        self._full_spell = False  # refusals since the last admission that went through
        # most requests one admission takes: halved while the target refuses new sequences
        # for capacity, doubled back after each admission that went through; None: no cap
        self.admit_cap: int | None = None
        self._watches: dict[str, Probe] = {}  # service address -> its draining check
        self._next_watch = 0.0
        # membership changes, run on the engine thread before its next step (see post)
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self.removed = False  # the target left the membership: the engine moves its work, ends

    # ---- from any thread ------------------------------------------------------------------------
    def post(self, action) -> None:
        """Run action() on the engine thread before its next step: how membership changes
        reach the engine's peers, which only its thread touches."""
        self._posted.put(action)
        self.pool.wake()

    def remove(self) -> None:
        """The target left the membership: the engine moves its requests to the other
        engines once one takes them, frees its caches, and ends."""
        self.removed = True
        self.post(lambda: None)

    def idle(self) -> bool:
        """Nothing posted and not removed: the engine thread may sleep."""
        return self._posted.empty() and not self.removed

    # ---- engine thread --------------------------------------------------------------------------
    def run_posted(self) -> None:
        while not self._posted.empty():
            self._posted.get()()

    def may_admit(self) -> bool:
        """A draining target takes no new sequence, a full one not yet."""
        return not self.peers.target_draining and time.monotonic() >= self.full_until

    def watch(self) -> None:
        """Act on the last draining checks of the target and each kind's current replica
        and start the next ones, at most every WATCH_EVERY_S (probes run on gRPC's threads:
        the engine never waits for them)."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_EVERY_S
        watched = [(self.peers.target, self.peers.target_up, self._target_draining)]
        watched += [(kind.client, kind.up, lambda kind=kind: self.peers.draft_leaving(kind))
                    for kind in self.peers.kinds if kind.replicas]
        for client, up, on_draining in watched:
            probe = self._watches.get(client.address)
            if probe is not None and not probe.done():
                continue
            info = probe.info() if probe is not None else None
            if up and info is not None and info.draining \
                    and client.instance in (None, info.instance_id):
                on_draining()
            self._watches[client.address] = client.probe(timeout=5.0)

    def _target_draining(self) -> None:
        if not self.peers.target_draining:
            log.info("target %s is draining: no new sequence there", self.peers.target.address)
        self.peers.target_draining = True

    def target_leaving(self) -> bool:
        """The target drains (or left the membership): move every request to the other
        engines, freeing what it holds of ours first. False, with nothing changed, while no
        other engine takes new work: the target still serves the sequences it holds."""
        if self.handover is None or not self.handover.others_accepting(self.peers):
            return False
        handles = self.pool.handles()
        self.peers.target_left()
        if handles:
            self.handover.move(self.peers, handles)
        log.info("target %s is leaving: %d requests moved to other replicas",
                 self.peers.target.address, len(handles))
        return True

    def moved_away(self) -> bool:
        """A removed engine's requests went to the other engines (True), or it had none."""
        if self.pool.idle():
            return True
        return self.target_leaving() if self.peers.target_up else self.peers.hand_off()

    def end(self, engine) -> None:
        """The removed `engine`, its requests moved, closes its connections and leaves the
        engines (the handover keeps its counters)."""
        peers = self.peers
        for client in [peers.target] + [c for kind in peers.kinds for c in kind.replicas]:
            client.close()
        if self.handover is not None:
            self.handover.ended(engine)
        log.info("engine of target %s ended: it left the membership", self.peers.target.address)

    def target_full(self, error, num_refused: int) -> None:
        """The target refused `num_refused` new sequences for capacity (it serves other
        coordinators too): the waiting requests go to another engine that takes them, or wait
        here; admission is asked again after FULL_BACKOFF_S, for half as many (a command is
        all or nothing)."""
        self.admit_cap = max(1, num_refused // 2)
        self.full_until = time.monotonic() + FULL_BACKOFF_S
        self.peers.recorder.stats.num_capacity_waits += 1
        waiting = [h for h in self.pool.handles() if h.seq.seq_id not in self.pool.active]
        moved = bool(waiting) and self.handover is not None \
            and self.handover.move(self.peers, waiting)
        # logged once per spell: a full target is asked again every FULL_BACKOFF_S
        (log.debug if self._full_spell else log.info)(
            "target %s is full (%s): %s", self.peers.target.address, error,
            f"{len(waiting)} waiting requests moved" if moved else "requests wait")
        self._full_spell = True

    def admitted(self) -> None:
        """An admission went through: a spell of capacity refusals, if any, is over."""
        if self.admit_cap is not None:
            self.admit_cap = min(2 * self.admit_cap, self.max_num_seqs)
        self._full_spell = False

    def add_draft_replica(self, index: int, client, preferred: str | None = None) -> None:
        """A replica of draft kind `index` appeared; then use the replica at `preferred`
        (spreading engines over the replicas) if it is not the one in use."""
        kind = self.peers.kinds[index]
        kind.replicas.append(client)
        if len(kind.replicas) == 1:  # the kind had none: probe it before use
            kind.current, kind.up = 0, False
            self.peers.reconnect.schedule(soon=True)
        if preferred is not None and kind.client.address != preferred:
            self._switch_replica(kind, preferred)

    def remove_draft_replica(self, address: str) -> None:
        """A draft replica left the membership: what it holds of ours is freed (if it still
        answers) and rows are drafted by the kind's other replicas, or by no draft."""
        for kind in self.peers.kinds:
            if kind.replicas and kind.client.address == address and kind.up:
                self.peers.draft_leaving(kind)
            client = kind.remove_replica(address)
            if client is not None:
                client.close()
        self.peers.replica_gone(address)

    def _switch_replica(self, kind: DraftKind, address: str) -> None:
        if kind.up:
            self.peers.draft_leaving(kind)  # frees ours there and probes before the next use
        kind.current = next(i for i, c in enumerate(kind.replicas) if c.address == address)
