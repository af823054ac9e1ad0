"""Per-request sampling settings, shared by the coordinator (no torch) and both services."""
import dataclasses

# Temperatures below this decode greedily: logits over them leave float32's range, and the
# sample they describe is the argmax but for near ties (vLLM draws the same line).
GREEDY_BELOW = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens; temperature 0 (below GREEDY_BELOW) means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
