"""Verification of a group's drafts in one target forward pass; plain decoding of several
steps, or several rounds of drafting and verifying, in one command."""
import collections
import dataclasses

import torch

from batchspec import errors
from batchspec.runtime import adjust, sampling
from batchspec.runtime import logprobs as logprobs_lib
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import VerifiedRow, VerifyRow


def verify(runner: runner_lib.ModelRunner, rows: list[VerifyRow], *, realign: bool,
           keep_features: bool = False):
    """Run [append + drafts] through the target for every row and accept per row.

    Rows may carry different numbers of drafts (0 included: plain decoding for that row);
    shorter rows are padded out to the longest, and padding is never accepted. Causal
    attention keeps the padding from touching any real position, and where the runner packs
    positions the linear layers skip it (a row costs its own drafts, not the widest row's).

    Cache invariant on return: each row's cache holds its committed tokens but the last,
    where committed now includes the accepted drafts and the one new token; the rejected
    drafts' (and the padding's) positions are dropped before the caches are stored.
    """
    width = max(len(r.draft_token_ids) for r in rows)
    for r in rows:
        runner.check_token_ids(r.draft_token_ids, f"drafts of sequence {r.seq_id}")
    specs = [runner_lib.RowSpec(r.seq_id, r.expected_cache_len, r.expected_cache_len,
                                r.append_token_ids) for r in rows]
    group = runner.open_group(specs, realign=realign, extra_positions=width)
    padded = [r.draft_token_ids + [0] * (width - len(r.draft_token_ids)) for r in rows]
    input_ids = torch.tensor([r.append_token_ids + d for r, d in zip(rows, padded)])
    real = [len(r.append_token_ids) + len(r.draft_token_ids) for r in rows]
    valid = torch.arange(input_ids.shape[1])[None, :] < torch.tensor(real)[:, None]
    # [batch, K + 1, vocab]; zeros past each row's drafts (packed), never read: see accept
    logits = group.step(input_ids, num_logits=width + 1, valid=valid, keep_hidden=keep_features)
    drafts = torch.tensor(padded, dtype=torch.long).reshape(len(rows), width)
    counts = torch.tensor([len(r.draft_token_ids) for r in rows])
    chosen_from = masked(adjust.adjusted(logits, rows, [r.draft_token_ids for r in rows]), rows)
    result = accept(rows, drafts, chosen_from, counts)
    num_accepted = result.num_accepted.tolist()
    base = [r.expected_cache_len + len(r.append_token_ids) for r in rows]
    cache_lens = [b + n for b, n in zip(base, num_accepted)]
    runner.store([r.seq_id for r in rows], group.rows_after(cache_lens))
    outputs = [out[:n + 1] for out, n in zip(result.output_token_ids.tolist(), num_accepted)]
    # output j of a row is scored by the row's position j of the returned logits
    scored = [None if r.num_top is None else logprobs_lib.score(logits[i, :len(out)], out,
                                                                 r.num_top)
              for i, (r, out) in enumerate(zip(rows, outputs))]
    # the positions a row caches are its first (cache_len - expected_cache_len) fed ones
    features = [group.hidden[i, :c - r.expected_cache_len].float().cpu() if keep_features
                else None for i, (r, c) in enumerate(zip(rows, cache_lens))]
    return [VerifiedRow(r.seq_id, n, out, c, lp, f) for r, n, out, c, lp, f
            in zip(rows, num_accepted, outputs, cache_lens, scored, features)], group


def decode(runner: runner_lib.ModelRunner, rows: list[VerifyRow], steps: int, *,
           realign: bool, keep_features: bool = False):
    """`steps` plain steps of rows that carry no drafts, each row fed its own output of the
    step before, over one group: (one VerifiedRow a row, its outputs, log-probabilities and
    features those of every step in order; the group forwards run). Each output is the
    target's choice at its position (sampling.choose, as `accept` takes it for a row of no
    drafts), so it is what one step a command gives. Cache on return: each row's appended
    tokens and every output but the last."""
    if steps == 1:
        verified, group = verify(runner, rows, realign=realign, keep_features=keep_features)
        return verified, [group]
    if any(r.draft_token_ids or r.token_masks is not None for r in rows):
        raise ValueError("plain steps carry no drafts or token masks")
    specs = [runner_lib.RowSpec(r.seq_id, r.expected_cache_len, r.expected_cache_len,
                                r.append_token_ids) for r in rows]
    group = runner.open_group(specs, realign=realign, extra_positions=steps - 1)
    params, first = [r.sampling for r in rows], [first_draft_position(r) for r in rows]
    fed = torch.tensor([r.append_token_ids for r in rows])
    choices, logits_run, hidden_run = [], [], []
    for j in range(steps):
        logits = group.step(fed, num_logits=1, keep_hidden=keep_features)  # [batch, 1, vocab]
        fed = sampling.choose(adjust.adjusted(logits, _counted(rows, choices), [[]] * len(rows)),
                              params, [p + j for p in first])  # [batch, 1]
        choices.append(fed[:, 0])
        logits_run.append(logits[:, 0])
        if keep_features:
            hidden_run.append(group.hidden.float().cpu())
    outputs = torch.stack(choices, dim=1).tolist()  # [batch, steps]
    cache_lens = [r.expected_cache_len + len(r.append_token_ids) + steps - 1 for r in rows]
    runner.store([r.seq_id for r in rows], group.rows_after(cache_lens))
    scored = [None if r.num_top is None else logprobs_lib.score(
        torch.stack([step[i] for step in logits_run]), out, r.num_top)
        for i, (r, out) in enumerate(zip(rows, outputs))]
    features = [torch.cat([h[i] for h in hidden_run]) if keep_features else None
                for i in range(len(rows))]
    return [VerifiedRow(r.seq_id, 0, out, c, lp, f) for r, out, c, lp, f
            in zip(rows, outputs, cache_lens, scored, features)], [group]


def speculate(runner: runner_lib.ModelRunner, rows: list[VerifyRow], rounds: int,
              propose_next, *, realign: bool, keep_features: bool = False):
    """Up to `rounds` verifies of the rows, each round after the first verifying the drafts
    `propose_next(verified)` made from the round before's VerifiedRows ({seq_id: drafts}; a
    row it names not verifies none; None: the rounds end there). Each round is `verify`'s, so
    each output is what one verify a command gives. The rounds end too once every row has
    output an end-of-sequence token of the model's (a row that ignores them never has), and
    where a later round's verify is
    refused (nothing of it stored). Returns (one VerifiedRow a row, over every round run: the
    outputs, log-probabilities and features of each in order, num_accepted their sum,
    cache_len the last's; per row the (drafts, accepted) of each round; the groups run)."""
    runs: list[list[tuple[VerifyRow, VerifiedRow]]] = [[] for _ in rows]
    groups, ended, stops = [], set(), set(runner.eos_token_ids)
    for j in range(rounds):
        try:
            verified, group = verify(runner, rows, realign=realign, keep_features=keep_features)
        except errors.BatchspecError:
            if not j:
                raise
            break  # the rounds before stand: their caches are stored
        groups.append(group)
        for run, row, v in zip(runs, rows, verified):
            run.append((row, v))
        ended |= {v.seq_id for r, v in zip(rows, verified)
                  if not r.ignore_eos and stops.intersection(v.output_token_ids)}
        drafts = propose_next(verified) if j + 1 < rounds and len(ended) < len(rows) else None
        if drafts is None:
            break
        rows = [_next_round(r, v, drafts.get(r.seq_id, [])) for r, v in zip(rows, verified)]
        realign = realign or len({r.expected_cache_len for r in rows}) > 1
    merged = [VerifiedRow(
        run[0][1].seq_id, sum(v.num_accepted for _, v in run),
        [t for _, v in run for t in v.output_token_ids], run[-1][1].cache_len,
        None if run[0][1].logprobs is None else [lp for _, v in run for lp in v.logprobs],
        torch.cat([v.features for _, v in run]) if keep_features else None) for run in runs]
    per_round = [[(len(r.draft_token_ids), v.num_accepted) for r, v in run] for run in runs]
    return merged, per_round, groups


def _next_round(row: VerifyRow, verified: VerifiedRow, drafts: list[int]) -> VerifyRow:
    """The row's next round: its last output appended (the cache holds the others), `drafts`
    verified, a penalized row's counts counting the round's outputs."""
    counts = row.output_counts
    if row.sampling.penalized:
        counts = dict(collections.Counter(counts or {})
                      + collections.Counter(verified.output_token_ids))
    return dataclasses.replace(row, expected_cache_len=verified.cache_len,
                               append_token_ids=verified.output_token_ids[-1:],
                               draft_token_ids=drafts, output_counts=counts)


def _counted(rows: list[VerifyRow], choices: list[torch.Tensor]) -> list[VerifyRow]:
    """The rows, a penalized one's output_counts counting the command's outputs so far
    (choices: [batch] tensors, one a step)."""
    if not choices or not any(r.sampling.penalized for r in rows):
        return rows
    outputs = torch.stack(choices, dim=1).tolist()
    return [dataclasses.replace(r, output_counts=dict(
        collections.Counter(r.output_counts or {}) + collections.Counter(out)))
        if r.sampling.penalized else r for r, out in zip(rows, outputs)]


def masked(logits: torch.Tensor, rows: list[VerifyRow]) -> torch.Tensor:
    """The logits outputs are picked from: -inf where a row's grammar forbids the token (a
    copy; log-probabilities are scored on the model's own logits). Softmax over the rest is
    the target's distribution renormalised on the allowed tokens, so the target's choice at
    every position is an allowed token and a forbidden draft is never accepted."""
    if all(r.token_masks is None for r in rows):
        return logits
    logits = logits.clone()
    for i, r in enumerate(rows):
        if r.token_masks is not None:
            n = r.token_masks.shape[0]
            logits[i, :n].masked_fill_(~r.token_masks.to(logits.device), float("-inf"))
    return logits


def accept(rows: list[VerifyRow], drafts: torch.Tensor, logits: torch.Tensor,
           counts: torch.Tensor) -> sampling.Verification:
    """Each row's drafts accepted while they equal the target's choice (the argmax when greedy,
    the seeded Gumbel-max sample when sampling: sampling.choose). counts: [batch] each row's
    real drafts (the rest of `drafts` is padding)."""
    device = logits.device  # the target's: every tensor of the acceptance is put there
    choices = sampling.choose(logits, [r.sampling for r in rows],
                              [first_draft_position(r) for r in rows],
                              [n + 1 for n in counts.tolist()])
    return sampling.verify_choices(drafts.to(device), choices, counts.to(device))


def first_draft_position(row: VerifyRow) -> int:
    """The sequence position of the row's first output: its committed length."""
    return row.expected_cache_len + len(row.append_token_ids)
