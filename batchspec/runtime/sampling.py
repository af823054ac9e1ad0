"""Verification of drafts: the vocabulary of speculation and the pure samplers.

Words, as used across batchspec:
- drafted tokens: the K tokens the draft model proposes for a sequence in one step;
- accepted tokens: the longest prefix of drafted tokens the target keeps;
- the target's choice at a position: the token the target alone would output there, given
  the tokens before it (`choose`);
- recovered token: the target's choice at the first rejected draft;
- bonus token: the target's choice after the last draft, when all of them are accepted;
- acceptance length: accepted tokens + 1 (the recovered or bonus token), so 1..K+1.

Sampling is Gumbel-max with noise keyed by (seed, position): the token a sampled row outputs
at sequence position t is argmax_i(log p'(i) + g_t(i)), p' the request's processed
distribution (temperature, top-k, top-p) and g_t a vector of independent standard Gumbel
variables that depends on the request's seed and t alone. That is an exact sample of p' at
every position, so the output is distributed exactly as the target's; and the target's choice
at each position is a function of the tokens before it, as with greedy decoding. A draft is
therefore verified for a sampled row exactly as for a greedy one (accepted while it equals the
target's choice), and a seeded request's tokens are what the target alone outputs for that
seed, whatever was drafted, by which kind, in which batch. A draft that samples with the same
noise proposes the target's choice wherever its own distribution is close enough (the
coupling of Daliri, Musco and Suresh, "Coupling without communication and drafter-invariant
speculative decoding", 2024: it matches with probability at least (1 - TV) / (1 + TV)).

Everything here is a pure function of tensors, settings and seeds; no model, no gRPC.
"""
import dataclasses

import numpy as np
import torch

# A uniform is never below this (its Gumbel variable stays finite): numpy's float32 uniforms
# are multiples of 2**-24 in [0, 1).
_SMALLEST_UNIFORM = 2.0 ** -25
# processed_logprobs looks for the end of a top-k / top-p set among this many most likely
# tokens first (a partial sort), and among four times as many where it lies further.
_FIRST_CANDIDATES = 64


@dataclasses.dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [batch] accepted drafts per row, 0..K
    output_token_ids: torch.Tensor  # [batch, K + 1]; row i's tokens are [:num_accepted[i] + 1]


def verify_choices(draft_token_ids: torch.Tensor, choices: torch.Tensor,
                   num_drafts: torch.Tensor | None = None) -> Verification:
    """Exact verification against the target's choices.

    draft_token_ids: [batch, K]; choices: [batch, K + 1], where position j holds the target's
    choice for the token after draft j - 1 (position 0: after the last committed token). A
    draft is accepted only while it equals the target's choice; the token after the accepted
    prefix is the target's choice there (recovered, or bonus when all of the row's drafts
    match). num_drafts: [batch] drafts each row really carries (<= K; the rest are padding,
    never accepted); None: all K.
    """
    width = draft_token_ids.shape[1]
    matches = draft_token_ids == choices[:, :width]  # [batch, K]
    matches &= _real(num_drafts, matches)
    num_accepted = matches.int().cumprod(dim=1).sum(dim=1)
    return Verification(num_accepted, choices)


def _real(num_drafts: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """[batch, K] True where a row's draft j is real (j < num_drafts[row])."""
    if num_drafts is None:
        return torch.ones_like(like, dtype=torch.bool)
    columns = torch.arange(like.shape[1], device=like.device)
    return columns[None, :] < num_drafts.to(like.device)[:, None]


def choose(logits: torch.Tensor, params, first_positions: list[int],
           lengths: list[int] | None = None) -> torch.Tensor:
    """The token each row outputs at each position, [batch, T] (long, on the logits' device).

    logits: [batch, T, vocab]; params: one SamplingParams per row; first_positions: the
    sequence position of each row's first logits row (position j of row i outputs the token
    at first_positions[i] + j). Greedy rows take the argmax; sampled rows the Gumbel-max
    sample of their processed distribution with the noise of (seed, position). lengths: how
    many leading positions of each row are read (None: all T); past them a sampled row holds
    the argmax, which costs no noise.
    """
    choices = logits.argmax(-1)
    width = logits.shape[1]
    for i, p in enumerate(params):
        if not p.greedy:
            n = width if lengths is None else min(width, lengths[i])
            scores = _sampled_scores(logits[i:i + 1, :n], [p], [first_positions[i]])
            choices[i, :n] = scores[0].argmax(-1)
    return choices


def _sampled_scores(logits: torch.Tensor, params, first_positions: list[int]) -> torch.Tensor:
    """log p' + g for sampled rows, [batch, T, vocab]: -inf outside each distribution's
    support, so the argmax is a token the request may output."""
    batch, width, vocab = logits.shape
    noise = torch.stack([gumbel_noise(p.seed, range(first, first + width), vocab)
                         for p, first in zip(params, first_positions)])
    return rows_logprobs(logits, params) + noise.to(logits.device)


def gumbel_noise(seed: int, positions, vocab: int) -> torch.Tensor:
    """[len(positions), vocab] float32 standard Gumbel variables that depend only on (seed,
    position) and the token index: the same in every process, on every device, whatever the
    batch. A counter-based generator (Philox) keyed by both, so no two (seed, position) pairs
    share a stream."""
    rows = []
    for position in positions:
        key = (int(seed) & (2**64 - 1)) | (int(position) << 64)
        uniforms = np.random.Generator(np.random.Philox(key=key)).random(vocab, dtype=np.float32)
        rows.append(torch.from_numpy(uniforms))
    u = torch.stack(rows).clamp_(min=_SMALLEST_UNIFORM)
    return u.log_().neg_().log_().neg_()


def rows_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """processed_logprobs with each row's settings taken from `params` (one SamplingParams per
    row, all sampled), built on the logits' device."""
    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=logits.device)
    return processed_logprobs(logits, per_row("temperature"), per_row("top_k"),
                              per_row("top_p"))


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a sampled request draws from, for every position.

    logits: [batch, T, vocab]; temperature (> 0), top_k, top_p: [batch]. Temperature first,
    then the top_k most likely tokens (0: all), then the smallest set of the most likely whose
    mass (within the top_k) reaches top_p (a token is kept while the mass before it is below
    top_p; 1: all). Returns float32 [batch, T, vocab], -inf outside the kept set, logsumexp 0
    along vocab.
    """
    scaled = logits.float() / temperature[:, None, None]
    vocab = scaled.shape[-1]
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()):
        return scaled.log_softmax(-1)
    # The kept set is a prefix of the tokens by descending probability: look for its end
    # among the few most likely first, and among more only where it lies further.
    limit = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab))
    by_k = (limit < vocab)[:, None, None]  # rows whose top_k set is within the candidates
    count = min(vocab, max([_FIRST_CANDIDATES] + limit[limit < vocab].tolist()))
    while True:
        values, order = scaled.topk(count, dim=-1)  # [batch, T, count], descending
        ranks = torch.arange(count, device=scaled.device)
        in_top_k = ranks[None, None, :] < limit[:, None, None]
        # top_p weighs the top_k set renormalised (all tokens where top_k is 0)
        norm = torch.where(by_k,
                           values.masked_fill(~in_top_k, float("-inf")).logsumexp(-1, True),
                           scaled.logsumexp(-1, keepdim=True))
        probs = (values - norm).exp()
        # (top_p 1 keeps all: float32 sums can reach 1 before the last token)
        keep = in_top_k & ((probs.cumsum(-1) - probs < top_p[:, None, None])
                           | (top_p >= 1)[:, None, None])
        if count == vocab or not bool((keep[..., -1:] & ~by_k).any()):
            break
        count = min(vocab, 4 * count)  # some row's kept set runs past the candidates
    kept = values.masked_fill(~keep, float("-inf"))
    out = torch.full_like(scaled, float("-inf"))
    return out.scatter_(-1, order, kept.log_softmax(-1))
