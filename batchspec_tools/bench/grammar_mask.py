"""A grammar as a transformers logits processor: the target alone under a constraint, the
reference that constrained answers are checked against. Straight from llguidance; it shares
nothing with the coordinator's grammar code."""
import torch


class GrammarMask:
    """For `generate` on one sequence: before each token, the matcher consumes what was
    generated since, and every token it does not allow gets -inf."""

    def __init__(self, matcher, prompt_len: int):
        self.matcher = matcher  # an llguidance.LLMatcher at the start of the answer
        self.prompt_len, self.seen = prompt_len, 0

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len:].tolist()
        assert self.matcher.consume_tokens(generated[self.seen:]), self.matcher.get_error()
        self.seen = len(generated)
        mask = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
        return scores.masked_fill(~bits[:scores.shape[-1]].to(scores.device), float("-inf"))
