"""A model-free draft: prompt lookup over each sequence's own tokens. No torch, so the
coordinator can run it in its own process (coordinator.local_draft) as well as the n-gram draft
service (draft_service.ngram_servicer).

To propose for a sequence, take its last n tokens (n from max_n down to min_n), find the most
recent earlier place they occurred in the sequence (prompt and output alike), and propose the
tokens that followed there. A continuation that runs into the end of the sequence continues
with its own proposals, so a sequence repeating a loop is proposed the whole loop.

It keeps the draft service's cache contract exactly as the model draft does: a sequence's
"cache" is its committed tokens but the last after a prefill, and after a proposal of D >= 1
tokens it holds keep_len + appended + D - 1 tokens (the committed ones, then its own drafts but
the last). A row with no match drafts nothing and holds keep_len + appended.

A proposal is verified the same way for greedy and sampled requests: a token is accepted
while it is the target's choice there (batchspec.runtime.sampling), which for a sampled
request happens with the target's own probability of that token.
"""
import dataclasses
import time
from typing import NamedTuple, Protocol

from batchspec import errors
from batchspec.cachebook import CacheBook, StepCost

NGRAM_MODEL = "ngram"


class NgramIndex:
    """One sequence's tokens and, for every n-gram of them (min_n <= n <= max_n), the
    positions right after each occurrence, in increasing order.

    Invariant: table[key] lists exactly the ends p (p <= len(tokens)) with
    tuple(tokens[p - n:p]) == key, ascending; so truncation pops from the back."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids) -> None:
        for token in token_ids:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.table.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def truncate(self, keep: int) -> None:
        while len(self.tokens) > keep:
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n:end])
                ends = self.table[key]
                ends.pop()  # == end, by the invariant
                if not ends:
                    del self.table[key]
            self.tokens.pop()

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        that occurred before; [] when none did."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            ends = self.table.get(tuple(self.tokens[end - n:]))
            start = next((p for p in reversed(ends or ()) if p < end), None)
            if start is None:
                continue
            proposal: list[int] = []
            for j in range(k):  # past the end, the continuation reads its own proposals
                src = start + j
                proposal.append(self.tokens[src] if src < end else proposal[src - end])
            return proposal
        return []


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2  # shorter suffixes match too often to be worth a verification slot
    max_n: int = 4

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram sizes: need 1 <= min_n <= max_n")


class Row(Protocol):
    """What a proposal needs of a row (the services' ProposeRow, the coordinator's
    ProposeSpec)."""

    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: list[int]


class Proposed(NamedTuple):
    seq_id: int
    draft_token_ids: list[int]
    cache_len: int  # keep_len + appended + len(draft_token_ids) - 1, or + 0 with no draft
    cut: bool = False  # a lookup is never cut short (what wire.propose_result reads)


class NgramStore(CacheBook):
    """The n-gram draft's caches (one NgramIndex per sequence) and its commands."""

    def __init__(self, config: NgramConfig = NgramConfig(), *, max_context_len: int = 1 << 20):
        super().__init__(name=NGRAM_MODEL, vocab_size=0, eos_token_ids=[],
                         max_context_len=max_context_len)
        self.config = config
        self.caches: dict[int, NgramIndex] = {}

    def prefill(self, entries: list[tuple[int, list[int]]]) -> list[int]:
        self.check_prefill(entries)
        for seq_id, token_ids in entries:
            index = NgramIndex(self.config.min_n, self.config.max_n)
            index.extend(token_ids)
            self.caches[seq_id] = index
        return [len(token_ids) for _, token_ids in entries]

    def trim(self, entries: list[tuple[int, int, int]]) -> list[int]:
        self.check_trim(entries)
        for seq_id, _, keep in entries:
            self.caches[seq_id].truncate(keep)
        return [keep for _, _, keep in entries]

    def propose(self, rows: list[Row], num_drafts: int) -> list[Proposed]:
        """Every row proposes up to num_drafts tokens (rows may append different numbers of
        tokens); a lookup has no sampling of its own (point masses: see the verifier)."""
        if num_drafts < 1:
            raise errors.InvalidArgument("num_draft_tokens must be >= 1")
        self.check_unique([r.seq_id for r in rows])
        for seq_id, expected, keep, append in _fields(rows):
            if not append:
                raise errors.InvalidArgument(
                    f"sequence {seq_id}: append_token_ids must end with the last committed token")
            self.check_row(seq_id, expected, keep, append, num_drafts)
        proposals = []
        for seq_id, _, keep, append in _fields(rows):
            index = self.caches[seq_id]
            index.truncate(keep)
            index.extend(append)
            drafts = index.propose(num_drafts)
            index.extend(drafts[:-1])  # the last draft is never "fed", as in the model draft
            proposals.append(Proposed(seq_id, drafts, index.length))
        return proposals


def _fields(rows: list[Row]):
    return [(r.seq_id, r.expected_cache_len, r.keep_len, r.append_token_ids) for r in rows]


class _Timed(NamedTuple):
    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: list[int]


def measure_costs(store: NgramStore, rows=(1, 8, 64), tokens=(1, 8),
                  context: int = 512, repeats: int = 3) -> list[StepCost]:
    """Time proposals the way the coordinator sends them, on a synthetic repeating
    sequence (so every lookup matches); each shape's best of `repeats` (one sample of
    microseconds is mostly the host's noise). Microseconds: the round trip dominates."""
    costs = []
    pattern = [i % 97 for i in range(context)]
    for num_rows in rows:
        ids = [-(i + 2) for i in range(num_rows)]
        store.prefill([(seq_id, pattern) for seq_id in ids])
        try:
            for num_tokens in tokens:
                specs = [_Timed(s, context, context - 1, [pattern[-1]]) for s in ids]
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    proposals = store.propose(specs, num_tokens)
                    best = min(best, time.perf_counter() - started)
                    store.trim([(p.seq_id, p.cache_len, context) for p in proposals])
                costs.append(StepCost(num_rows, num_tokens, context, best))
        finally:
            store.release(ids)
    return costs
