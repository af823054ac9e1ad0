"""Logit bias and OpenAI's repetition penalties, on the target's logits before its choice.

At a row's output position j, token t's logit gains logit_bias[t] and loses
frequency_penalty * c + presence_penalty * (c > 0), where c counts t among the tokens the
sequence output before that position: its generated tokens up to the command
(VerifyRow.output_counts) and the outputs before j in the command (a verify's drafts, which
are output wherever position j is reached; a plain-steps command's own earlier choices).
Invariant: the adjustment of a position depends only on the tokens before it, so a verify, a
plain step and the target alone adjust a position the same way (the same float32 operations
on the same counts), and a seeded sample stays a function of its position.
"""
import torch

from batchspec.params import SamplingParams


def adjustments(params: SamplingParams, counts: dict[int, int] | None, before: list[int],
                positions: int, vocab_size: int, device) -> torch.Tensor:
    """[positions, vocab] float32: what position j's logits gain, counting before[:j] after
    `counts` (None: none)."""
    bias = torch.zeros(vocab_size)
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
    if not params.penalized:
        return bias.to(device).expand(positions, vocab_size)
    seen = torch.zeros(positions, vocab_size)
    if counts:
        seen[:, list(counts)] = torch.tensor(list(counts.values()), dtype=torch.float32)
    for j, token_id in enumerate(before[:positions - 1]):
        seen[j + 1:, token_id] += 1
    return (bias - params.frequency_penalty * seen
            - params.presence_penalty * (seen > 0).float()).to(device)


def adjusted(logits: torch.Tensor, rows, before: list[list[int]]) -> torch.Tensor:
    """logits [batch, positions, vocab] with each adjusting row's adjustments added (a copy
    where any row adjusts; the model's own logits stay as they are for log-probabilities).
    rows: VerifyRows; before[i]: the tokens row i outputs before its positions 1, 2, ..."""
    if not any(r.sampling.adjusts for r in rows):
        return logits
    logits = logits.clone()
    _, positions, vocab = logits.shape
    for i, r in enumerate(rows):
        if r.sampling.adjusts:
            logits[i] += adjustments(r.sampling, r.output_counts, before[i], positions, vocab,
                                     logits.device)
    return logits
