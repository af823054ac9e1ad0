"""Verification of drafts: the vocabulary of speculation and the pure samplers.

Words, as used across batchspec:
- drafted tokens: the K tokens the draft model proposes for a sequence in one step;
- accepted tokens: the longest prefix of drafted tokens the target keeps;
- recovered token: the target's replacement at the first rejection (argmax(p) when greedy,
  a sample of norm(max(0, p - q)) when sampling);
- bonus token: the target's own next token when all K drafts are accepted;
- acceptance length: accepted tokens + 1 (the recovered or bonus token), so 1..K+1.

Everything here is a pure function of tensors with the randomness passed in; no model, no gRPC.
"""
import dataclasses
import random

import torch


@dataclasses.dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [batch] accepted drafts per row, 0..K
    output_token_ids: torch.Tensor  # [batch, K + 1]; row i's tokens are [:num_accepted[i] + 1]


def greedy_verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> Verification:
    """Exact greedy verification.

    draft_token_ids: [batch, K]; target_logits: [batch, K + 1, vocab], where position j holds
    the target's logits for the token after draft j - 1 (position 0: after the last committed).
    A draft is accepted only while it equals the target's argmax; the token after the accepted
    prefix is the target's argmax there (recovered, or bonus when all of the row's drafts match).
    num_drafts: [batch] drafts each row really carries (<= K; the rest are padding, never
    accepted); None: all K.
    """
    target_token_ids = target_logits.argmax(dim=-1)  # [batch, K + 1]
    width = draft_token_ids.shape[1]
    matches = draft_token_ids == target_token_ids[:, :width]  # [batch, K]
    matches &= _real(num_drafts, matches)
    num_accepted = matches.int().cumprod(dim=1).sum(dim=1)
    return Verification(num_accepted, target_token_ids)


def _real(num_drafts: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """[batch, K] True where a row's draft j is real (j < num_drafts[row])."""
    if num_drafts is None:
        return torch.ones_like(like, dtype=torch.bool)
    columns = torch.arange(like.shape[1], device=like.device)
    return columns[None, :] < num_drafts.to(like.device)[:, None]


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                     final_uniforms: torch.Tensor,
                     num_drafts: torch.Tensor | None = None) -> Verification:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_token_ids: [batch, K]; draft_probs q: [batch, K, vocab], the distributions the drafts
    were sampled from; target_probs p: [batch, K + 1, vocab]; accept_uniforms: [batch, K] in
    (0, 1]; final_uniforms: [batch] in (0, 1]. num_drafts: [batch] drafts each row really
    carries (None: all K); a row with n < K drafts is verified exactly as if K were n (its
    padding is never accepted, and its bonus token is sampled from p at position n).

    Draft j is accepted when u_j * q(x_j) <= p(x_j), i.e. with probability min(1, p/q), and only
    if every earlier draft was. At the first rejection the recovered token is sampled from
    norm(max(0, p - q)) (from p when that residual is all zero); when all K are accepted the
    bonus token is sampled from p at position K. One-hot p and q make this exact greedy.
    """
    batch, width = draft_token_ids.shape
    index = draft_token_ids.unsqueeze(-1)
    p_draft = target_probs[:, :width].gather(-1, index).squeeze(-1)  # [batch, K]
    q_draft = draft_probs.gather(-1, index).squeeze(-1)  # [batch, K]
    real = _real(num_drafts, draft_token_ids)
    accepted = (accept_uniforms * q_draft <= p_draft) & real
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # [batch]

    # q zeroed past each row's real drafts (and padded at position K), so the "residual" at a
    # row's own end is p itself (the bonus).
    q_padded = torch.cat([draft_probs * real[..., None],
                          draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], 1)
    rows = torch.arange(batch, device=draft_token_ids.device)
    p_final = target_probs[rows, num_accepted]  # [batch, vocab]
    residual = (p_final - q_padded[rows, num_accepted]).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_final, residual)
    final_token_ids = sample_inverse_cdf(residual, final_uniforms)

    output = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=1)
    output[rows, num_accepted] = final_token_ids
    return Verification(num_accepted, output)


def sample_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of non-negative weights [batch, vocab] (need not sum to 1),
    given uniforms [batch] in (0, 1]. A zero-weight index is never returned."""
    cdf = weights.double().cumsum(dim=-1)  # [batch, vocab]
    targets = uniforms.double() * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets.unsqueeze(-1)).squeeze(-1)
    return picked.clamp_max(weights.shape[-1] - 1)


def rows_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """processed_probs with each row's settings taken from `params` (one SamplingParams per
    row), built on the logits' device."""
    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=logits.device)
    return processed_probs(logits, per_row("temperature"), per_row("top_k"), per_row("top_p"))


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """The distribution a request samples from, for every position.

    logits: [batch, T, vocab]; temperature, top_k, top_p: [batch]. Temperature 0 gives the
    one-hot argmax (greedy); top_k 0 and top_p 1 disable those filters. Returns float32
    [batch, T, vocab] summing to 1 along vocab.
    """
    logits = logits.float()
    greedy = temperature <= 0
    safe_temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_temp[:, None, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = ranks[None, None, :] < k[:, None, None]
    sorted_probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = keep & (mass_before < top_p[:, None, None])
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.empty_like(scaled).scatter_(-1, order, sorted_logits.softmax(dim=-1))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    return torch.where(greedy[:, None, None], one_hot, probs)


def sampling_uniforms(seed: int, positions, stream: int):
    """Uniforms in (0, 1], one per position, that depend only on (seed, position, stream):
    seeded requests repeat whatever their batch mates and group sizes are."""
    return [1.0 - random.Random(hash((seed, int(p), stream))).random() for p in positions]
