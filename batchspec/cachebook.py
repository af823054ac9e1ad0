"""The per-sequence cache bookkeeping every draft and target service obeys, free of torch.

A service holds, per sequence id, an entry with a `length`: the positions it has cached. The
coordinator names the length it expects in every command; a mismatch is refused
(FailedPrecondition), never recomputed. A command either applies to every sequence it names
or to none: everything is validated before anything changes.
"""
import dataclasses
import threading

from batchspec import errors


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The measured time of one forward (or proposal) of `rows` sequences feeding `tokens`."""

    rows: int
    tokens: int  # fed per row
    context: int  # cached positions per row before the forward
    seconds: float  # the fastest of a few runs


class CacheBook:
    """What both kinds of draft (model and n-gram) and the target share: the cache entries by
    sequence id and the checks on them. A subclass sets name, vocab_size, eos_token_ids and
    max_context_len, and stores entries with a `length` in `caches`."""

    def __init__(self, *, name: str, vocab_size: int, eos_token_ids: list[int],
                 max_context_len: int, device: str = "cpu"):
        self.name = name
        self.vocab_size = vocab_size  # 0: any non-negative token id is taken
        self.eos_token_ids = eos_token_ids
        self.max_context_len = max_context_len
        self.device = device
        self.caches: dict = {}
        # Held by the servicer around every command: several streams may drive one service.
        self.lock = threading.Lock()
        # What a command costs on this device, measured at start-up; Describe reports it.
        self.step_costs: list[StepCost] = []
        self.vocabulary = ""  # ModelInfo.vocabulary: a digest of its token ids' meaning

    def num_cached_tokens(self) -> int:
        return sum(c.length for c in self.caches.values())

    def lookup(self, seq_id: int, expected_len: int):
        cache = self.caches.get(seq_id)
        if cache is None:
            raise errors.NotFound(f"sequence {seq_id} is not cached here (never prefilled, "
                                  "or already released)")
        if cache.length != expected_len:
            raise errors.FailedPrecondition(
                f"sequence {seq_id}: expected cache length {expected_len}, service holds "
                f"{cache.length}")
        return cache

    def check_token_ids(self, token_ids, what: str) -> None:
        limit = self.vocab_size or float("inf")
        bad = [t for t in token_ids if not 0 <= t < limit]
        if bad:
            raise errors.InvalidArgument(
                f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    @staticmethod
    def check_unique(seq_ids) -> None:
        if len(set(seq_ids)) != len(seq_ids):
            raise errors.InvalidArgument("a command names the same sequence twice")

    def check_context(self, seq_id: int, length: int) -> None:
        if length > self.max_context_len:
            raise errors.InvalidArgument(
                f"sequence {seq_id} would reach {length} positions, past the model's context "
                f"of {self.max_context_len}")

    def check_row(self, seq_id: int, expected_len: int, keep_len: int, append, extra: int = 0):
        """A row of a group command: known, as long as expected, keep_len within it, valid
        appended token ids, and keep_len + appended + extra positions within the context.
        Returns the cache entry."""
        cache = self.lookup(seq_id, expected_len)
        if keep_len > cache.length:
            raise errors.InvalidArgument(
                f"sequence {seq_id}: keep_len {keep_len} exceeds the cached {cache.length}")
        self.check_token_ids(append, f"sequence {seq_id}")
        self.check_context(seq_id, keep_len + len(append) + extra)
        return cache

    def check_prefill(self, entries: list[tuple[int, list[int]]]) -> None:
        """Refuse a prefill naming a sequence twice or one already cached, bad token ids, or a
        prompt past the context."""
        self.check_unique([s for s, _ in entries])
        for seq_id, token_ids in entries:
            if seq_id in self.caches:
                raise errors.AlreadyExists(f"sequence {seq_id} is already cached; release it first")
            self.check_token_ids(token_ids, f"prefill of sequence {seq_id}")
            self.check_context(seq_id, len(token_ids))

    def check_trim(self, entries: list[tuple[int, int, int]]) -> None:
        """(seq_id, expected_len, keep_len) each: known, as long as expected, keep <= expected."""
        self.check_unique([s for s, _, _ in entries])
        for seq_id, expected, keep in entries:
            self.lookup(seq_id, expected)
            if keep > expected:
                raise errors.InvalidArgument(
                    f"sequence {seq_id}: cannot trim to {keep} positions, only {expected} cached")

    def prefill_copies(self, entries: list[tuple[int, list[int]]],
                       copies: dict[int, int]) -> list[int]:
        """prefill, where the sequences in `copies` (seq_id: source) start from their
        source's cache; see PrefillEntry.copy_from."""
        raise errors.InvalidArgument(f"{self.name} cannot start a sequence from another's "
                                     "cache: prefill it without copy_from")

    def release(self, seq_ids: list[int]) -> int:
        self.check_unique(seq_ids)
        missing = [s for s in seq_ids if s not in self.caches]
        if missing:
            raise errors.NotFound(f"sequences {missing[:5]} are not cached (already released?)")
        for seq_id in seq_ids:
            del self.caches[seq_id]
        return len(self.caches)
