"""Per-request sampling settings, shared by the coordinator (no torch) and both services."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0
