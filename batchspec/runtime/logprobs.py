"""Log-probabilities of tokens under a model: log-softmax of its logits (before temperature,
top-k and top-p), and the most likely tokens at each position."""
import dataclasses

import torch

from batchspec import errors

MAX_TOP = 20  # most alternatives per position (OpenAI's limit for top_logprobs)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top_token_ids: list[int]  # most likely first
    top_logprobs: list[float]


def check_num_top(num_top: int) -> None:
    if not 0 <= num_top <= MAX_TOP:
        raise errors.InvalidArgument(f"num_top must be in [0, {MAX_TOP}], not {num_top}")


def score(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits [n, vocab]: position i scores token_ids[i]; num_top alternatives each."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()
    if num_top:
        top = logp.topk(num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in token_ids]
    return [TokenLogprobs(c, i, v) for c, i, v in zip(chosen, top_ids, top_values)]
