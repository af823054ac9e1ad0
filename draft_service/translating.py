"""A draft of another tokenizer than the target's, served as a draft of the target's tokens.

The service speaks the target's token ids on the wire, so the coordinator's bookkeeping is
the same for every draft kind: lengths, keep_len and cache_len count target tokens. Inside,
each sequence's committed tokens are read as text (draft_service.retokenize), re-tokenized
with the draft's tokenizer over a window that starts at the last boundary both
tokenizations share (an *anchor*), and fed to the draft model; the draft's proposal is read
as text and written back as the target tokens that spell it, the last one dropped (more text
could change it). Output is unchanged whatever the draft proposes: the target verifies its
own tokens, greedy or seeded.

Invariants per sequence (`Record`): its length is len(target_ids); the draft model's cache
for it is draft_ids; every anchor (t, d) says target_ids[:t] and draft_ids[:d] spell the
same bytes, and (0, 0) is one.
"""
from __future__ import annotations

import dataclasses
import math

from batchspec import errors
from batchspec.cachebook import CacheBook
from batchspec.params import SamplingParams
from batchspec.runtime.rows import ProposedRow, ProposeRow
from draft_service import proposer, retokenize
from draft_service.retokenize import TokenTable
from draft_service.servicer import DraftServicer

# Most draft forwards per target token asked, whatever the measured ratio of tokens.
MAX_FORWARDS_PER_TOKEN = 8
# Committed text the target's tokenizer reads before a proposal, to split it as it would
# split the two together (a SentencePiece tokenizer's first word, a merge at the boundary).
CONTEXT_BYTES = 64
# Anchors kept: (0, 0) and those within this many target tokens of a record's end. A step
# rolls a record back by a few tokens only; one rolled back further re-feeds from the start.
ANCHOR_WINDOW = 256


@dataclasses.dataclass
class Record:
    target_ids: list[int]
    draft_ids: list[int] = dataclasses.field(default_factory=list)
    anchors: list[tuple[int, int]] = dataclasses.field(default_factory=lambda: [(0, 0)])

    @property
    def length(self) -> int:
        return len(self.target_ids)


@dataclasses.dataclass(frozen=True)
class Feed:
    """What the draft model must be fed for one row: keep `keep` of its cached draft_ids, then
    the rest of `stream`; the draft's proposal continues the text after `pending` (bytes of the
    target's text that the stream does not spell: the start of a character)."""

    stream: list[int]
    keep: int
    common: int  # the length of the prefix stream shares with the cache's draft_ids
    pending: bytes | None  # None: the text cannot be continued (a token of unknown bytes)
    anchors: list[tuple[int, int]]
    # the committed text just before the pending bytes (whole characters, up to
    # CONTEXT_BYTES): the target's tokenizer splits a proposal as it follows this text
    context: bytes = b""


def rebase(record: Record, keep: int, append: list[int], target: TokenTable,
           draft: TokenTable) -> Feed:
    """The feed for a record rolled back to `keep` target tokens and then given `append`:
    the draft's tokens up to the last anchor within `keep`, then the text from there
    re-tokenized."""
    tokens = record.target_ids[:keep] + list(append)
    t_a, d_a = max(a for a in record.anchors if a[0] <= keep)
    segment = tokens[t_a:]
    count, target_pieces = retokenize.mapped(target, segment)
    data = b"".join(target_pieces)
    text, used = retokenize.complete_text(data)
    own = draft.encode(text) if text else []
    _, draft_pieces = retokenize.mapped(draft, own)
    stream = record.draft_ids[:d_a] + own
    same = d_a
    while same < min(len(stream), len(record.draft_ids)) \
            and stream[same] == record.draft_ids[same]:
        same += 1
    anchors = _recent([a for a in record.anchors if a[0] <= t_a] + [
        (t_a + i, d_a + j) for i, j in retokenize.shared_boundaries(target_pieces, draft_pieces)],
        len(tokens))
    pending = data[used:] if count == len(segment) else None
    return Feed(stream, min(same, max(0, len(stream) - 1)), same, pending, anchors,
                _context(target, tokens, len(pending or b"")))


def _context(target: TokenTable, tokens: list[int], pending: int) -> bytes:
    """The whole characters of the committed text before its last `pending` bytes, up to
    CONTEXT_BYTES of them (b"" where the tail has a token of unknown bytes)."""
    tail = tokens[-CONTEXT_BYTES:]
    count, pieces = retokenize.mapped(target, tail)
    if count < len(tail):
        return b""
    data = b"".join(pieces)
    data = data[max(0, len(data) - pending - CONTEXT_BYTES):len(data) - pending]
    while data and data[0] & 0xC0 == 0x80:  # not the start of a character
        data = data[1:]
    return data


def _recent(anchors: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """(0, 0) and the anchors within ANCHOR_WINDOW target tokens of `length`, in order."""
    return [a for a in anchors if a == (0, 0) or a[0] >= length - ANCHOR_WINDOW]


def proposal_tokens(feed: Feed, drafted: list[int], target: TokenTable, draft: TokenTable,
                    limit: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(the target tokens that spell the draft's proposal `drafted`, at most `limit`, the
    last one the draft's text could still change dropped; anchors inside them, as (tokens
    into the proposal, drafted tokens into it)). Nothing where the proposal does not continue
    the committed text's last partial character."""
    if feed.pending is None or not drafted:
        return [], []
    _, pieces = retokenize.mapped(draft, drafted)
    data = b"".join(pieces)
    if not data.startswith(feed.pending):
        return [], []
    tokens = retokenize.to_tokens(target, data[len(feed.pending):],
                                  feed.context + feed.pending)[:limit]
    if feed.pending or not tokens:
        return tokens, []
    _, target_pieces = retokenize.mapped(target, tokens)
    return tokens, retokenize.shared_boundaries(target_pieces, pieces)


class TranslatingRunner(CacheBook):
    """A draft model runner (`inner`) behind the cache commands and proposals of the
    target's tokens. Describe reports the target's vocabulary and end tokens."""

    def __init__(self, inner, target: TokenTable, draft: TokenTable, *, eos_token_ids,
                 vocabulary: str):
        super().__init__(name=f"{inner.name} (in the target's tokens)",
                         vocab_size=target.vocab_size, eos_token_ids=list(eos_token_ids),
                         max_context_len=inner.max_context_len, device=inner.device)
        self.inner = inner
        self.target = target
        self.draft = draft
        self.vocabulary = vocabulary
        self.reads_features = 0
        self.lock = inner.lock
        # [target tokens, draft tokens] of the text fed and proposed so far: their ratio
        # sets the draft forwards a proposal runs
        self._fed = [1, 1]

    @property
    def model(self):
        return self.inner.model

    # ---- cache commands ---------------------------------------------------------------------
    def prefill(self, entries: list[tuple[int, list[int]]], features=None) -> list[int]:
        self.check_prefill(entries)
        records, streams = {}, []
        for seq_id, token_ids in entries:
            feed = rebase(Record([]), 0, token_ids, self.target, self.draft)
            records[seq_id] = Record(list(token_ids), feed.stream, feed.anchors)
            streams.append((seq_id, feed.stream))
            self._count(len(token_ids), len(feed.stream))
        self.inner.prefill(streams)
        self.caches.update(records)
        return [record.length for record in records.values()]

    def trim(self, entries: list[tuple[int, int, int]]) -> list[int]:
        """Bookkeeping only: the draft's cache is rolled back at its next proposal, to the
        last anchor within what is kept."""
        self.check_trim(entries)
        for seq_id, _, keep in entries:
            record = self.caches[seq_id]
            record.target_ids = record.target_ids[:keep]
            record.anchors = [a for a in record.anchors if a[0] <= keep]
        return [keep for _, _, keep in entries]

    def release(self, seq_ids: list[int]) -> int:
        count = super().release(seq_ids)  # checks them all first
        self.inner.release(seq_ids)
        return count

    def forwards_for(self, num_drafts: int) -> int:
        """Draft forwards that spell about num_drafts target tokens and one more (the last
        target token a proposal spells is dropped), at the ratio of tokens measured so far."""
        ratio = min(MAX_FORWARDS_PER_TOKEN, max(1.0, self._fed[1] / self._fed[0]))
        return math.ceil((num_drafts + 1) * ratio)

    def _count(self, target_tokens: int, draft_tokens: int) -> None:
        self._fed[0] += target_tokens
        self._fed[1] += draft_tokens

    # ---- proposals ----------------------------------------------------------------------------
    def propose(self, rows: list[ProposeRow], num_drafts: int):
        """(ProposedRows of target tokens for `rows`, the draft model's groups run). Rows are
        drafted greedily: a sampled row's draft is the draft's most likely text, accepted
        where the target's seeded choice agrees."""
        proposer.check_options(num_drafts, 0.0)
        self.check_unique([r.seq_id for r in rows])
        feeds = {}
        for row in rows:
            self.check_row(row.seq_id, row.expected_cache_len, row.keep_len,
                           row.append_token_ids)
            if not row.append_token_ids:
                raise errors.InvalidArgument(f"sequence {row.seq_id}: append at least the "
                                             "last committed token")
            feeds[row.seq_id] = rebase(self.caches[row.seq_id], row.keep_len,
                                       row.append_token_ids, self.target, self.draft)
        forwards = self.forwards_for(num_drafts)
        # a row with no text to draft from, or whose draft would pass the draft's context,
        # proposes nothing
        runnable = [r for r in rows if feeds[r.seq_id].stream and feeds[r.seq_id].pending
                    is not None and len(feeds[r.seq_id].stream) + forwards
                    <= self.inner.max_context_len]
        drafted, groups = {}, []
        for group in _groups(runnable, feeds):
            width = max(len(feeds[r.seq_id].stream) - feeds[r.seq_id].keep for r in group)
            inner_rows = [ProposeRow(r.seq_id, len(self.caches[r.seq_id].draft_ids),
                                     len(feeds[r.seq_id].stream) - width,
                                     feeds[r.seq_id].stream[-width:], SamplingParams())
                          for r in group]
            proposed, forward = proposer.propose(self.inner, inner_rows, forwards, realign=True)
            groups.append(forward)
            drafted.update((p.seq_id, p.draft_token_ids) for p in proposed)
        return [self._proposed(row, feeds[row.seq_id], drafted.get(row.seq_id), num_drafts)
                for row in rows], groups

    def _proposed(self, row: ProposeRow, feed: Feed, drafted: list[int] | None,
                  num_drafts: int) -> ProposedRow:
        """Row's record after the draft proposed `drafted` (draft tokens; None: not run)."""
        record = self.caches[row.seq_id]
        fed = record.target_ids[:row.keep_len] + list(row.append_token_ids)
        if drafted is None:  # the draft's cache is as it was: anchors within what it shares
            record.target_ids = fed
            record.anchors = [a for a in feed.anchors if a[1] <= feed.common]
            return ProposedRow(row.seq_id, [], record.length)
        tokens, inside = proposal_tokens(feed, drafted, self.target, self.draft, num_drafts)
        if tokens:
            self._count(len(tokens) + 1, len(drafted))
        # cached: the committed tokens fed and the proposal but its last token, as a draft
        # of the target's own tokens holds them (its last draft is never fed)
        held = max(len(tokens) - 1, 0)
        record.target_ids = fed + tokens[:held]
        record.draft_ids = feed.stream + drafted[:-1]
        record.anchors = feed.anchors + [(len(fed) + i, len(feed.stream) + j)
                                         for i, j in inside if i <= held and j < len(drafted)]
        return ProposedRow(row.seq_id, tokens, record.length)


def _groups(rows: list[ProposeRow], feeds: dict[int, Feed]) -> list[list[ProposeRow]]:
    """Rows in groups that append the same number of draft tokens: each row of a group
    appends the group's widest need, re-feeding tokens it holds (a cheap forward position),
    so rows whose whole stream is shorter than that go to a group of their own."""
    need = {r.seq_id: len(feeds[r.seq_id].stream) - feeds[r.seq_id].keep for r in rows}
    left = sorted(rows, key=lambda r: need[r.seq_id], reverse=True)
    groups = []
    while left:
        width = need[left[0].seq_id]
        group = [r for r in left if len(feeds[r.seq_id].stream) >= width]
        groups.append(group)
        left = [r for r in left if r not in group]
    return groups


# A text every tokenizer this service translates must spell back exactly.
PROBE_TEXT = "The quick brown fox, 12 of them: jumps over the lazy dog.\n"


def build_runner(config) -> TranslatingRunner:
    """The draft model of config.model behind the target's tokens (config.target_tokenizer).
    Raises ValueError where either tokenizer cannot be read back exactly, the draft has none,
    or it is a feature head (it reads the target's features of the target's positions)."""
    from batchspec.runtime import models, service

    own = models.tokenizer_file(config.model)
    if own is None:
        raise ValueError(f"the draft {config.model} has no tokenizer.json to translate with")
    target, draft = TokenTable.from_file(config.target_tokenizer), TokenTable.from_file(own)
    for table in (target, draft):
        table.check_exact(PROBE_TEXT)
    inner = service.build_runner(config)
    if inner.reads_features:
        raise ValueError(f"the draft {config.model} reads the target's features, position by "
                         "position of the target's tokens: it cannot draft in other tokens")
    if inner.vocab_size < draft.vocab_size:
        raise ValueError(f"the draft {config.model} has {inner.vocab_size} logits but its "
                         f"tokenizer {draft.vocab_size} tokens")
    return TranslatingRunner(inner, target, draft, eos_token_ids=[],
                             vocabulary=models.tokenizer_digest(config.target_tokenizer))


def warm_up(runner: TranslatingRunner) -> None:
    """The draft model's warm-up; its forward costs stand for the proposals' (the
    coordinator measures the proposals themselves as they run)."""
    from batchspec.runtime import service

    service.warm_up(runner.inner, proposes=True)
    runner.step_costs = runner.inner.step_costs


class TranslatingServicer(DraftServicer):
    def propose(self, rows, command):
        """Its proposals are never cut (min_draft_confidence is checked, not used)."""
        proposer.check_options(command.num_draft_tokens, command.min_draft_confidence)
        return self.runner.propose(rows, command.num_draft_tokens)
