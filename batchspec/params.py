"""Per-request sampling settings, shared by the coordinator (no torch) and both services."""
import dataclasses
import math

# Temperatures below this decode greedily: logits over them leave float32's range, and the
# sample they describe is the argmax but for near ties (vLLM draws the same line).
GREEDY_BELOW = 1e-5
# OpenAI's ranges: of presence_penalty and frequency_penalty, and of a logit bias.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens; temperature 0 (below GREEDY_BELOW) means greedy.

    Before temperature, top-k and top-p, the target's logits are adjusted (OpenAI's order):
    `logit_bias` ((token id, bias) pairs, ids ascending) added, then each token output before
    loses `frequency_penalty` per time output and `presence_penalty` once."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the tokens output before change a position's logits."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def adjusts(self) -> bool:
        """Whether the target's logits are adjusted before sampling at all."""
        return self.penalized or bool(self.logit_bias)


def logit_adjustments(presence_penalty: float, frequency_penalty: float,
                      logit_bias: dict[int, float],
                      vocab_size: int | None = None) -> tuple[str, str] | None:
    """What is wrong with these settings, as (field, message) (None: nothing): each penalty a
    finite number in [-MAX_PENALTY, MAX_PENALTY], each bias one in [-MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS] on a token id in the vocabulary (when `vocab_size` is known)."""
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if not (math.isfinite(value) and abs(value) <= MAX_PENALTY):
            return name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], not {value}"
    for token_id, bias in logit_bias.items():
        if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            return "logit_bias", (f"logit_bias of token {token_id} must be in "
                                  f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], not {bias}")
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            return "logit_bias", (f"logit_bias names token {token_id}, outside the vocabulary"
                                  + (f" [0, {vocab_size})" if vocab_size is not None else ""))
    return None
