"""Draft kinds: each a draft the coordinator can ask for proposals (a model, the n-gram
lookup), served by one or more replicas used one at a time, failing over in order.

Words: a *draft kind* is a `DraftKind` (named `kind`); its *index* (`kind.index`) is its
place in every per-kind list (`Sequence.drafts`, the goodput policy's costs, whose pure code
knows kinds only by index and so calls an index `kind`; what the drafting policy knows of a
kind is its policy.KindModel). A *cohort* is the sequences one step takes; the services run a
cohort's rows as one *batch*."""

from batchspec.ngram import NGRAM_MODEL


class DraftKind:
    """One draft kind: its replicas and whether the current one is reachable.

    `index` is its place in every Sequence.drafts list; `name` is the model its services
    reported (the address until they answer)."""

    def __init__(self, index: int, replicas: list):
        self.index = index
        self.replicas = list(replicas)
        self.current = 0
        self.up = True
        self.name = self.replicas[0].address if self.replicas else "(no replica)"
        self.full_until = 0.0  # refused new sequences for capacity: not asked before this
        # a feature-level head: it is fed the target's features of every token it is fed,
        # and its cache of its own drafts never holds committed positions (it computed them
        # from its own features, not the target's)
        self.reads_features = False

    @property
    def lookup(self) -> bool:
        """Whether its drafts are point masses looked up in the sequence (the n-gram draft):
        such a draft may be asked for a line (more tokens than a round verifies)."""
        return self.name == NGRAM_MODEL

    @property
    def client(self):
        return self.replicas[self.current]

    def next_replica(self) -> None:
        self.current = (self.current + 1) % max(1, len(self.replicas))

    def remove_replica(self, address: str):
        """Drop the replica at `address` (its client, or None if there is none), keeping
        `current` on the same replica when another one goes; with none left the kind is
        down."""
        where = [i for i, c in enumerate(self.replicas) if c.address == address]
        if not where:
            return None
        client = self.replicas.pop(where[0])
        self.current -= where[0] < self.current
        self.current %= max(1, len(self.replicas))
        self.up = self.up and bool(self.replicas)
        return client
