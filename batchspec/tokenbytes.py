"""What a token id stands for as bytes, read from a tokenizer.json with the `tokenizers`
library (no torch).

A token's text alone is not its bytes: a byte-level token may hold part of a character (an
emoji split over two tokens decodes to U+FFFD twice). The bytes are read from the tokenizer's
own vocabulary instead: GPT-2's printable stand-ins for bytes (ByteLevel), SentencePiece's
"▁" for a space and <0xNN> for a raw byte (Metaspace, ByteFallback), an added token's content.
Where a decoder changes the text in ways a token alone cannot say (WordPiece's "##", the
spaces it inserts), its bytes are not known: None.
"""
from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (ByteLevel pre-tokenizer and decoder)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {t for d in decoder.get("decoders", []) for t in _decoder_types(d)}
    return {decoder.get("type", "")}


def _metaspace_bytes(token: str) -> bytes:
    """A SentencePiece-style token: "▁" is a space, <0xNN> a raw byte."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("▁", " ").encode()


class TokenBytes:
    """token_bytes(i): the bytes token id i stands for in a text (an added token: its
    content), or None where they are not known exactly (an unknown id or token, a decoder
    that rewrites the text)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        spec = json.loads(tokenizer.to_str())
        self.decoders = _decoder_types(spec.get("decoder"))
        self.added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
        self.unknown = spec.get("model", {}).get("unk_token")

    def __call__(self, token_id: int) -> bytes | None:
        if token_id in self.added:
            return self.added[token_id].encode()
        token = self.tokenizer.id_to_token(token_id)
        if token is None or token == self.unknown:
            return None
        if "ByteLevel" in self.decoders:
            alphabet = _byte_level_alphabet()
            return bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) \
                else None
        if "Metaspace" in self.decoders or "ByteFallback" in self.decoders:
            return _metaspace_bytes(token)
        if self.decoders - {"Fuse", "Strip"}:
            return None  # WordPiece, BPE suffixes...: spaces it inserts
        return token.encode()
