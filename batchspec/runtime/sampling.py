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
import math

import numpy as np
import torch

from batchspec.runtime import gguf_blocks

# The most likely tokens looked at first (a partial sort): processed_logprobs looks for the
# end of a top-k / top-p set among them (among four times as many where it lies further), and
# gumbel_max scores them before bounding the rest.
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
           lengths: list[int] | None = None,
           token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The token each row outputs at each position, [batch, T] (long, on the logits' device).

    logits: [batch, T, vocab]; params: one SamplingParams per row; first_positions: the
    sequence position of each row's first logits row (position j of row i outputs the token
    at first_positions[i] + j). Greedy rows take the argmax; sampled rows the Gumbel-max
    sample of their processed distribution with the noise of (seed, position), every sampled
    position of the batch at once. lengths: how many leading positions of each row are read
    (None: all T); past them a sampled row holds the argmax, which costs no noise.
    token_ids [vocab']: the token of each logits column, where the logits cover only those
    (a draft's own vocabulary; every other token's logit is -inf); None: column i is token i.
    """
    batch, width, vocab = logits.shape
    cells = [(i, j) for i, p in enumerate(params) if not p.greedy
             for j in range(width if lengths is None else min(width, lengths[i]))]
    if not cells:
        return _token(logits.argmax(-1), token_ids)
    positions = np.array([first_positions[i] + j for i, j in cells], dtype=np.uint64)
    sampled = [params[i] for i, _ in cells]
    if len(cells) == batch * width:  # every cell sampled: no argmax, no copy
        return gumbel_max(logits.reshape(batch * width, vocab), sampled, positions,
                          token_ids).reshape(batch, width)
    choices = _token(logits.argmax(-1), token_ids)
    rows, columns = (torch.tensor(c, device=logits.device) for c in zip(*cells))
    choices[rows, columns] = gumbel_max(logits[rows, columns], sampled, positions, token_ids)
    return choices


def _token(columns: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """The tokens of logits columns (see choose's token_ids)."""
    return columns if token_ids is None else token_ids[columns]


# The largest Gumbel variable `gumbel` returns: its uniforms are (k + 1/2) / 2**24 for a
# 24-bit k, so none exceeds -log(-log(1 - 2**-25)) (about 17.33).
G_MAX = -math.log(-math.log1p(-2.0 ** -25))
# Scores are float32 sums: a token left out by a margin this much wider than G_MAX cannot
# reach the winner's score after rounding either.
_SLACK = 1.0


def gumbel_max(logits: torch.Tensor, params, positions: np.ndarray,
               token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[N] long: for N logits rows [N, vocab], each with its SamplingParams and sequence
    position, the argmax over the row's kept set (its processed distribution's support) of
    logit / temperature + gumbel(seed, position, token); the lowest token on a tie. log p'
    differs from logit / temperature by a constant per row, so this is the Gumbel-max
    sample of p'; and each score is one division and one sum, whatever else the batch holds.

    On a CPU with the block kernels built, one C++ pass a row (csrc/sample_ops.h): the same
    noise and scores, so the same choice but where a token's mass before lies within float32
    rounding of top_p (the kernel rounds the set's norm its own way), or tokens tie at the end
    of a top-k set (the kernel keeps the lower ones, torch's topk any); elsewhere
    gumbel_max_torch."""
    if logits.device.type == "cpu" and gguf_blocks.load():
        return torch.ops.batchspec_gguf.gumbel_choose(
            logits.float().contiguous(), *settings(params),
            torch.from_numpy(seeds(params).view(np.int64)),
            torch.from_numpy(np.asarray(positions, dtype=np.uint64).view(np.int64)),
            None if token_ids is None else token_ids.to(torch.long).contiguous())
    return gumbel_max_torch(logits, params, positions, token_ids)


def settings(params, device: torch.device | str = "cpu"):
    """Each row's (temperature float32, top_k int64, top_p float32), [N] tensors on device."""
    return (torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                         device=device),
            torch.tensor([int(p.top_k) for p in params], dtype=torch.long, device=device),
            torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device))


def seeds(params) -> np.ndarray:
    """Each row's seed as the noise takes it: [N] uint64."""
    return np.array([int(p.seed) & (2**64 - 1) for p in params], dtype=np.uint64)


def gumbel_max_torch(logits: torch.Tensor, params, positions: np.ndarray,
                     token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """gumbel_max in torch operations, on any device.

    Noise is computed only where it can win. The most likely tokens are scored first; `best`,
    the largest score of those kept, bounds the rest: a token whose scaled logit is below
    best - G_MAX scores below it whatever its noise. Under top-k, or top-p that keeps a few
    tokens, the kept set lies among the first; elsewhere only the tokens above that bound are
    scored, not the vocabulary. Each row's logits are read whole about twice: for its most
    likely tokens, and for top-p's mass or that bound. token_ids: as choose's (noise and ties
    go by the token, not the column)."""
    device, vocab = logits.device, logits.shape[-1]
    keys = seeds(params)
    temperature, top_k, top_p = settings(params, device)
    limit = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab))
    count = min(vocab, max([_FIRST_CANDIDATES] + limit[limit < vocab].tolist()))
    values, ids = logits.topk(count, dim=-1)  # [N, count], descending (as when scaled)
    ids = _token(ids, token_ids)
    values = values.float() / temperature[:, None]
    whole = (limit >= vocab) & (top_p >= 1)  # rows that keep every token
    keep = whole[:, None].expand(-1, count)
    norm = None
    if not bool(whole.all()):
        norm = _norms(values, limit, vocab, lambda: (logits.float() / temperature[:, None])
                      .logsumexp(-1, keepdim=True))
        keep = keep | kept_prefix(values, norm, limit, top_p,
                                  torch.arange(count, device=device))
    cells = keep.nonzero(as_tuple=True)
    out, best = _argmax_cells(len(params), cells[0], ids[cells], values[cells], keys,
                              positions)
    # rows whose kept set may run past the candidates (never under top-k: count covers it)
    beyond = keep[:, -1] & (limit >= vocab) & (count < vocab)
    if bool(beyond.any()):
        rows = beyond.nonzero().squeeze(1)
        t = temperature[rows, None]
        cells = (logits[rows] >= (best[rows, None] - (G_MAX + _SLACK)) * t).nonzero(
            as_tuple=True)
        scaled = logits[rows][cells].float() / t[cells[0], 0]
        kept = _kept_cells(scaled, cells[0], None if norm is None else norm[rows],
                           top_p[rows])
        taken = rows.cpu().numpy()
        out[rows] = _argmax_cells(len(rows), cells[0][kept], _token(cells[1], token_ids)[kept],
                                  scaled[kept], keys[taken], positions[taken])[0]
    return out


_NO_TOKEN = torch.iinfo(torch.long).max


def _norms(values: torch.Tensor, limit: torch.Tensor, vocab: int, whole) -> torch.Tensor:
    """[N, 1] the logsumexp of scaled logits that top-p weighs by: over the top-k set (the
    first `limit` of values [N, C], scaled), or where top-k keeps all (limit `vocab`) over the
    whole vocabulary: whole(), asked only then."""
    ranks = torch.arange(values.shape[-1], device=values.device)
    within = values.masked_fill(ranks[None, :] >= limit[:, None], float("-inf"))
    by_k = limit < vocab
    if bool(by_k.all()):
        return within.logsumexp(-1, True)
    return torch.where(by_k[:, None], within.logsumexp(-1, True), whole())


def kept_prefix(values: torch.Tensor, norm: torch.Tensor, limit: torch.Tensor,
                top_p: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """[N, C] bool: which of each row's most likely tokens (values [N, C], descending, of
    ranks [C] in the vocabulary's descending order) top-k and top-p keep: the first limit
    tokens (top-k), and of those the ones the mass before which is below top_p (top-p, the
    mass renormalised by norm [N, 1]; 1: all, as float32 sums can reach 1 early)."""
    probs = (values - norm).exp()
    return (ranks[None, :] < limit[:, None]) & ((probs.cumsum(-1) - probs < top_p[:, None])
                                                | (top_p >= 1)[:, None])


def _kept_cells(scaled: torch.Tensor, rows: torch.Tensor, norm: torch.Tensor | None,
                top_p: torch.Tensor) -> torch.Tensor:
    """Which cells (each of row rows[c], scaled logit scaled[c]) of rows without top-k are in
    their top-p set (norm [rows, 1] its logsumexp; None: every row keeps all). A cell's mass
    before it is that of the tokens above it, all of them cells too (cells are every token
    above a bound), so sorting each row's cells gives it exactly."""
    kept = torch.ones_like(rows, dtype=torch.bool)
    for r in (top_p < 1).nonzero().squeeze(1).tolist():
        mine = (rows == r).nonzero().squeeze(1)
        values, order = scaled[mine].sort(descending=True, stable=True)
        ranks = torch.arange(len(mine), device=scaled.device)
        kept[mine[order]] = kept_prefix(values[None], norm[r:r + 1], ranks[-1:] + 1,
                                        top_p[r:r + 1], ranks)[0]
    return kept


def _argmax_cells(num_rows: int, rows: torch.Tensor, tokens: torch.Tensor,
                  scaled: torch.Tensor, seeds: np.ndarray, positions: np.ndarray):
    """([num_rows] the token of greatest scaled + gumbel among each row's cells (rows[c],
    tokens[c], scaled[c]), the lowest token on a tie; [num_rows] that score); every row has
    a cell."""
    taken = rows.cpu().numpy()
    scores = scaled + torch.from_numpy(
        gumbel(seeds[taken], positions[taken], tokens.cpu().numpy())).to(scaled.device)
    top = scores.new_full((num_rows,), float("-inf")).scatter_reduce(0, rows, scores, "amax")
    winners = torch.where(scores == top[rows], tokens, _NO_TOKEN)
    return tokens.new_full((num_rows,), _NO_TOKEN).scatter_reduce(0, rows, winners,
                                                                  "amin"), top


# murmur3's 64-bit finalizer constants, and a golden-ratio key for seeds
_MIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """murmur3's fmix64 of every uint64 of x (wrapping arithmetic): each output bit depends
    on every input bit."""
    shift = np.uint64(33)
    x = x ^ (x >> shift)
    x = x * _MIX[0]
    x = x ^ (x >> shift)
    x = x * _MIX[1]
    return x ^ (x >> shift)


def gumbel(seeds, positions, token_ids) -> np.ndarray:
    """Standard Gumbel variables g(seed, position, token), float32, elementwise over the
    broadcast shapes of the three (integer arrays or ints; seeds as uint64, positions below
    2**32): the same in every process, on every device, whatever else is asked. Each is a
    hash of the three integers (murmur3's finalizer, twice, keyed by the seed) whose top 24
    bits make a uniform (k + 1/2) / 2**24, so no variable exceeds G_MAX."""
    with np.errstate(over="ignore"):
        key = _mix(np.asarray(seeds, dtype=np.uint64) ^ _GOLDEN)
        cells = (np.asarray(positions, dtype=np.uint64) << np.uint64(32)) \
            | np.asarray(token_ids, dtype=np.uint64)
        hashed = _mix(_mix(cells ^ key) + key)
    uniforms = ((hashed >> np.uint64(40)).astype(np.float64) + 0.5) * 2.0 ** -24
    return (-np.log(-np.log(uniforms))).astype(np.float32)


def rows_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """processed_logprobs with each row's settings taken from `params` (one SamplingParams per
    row, all sampled), built on the logits' device."""
    return processed_logprobs(logits, *settings(params, logits.device))


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """The log-probabilities a sampled request draws from, for every position.

    logits: [batch, T, vocab]; temperature (> 0), top_k, top_p: [batch]. Temperature first,
    then the top_k most likely tokens (0: all), then the smallest set of the most likely whose
    mass (within the top_k) reaches top_p (kept_prefix). Returns float32 [batch, T, vocab],
    -inf outside the kept set, logsumexp 0 along vocab.
    """
    scaled = logits.float() / temperature[:, None, None]
    if bool((top_k <= 0).all()) and bool((top_p >= 1).all()):
        return scaled.log_softmax(-1)
    batch, width, vocab = scaled.shape
    flat = scaled.reshape(batch * width, vocab)
    top_k, top_p = top_k.repeat_interleave(width), top_p.repeat_interleave(width)
    limit = torch.where(top_k > 0, top_k.clamp_max(vocab), torch.full_like(top_k, vocab))
    whole = flat.logsumexp(-1, keepdim=True) if bool((limit >= vocab).any()) else None
    # The kept set is a prefix of the tokens by descending probability: look for its end
    # among the few most likely first, and among more only where it lies further.
    count = min(vocab, max([_FIRST_CANDIDATES] + limit[limit < vocab].tolist()))
    while True:
        values, order = flat.topk(count, dim=-1)  # [rows, count], descending
        keep = kept_prefix(values, _norms(values, limit, vocab, lambda: whole), limit, top_p,
                           torch.arange(count, device=flat.device))
        if count == vocab or not bool((keep[:, -1] & (limit >= vocab)).any()):
            break
        count = min(vocab, 4 * count)  # some row's kept set runs past the candidates
    logprobs = values.masked_fill(~keep, float("-inf")).log_softmax(-1)
    out = torch.full_like(flat, float("-inf"))
    return out.scatter_(-1, order, logprobs).reshape(batch, width, vocab)
