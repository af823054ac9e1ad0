"""Draft kinds: each a draft the coordinator can ask for proposals (a model, the n-gram
lookup), served by one or more replicas used one at a time, failing over in order."""


class DraftKind:
    """One draft kind: its replicas and whether the current one is reachable.

    `index` is its place in every Sequence.drafts list; `name` is the model its services
    reported (the address until they answer)."""

    def __init__(self, index: int, replicas: list):
        if not replicas:
            raise ValueError("a draft kind needs at least one replica")
        self.index = index
        self.replicas = list(replicas)
        self.current = 0
        self.up = True
        self.cost = None  # its goodput.ServiceCost, once calibrated
        # seconds of its cheapest measured command (the order drafts are asked in a step)
        self.unit_cost = float("inf")
        self.name = self.replicas[0].address

    @property
    def client(self):
        return self.replicas[self.current]

    def next_replica(self) -> None:
        self.current = (self.current + 1) % len(self.replicas)


def group_by_model(addresses: list[str], models: list[str]) -> list[list[str]]:
    """Draft addresses grouped into kinds by the model each serves, in first-seen order:
    replicas of one model form one kind."""
    kinds: dict[str, list[str]] = {}
    for address, model in zip(addresses, models):
        kinds.setdefault(model, []).append(address)
    return list(kinds.values())
