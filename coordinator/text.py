"""Text in and out, with the `tokenizers` library (no torch): prompts to ids, ids to streamed
text, and stop strings."""
import pathlib

from tokenizers import Tokenizer


class TextCodec:
    def __init__(self, path: str):
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tokenizer = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


class Detokenizer:
    """Turns a growing list of generated ids into text deltas. An incomplete multi-byte
    character (decoded as U+FFFD at the end) waits for the next tokens."""

    def __init__(self, codec: TextCodec | None, stop: list[str]):
        self.codec = codec
        self.stop = stop
        self.emitted = 0  # characters of the full text already sent

    def text(self, token_ids: list[int]) -> str:
        return self.codec.decode(token_ids) if self.codec else ""

    def stop_index(self, token_ids: list[int]) -> int | None:
        """Where the first stop string starts in the text, or None."""
        text = self.text(token_ids)
        found = [text.find(s) for s in self.stop if s and s in text]
        return min(found) if found else None

    def delta(self, token_ids: list[int], final: bool) -> str:
        text = self.text(token_ids)
        cut = self.stop_index(token_ids) if self.stop else None
        if cut is not None:
            text = text[:cut]
        elif not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        out = text[self.emitted:] if len(text) > self.emitted else ""
        self.emitted = max(self.emitted, len(text))
        return out
