"""Text between two tokenizers, exactly, with the `tokenizers` library (no torch): what each
token id stands for as bytes, text to ids, and where two tokenizations of one text share a
boundary.

A draft of another tokenizer than the target's (draft_service.translating) reads the target's
committed tokens as text and writes its proposals back as target tokens through this module.
Everything here is checked in bytes: a token whose bytes are not known exactly (an unknown
token, a decoder that inserts spaces) ends what can be mapped, so nothing is ever sent that
the draft did not write.
"""
from __future__ import annotations

import itertools
import pathlib

from tokenizers import Tokenizer

from batchspec.tokenbytes import TokenBytes


class TokenTable:
    """A tokenizer's ids as bytes. `bytes_of[i]` is what id i stands for in a text (an added
    token: its content), or None where that is not known exactly (then nothing after it maps)."""

    def __init__(self, tokenizer: Tokenizer, name: str = ""):
        self.tokenizer = tokenizer
        self.name = name
        token_bytes = TokenBytes(tokenizer)
        self.bytes_of: list[bytes | None] = [
            token_bytes(i) for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]

    @classmethod
    def from_file(cls, path: str) -> "TokenTable":
        """From a tokenizer.json, or a directory holding one."""
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return cls(Tokenizer.from_file(str(file)), str(path))

    @property
    def vocab_size(self) -> int:
        return len(self.bytes_of)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` alone: no special tokens added, added tokens recognised."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_bytes(self, token_ids) -> bytes:
        """The bytes of `token_ids` up to the first one not known exactly."""
        return b"".join(mapped(self, token_ids)[1])

    def check_exact(self, sample: str) -> None:
        """Raise ValueError unless the characters of `sample` that this tokenizer knows
        (each alone spelled back exactly), at least half of them, encode together to ids
        that spell them back: a tokenizer whose text cannot be read back exactly (one that
        drops spaces, say) cannot be translated."""
        known = "".join(c for c in sample if self.text_bytes(self.encode(c)) == c.encode())
        if len(known) < len(sample) / 2 or self.text_bytes(self.encode(known)) != known.encode():
            raise ValueError(f"the tokenizer at {self.name or '(given)'} does not spell its "
                             "tokens as the text they stand for, so its tokens cannot be "
                             "mapped to another tokenizer's exactly")


def mapped(table: TokenTable, token_ids) -> tuple[int, list[bytes]]:
    """(how many of `token_ids` have known bytes, counted from the first; their bytes)."""
    pieces = []
    for token_id in token_ids:
        piece = table.bytes_of[token_id] if 0 <= token_id < table.vocab_size else None
        if not piece:  # unknown, or no text at all: no boundary can be placed after it
            break
        pieces.append(piece)
    return len(pieces), pieces


def complete_text(data: bytes) -> tuple[str, int]:
    """The longest prefix of `data` that is whole UTF-8 characters, as text, and its length
    in bytes (a byte-level token may end inside a character)."""
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as error:
        return data[:error.start].decode("utf-8"), error.start


def offsets(pieces: list[bytes]) -> list[int]:
    """Byte offsets of the boundaries after each piece."""
    return list(itertools.accumulate(len(piece) for piece in pieces))


def shared_boundaries(a: list[bytes], b: list[bytes]) -> list[tuple[int, int]]:
    """(i, j) for each byte offset where a[:i] and b[:j] end together (i, j >= 1), between
    characters (a text re-read from a boundary inside a character would not decode)."""
    joined = b"".join(a)
    where_b = {offset: j + 1 for j, offset in enumerate(offsets(b))}
    return [(i + 1, where_b[offset]) for i, offset in enumerate(offsets(a))
            if offset in where_b and (offset == len(joined) or joined[offset] & 0xC0 != 0x80)]


def to_tokens(table: TokenTable, data: bytes, context: bytes = b"") -> list[int]:
    """The tokens of `table` that spell a prefix of `data`, each meant whole, as the
    tokenizer splits `data` after `context` (the text before it): `context + data` (whole
    characters) encoded, the tokens after the boundary at the end of `context` kept while
    their bytes are data's, and the last dropped, since more text would change it (the end
    of a word, a merge). Where no token ends at that boundary (one merges across it),
    `data` is encoded alone. A space the tokenizer writes before the first word
    (SentencePiece) counts before the context."""
    if context:
        tokens = _after(table, context, data)
        if tokens is not None:
            return tokens
    return _after(table, b"", data) or []


def _after(table: TokenTable, context: bytes, data: bytes) -> list[int] | None:
    """to_tokens over one encoding of context + data; None where no token ends where the
    context does."""
    text, _ = complete_text(context + data)
    spelled = text.encode()
    if len(spelled) <= len(context):
        return []
    ids = table.encode(text)
    count, pieces = mapped(table, ids)
    joined = b"".join(pieces)
    lead = 1 if joined.startswith(b" ") and not spelled.startswith(b" ") else 0
    spelled = b" " * lead + spelled
    at, first = 0, None
    for i, piece in enumerate(pieces):
        if at == lead + len(context) and first is None:
            first = i
        if spelled[at:at + len(piece)] != piece:
            count = i
            break
        at += len(piece)
    if first is None and at == lead + len(context):
        first = count
    if first is None:
        return None
    return ids[first:max(first, count - 1)]
