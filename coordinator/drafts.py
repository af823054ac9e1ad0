"""Draft kinds: each a draft the coordinator can ask for proposals (a model, the n-gram
lookup), served by one or more replicas used one at a time, failing over in order.

Words: a *draft kind* is a `DraftKind` (named `kind`); its *index* (`kind.index`) is its
place in every per-kind list (`Sequence.drafts`, the goodput policy's costs, whose pure code
knows kinds only by index and so calls an index `kind`). A *cohort* is the sequences one step
takes; the services run a cohort's rows as one *batch*."""

# A draft asked before planning (a lookup) is asked every step while at least this share of
# recent asks (an exponential average, DECAY per ask) had a row drafting with what it
# offered; below, every IDLE_ASK_EVERY-th step, so it keeps gathering evidence. On prompts
# it rarely matches, at large batches, that saves a command per step that no plan used.
ASK_USE_FLOOR = 0.125
ASK_USE_DECAY = 0.9
IDLE_ASK_EVERY = 4


class DraftKind:
    """One draft kind: its replicas and whether the current one is reachable.

    `index` is its place in every Sequence.drafts list; `name` is the model its services
    reported (the address until they answer)."""

    def __init__(self, index: int, replicas: list):
        self.index = index
        self.replicas = list(replicas)
        self.current = 0
        self.up = True
        self.cost = None  # its goodput.ServiceCost, once calibrated
        # seconds of its cheapest measured command (the order drafts are asked in a step)
        self.unit_cost = float("inf")
        self.name = self.replicas[0].address if self.replicas else "(no replica)"
        self.ask_use = 1.0  # recent share of asks before planning that a plan drafted with
        self.asks_skipped = 0  # steps since it was last asked before planning, while idle
        self.full_until = 0.0  # refused new sequences for capacity: not asked before this
        # a feature-level head: it is fed the target's features of every token it is fed,
        # and its cache of its own drafts never holds committed positions (it computed them
        # from its own features, not the target's)
        self.reads_features = False
        # its probabilities of its drafts track their acceptance (ModelInfo.calibrated): its
        # drafts are cut where they stop paying (goodput.break_even_confidence)
        self.calibrated = False

    @property
    def client(self):
        return self.replicas[self.current]

    def ask_due(self) -> bool:
        """Whether to ask it before planning this step (called once per step)."""
        if self.ask_use >= ASK_USE_FLOOR or self.asks_skipped + 1 >= IDLE_ASK_EVERY:
            self.asks_skipped = 0
            return True
        self.asks_skipped += 1
        return False

    def asked(self, used: bool) -> None:
        """Record whether the plan drafted any row with what it offered."""
        self.ask_use = ASK_USE_DECAY * self.ask_use + (1 - ASK_USE_DECAY) * used

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
