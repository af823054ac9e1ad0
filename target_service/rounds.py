"""The drafts of a verify command's rounds after the first (VerifyCommand.rounds): the hosted
draft's proposals (`Rounds`), and the lines of a lookup's draft (`Lines`).

A round after the first proposes for each entry of the command's propose what the round
before committed, as the coordinator would feed it in a command of its own: the draft's
cache rolled back to the tokens it holds validly (those fed before this round's outputs),
then every entry the same number of committed tokens appended (ProposeEntry's rule), with the
target's features of the position before each (float16 on the wire, so rounded as there).

Invariant per entry, between rounds: `tokens` are the committed tokens from the first
propose's keep_len on, `features` the features before each (None: the draft reads none),
`cache_len` its cache's length; the draft holds validly all of `tokens` but the round's
outputs.
"""
import dataclasses
import time

import torch

from batchspec import errors
from batchspec.runtime import wire
from batchspec.runtime.rows import ProposeRow, VerifyRow
from batchspec.v1 import draft_pb2
from draft_service import proposer


@dataclasses.dataclass
class _Entry:
    seq_id: int
    keep_len: int  # the first propose's
    tokens: list[int]
    features: torch.Tensor | None
    cache_len: int
    sampling: object
    num_proposed: int  # the drafts its verify takes of each proposal


class Rounds:
    """Proposes the rounds after the first for a verify command whose propose the hosted
    draft answered with `first` (a ProposeResult)."""

    def __init__(self, draft_runner, command, first: draft_pb2.ProposeResult):
        propose = command.propose
        taken = {e.seq_id: e.num_proposed for e in command.entries}
        made = {e.seq_id: e.cache_len for e in first.entries}
        self.runner = draft_runner
        self.num_drafts = propose.num_draft_tokens
        self.min_confidence = propose.min_draft_confidence
        self.reads_features = bool(getattr(draft_runner, "reads_features", 0))
        self.entries = [_Entry(
            e.seq_id, e.keep_len, list(e.append_token_ids),
            wire.features_tensor(e.features, f"sequence {e.seq_id}")
            if self.reads_features else None, made[e.seq_id], wire.sampling(e.sampling),
            taken[e.seq_id]) for e in propose.entries if e.seq_id in made and e.seq_id in taken]
        # a proposal for a sequence the verify does not name ends the rounds at the first:
        # the result's proposal must stay every entry's
        self.complete = len(self.entries) == len(first.entries)
        self.last = first
        self.seconds = first.timing.compute_seconds
        self.forward_seconds = first.timing.forward_seconds
        self.realign_seconds = first.timing.realign_seconds

    def __call__(self, verified) -> dict[int, list[int]] | None:
        """The next round's drafts by sequence, from the round's VerifiedRows (their features
        kept); None where the rounds end: the draft refused, or the entries cannot be fed
        the same number of tokens from what the command holds, or the propose named a
        sequence the verify does not."""
        if not self.complete:
            return None
        by_seq = {v.seq_id: v for v in verified}
        width = max((len(by_seq[e.seq_id].output_token_ids) for e in self.entries), default=0)
        for entry in self.entries:
            outputs = by_seq[entry.seq_id].output_token_ids
            entry.tokens += outputs
            if entry.features is not None:  # the features before each output
                new = by_seq[entry.seq_id].features[-len(outputs):]
                entry.features = torch.cat([entry.features, new.half().float()])
        if not width or any(len(e.tokens) < width for e in self.entries):
            return None
        rows = [ProposeRow(e.seq_id, e.cache_len, e.keep_len + len(e.tokens) - width,
                           e.tokens[-width:], e.sampling,
                           None if e.features is None else e.features[-width:])
                for e in self.entries]
        started = time.perf_counter()
        try:
            proposals, group = proposer.propose(self.runner, rows, self.num_drafts,
                                                realign=True,
                                                min_confidence=self.min_confidence)
        except errors.BatchspecError:
            return None  # the draft's caches are as the round before left them
        self.seconds += time.perf_counter() - started
        self.forward_seconds += group.forward_seconds
        self.realign_seconds += group.realign_seconds
        self.last = wire.propose_result(proposals, wire.timing(
            self.seconds, self.realign_seconds, self.forward_seconds))
        for entry, proposal in zip(self.entries, proposals):
            entry.cache_len = proposal.cache_len
        return {p.seq_id: p.draft_token_ids[:e.num_proposed]
                for e, p in zip(self.entries, proposals)}


class Lines:
    """The drafts of the rounds after the first for the rows that carry a lookup's line (their
    draft_token_ids, then VerifyEntry.continuation_token_ids): while a row's outputs so far
    are the line's first tokens, in order, it verifies the next len(draft_token_ids) of it
    (fewer where it runs out); once they leave it, none (as a lookup asked again would find
    other text to copy, or none, which this does not look up)."""

    def __init__(self, rows: list[VerifyRow]):
        self.lines = {r.seq_id: (r.draft_token_ids + r.continuation, len(r.draft_token_ids))
                      for r in rows if r.draft_token_ids and r.continuation}
        self.outputs: dict[int, list[int]] = {seq_id: [] for seq_id in self.lines}

    def __call__(self, verified) -> dict[int, list[int]]:
        """The next round's drafts by sequence, from the round's VerifiedRows."""
        drafts = {}
        for v in verified:
            if v.seq_id in self.lines:
                (line, k), done = self.lines[v.seq_id], self.outputs[v.seq_id]
                done += v.output_token_ids
                if line[:len(done)] == done:
                    drafts[v.seq_id] = line[len(done):len(done) + k]
        return drafts
