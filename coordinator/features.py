"""The target's features of each sequence, kept for the drafts that read them (feature-level
draft heads), as the float16 rows the target sent: the coordinator relays them and never
decodes them.

Invariant: a sequence's `FeatureLog` holds the features of its positions [0, length), which
are committed positions the target has cached; it grows by what each prefill and verify
returns and is dropped (recomputed by the target on request) whenever it would not line up.
"""
import logging

from batchspec import errors
from batchspec.v1 import cache_pb2

log = logging.getLogger(__name__)


class FeatureLog:
    def __init__(self, width: int):
        self.width = width
        self._rows = bytearray()

    @property
    def row_bytes(self) -> int:
        return 2 * self.width

    @property
    def length(self) -> int:
        return len(self._rows) // self.row_bytes

    def extend(self, features: cache_pb2.Features) -> bool:
        """Append rows; False (nothing appended) when they are not of this log's width."""
        if features.width != self.width or \
                len(features.values_f16) != features.num_positions * self.row_bytes:
            return False
        self._rows += features.values_f16
        return True

    def head(self, length: int) -> "FeatureLog":
        """A log of this one's first `length` positions (a copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"{length} positions asked of a log of {self.length}")
        first = FeatureLog(self.width)
        first._rows = self._rows[:length * self.row_bytes]
        return first

    def fed_with(self, start: int, end: int) -> cache_pb2.Features:
        """What a feature draft is fed with tokens [start, end): the features of positions
        [start - 1, end - 1), a row of zeros standing for position -1."""
        if not 0 <= start <= end or end - 1 > self.length:
            raise ValueError(f"features of tokens [{start}, {end}) need positions up to "
                             f"{end - 2}; {self.length} are known")
        zeros = bytes(self.row_bytes) if start == 0 else b""
        first = max(start - 1, 0)
        body = bytes(self._rows[first * self.row_bytes:(end - 1) * self.row_bytes])
        return cache_pb2.Features(num_positions=end - start, width=self.width,
                                  values_f16=zeros + body)


def from_message(features: cache_pb2.Features) -> FeatureLog:
    log = FeatureLog(features.width)
    log.extend(features)
    return log


def note_readers(client, target, kinds, infos) -> None:
    """Mark the draft kinds whose services read features (ModelInfo.feature_width), and
    have the target client ask for features as the target caches when one does; a kind
    whose width is not the target's is never used (logged)."""
    if any(info is not None and info.feature_width > 0 for info in infos):
        client.features_for_drafts = True
    for kind, info in zip(kinds, infos):
        if info is None or not info.feature_width:
            continue
        kind.reads_features = True
        if target is not None and target.feature_width != info.feature_width:
            log.error("draft %s reads features %d wide; the target's are %d: not used",
                      kind.name, info.feature_width, target.feature_width)
            kind.up = False


def prefill_target(target, seqs, copies: dict[int, int], active=(),
                   parts: dict[int, int] | None = None) -> None:
    """Prefill the sequences in the target, keeping the features of their positions. Those
    in `copies` (seq_id: source, one of `seqs` or `active`) start from their source's
    cache and take the features of its first positions: a causal model's features of a
    prefix depend on that prefix alone. A prefill that returns features copies nothing, so
    the copies go in a second command, after the sources are computed; all or nothing, as
    one command is: where it fails, the sequences computed are released again. `parts`
    (seq_id: tokens): those cached up to their first tokens only (a prompt fed in chunks)."""
    computed = [s for s in seqs if s.seq_id not in copies]
    copied = [s for s in seqs if s.seq_id in copies]
    if computed:
        parts = parts or {}
        _, answers = target.prefill([s.prefill_entry(parts.get(s.seq_id)) for s in computed],
                                    return_features=True)
        for seq, answer in zip(computed, answers):
            seq.features = from_message(answer)
    if not copied:
        return
    try:
        target.prefill([s.prefill_entry() for s in copied], copies)
    except errors.BatchspecError:
        _release_quietly(target, [s.seq_id for s in computed])
        raise
    known = {s.seq_id: s for s in [*active, *computed]}
    for seq in copied:
        source = known[copies[seq.seq_id]].features
        needed = seq.committed_len - 1
        seq.features = (source.head(needed) if source is not None and source.length >= needed
                        else None)


def _release_quietly(target, seq_ids: list[int]) -> None:
    if not seq_ids:
        return
    try:
        target.release(seq_ids)
    except errors.BatchspecError as error:  # a target lost holds nothing to release
        log.info("could not release %d sequences in the target (%s)", len(seq_ids), error)


def ensure(target, seqs) -> bool:
    """Every sequence knows the features of its target-cached positions (asked of the
    target, which computes them without touching its caches, where not known); False when
    the target could not answer."""
    missing = [s for s in seqs if s.features is None or s.features.length < s.committed_len - 1]
    if not missing:
        return True
    try:
        answers = target.features([s.prefill_entry() for s in missing])
    except (errors.Unavailable, errors.DeadlineExceeded) as error:
        log.info("the target's features are not to be had now (%s)", error)
        return False
    for seq, answer in zip(missing, answers):
        seq.features = from_message(answer)
    return True


def prefill_args(seqs) -> dict:
    """The keyword a feature draft's prefill of `seqs` takes: every token's features."""
    return {"features": {s.seq_id: s.features.fed_with(0, s.committed_len - 1) for s in seqs}}
