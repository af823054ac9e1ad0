"""Text in and out, with the `tokenizers` library (no torch): prompts to ids, chats through
the model's chat template, ids to streamed text, and stop strings."""
import json
import pathlib

from tokenizers import Tokenizer

from batchspec import errors
from batchspec.tokenbytes import TokenBytes

CHAT_ROLES = ("system", "user", "assistant")

# Tokens decoded together with each new one, so that merges across a token boundary (a
# space, a multi-byte character split over tokens) come out as they would in a full decode.
_CONTEXT_TOKENS = 6
# A UTF-8 character has at most 4 bytes: this many U+FFFD at the end of the text are bytes
# that will never be a character, and are sent as they are.
_MAX_CHAR_TOKENS = 4


class TextCodec:
    def __init__(self, path: str):
        file = pathlib.Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.chat_template, self.special = read_chat_template(file.parent)
        self._template = None
        self._token_bytes = TokenBytes(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (part of a character decodes to
        U+FFFD, as other servers give it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a part of a character is its bytes, not U+FFFD: a client
        joins a split character from them); its text's where the tokenizer does not say
        (batchspec.tokenbytes)."""
        spelled = self._token_bytes(token_id)
        return self.token_text(token_id).encode() if spelled is None else spelled

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        """The conversation (role, content) as the model's chat template writes it, ending
        with the assistant's turn to answer. Raises InvalidArgument for what it cannot
        render."""
        if self.chat_template is None:
            raise errors.InvalidArgument("this model's tokenizer has no chat template: send a "
                                         "plain prompt instead of messages")
        if not messages:
            raise errors.InvalidArgument("messages is empty: send at least one message",
                                         "messages")
        for role, _content in messages:
            if role not in CHAT_ROLES:
                raise errors.InvalidArgument(
                    f"message role {role!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _template_error
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=True, **self.special)
        except errors.InvalidArgument:
            raise
        except Exception as error:  # a template that cannot take this conversation
            raise errors.InvalidArgument(f"the chat template refused the messages: {error}")

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of the rendered conversation (the template writes its own special
        tokens, so none are added)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _template_error(message: str):
    raise errors.InvalidArgument(f"the chat template refused the messages: {message}")


def read_chat_template(directory: pathlib.Path) -> tuple[str | None, dict]:
    """(chat template source or None, {bos_token, eos_token, ...}) from a tokenizer's files:
    chat_template.jinja, else tokenizer_config.json's chat_template."""
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    special = {name: _token_text(config.get(name)) for name in
               ("bos_token", "eos_token", "pad_token", "unk_token")}
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get(
        "chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special


def _token_text(value) -> str:
    if isinstance(value, dict):  # an AddedToken written out
        return value.get("content", "")
    return value or ""


class TextStream:
    """One request's generated text, built as tokens arrive, at a cost per step that depends
    on the new tokens only (not on how long the text already is).

    Invariants, after every `feed`:
    - the text of ids[prefix:] is decoded together (a window of at most 2 * _CONTEXT_TOKENS
      plus the new ids) and its first `done` characters were produced already: what follows
      them is the new text, as a full decode would give it (the incremental detokenisation of
      TGI and vLLM). A trailing U+FFFD (a character whose bytes are not all here yet) waits
      for the next tokens.
    - `pending` is text produced but not streamed: the longest tail that could still grow into
      a stop string (shorter than the longest stop string). No part of a stop string is ever
      streamed, and each search looks only at `pending` plus the new text.
    - special tokens (end of sequence, chat markers) give no text unless asked for.
    """

    def __init__(self, codec: TextCodec, stop=(), skip_special_tokens: bool = True):
        self.codec = codec
        self.stop = [s for s in stop if s]
        self.longest_stop = max(map(len, self.stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # the window decoded at each step is ids[prefix:]
        self.done = 0  # characters of the window's text already produced
        self.pending = ""
        self.stopped = False
        self.unused = 0  # tokens fed after the one that completed a stop string

    def feed(self, token_ids: list[int]) -> str:
        """Add committed tokens; return the text now safe to stream. After a stop string,
        `stopped` is set and the text ends just before it; the tokens fed after the one that
        completed it (as the target alone, one token a step, would have stopped there) are
        counted in `unused` and give nothing."""
        if self.stopped:
            self.unused += len(token_ids)
            return ""
        # with stop strings, one token at a time: the first that completes one is the last
        pieces = [[token_id] for token_id in token_ids] if self.stop else [token_ids]
        for used, piece in enumerate(pieces, 1):
            self.ids.extend(piece)
            self.pending += self._new_text()
            found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
            if found:
                self.stopped = True
                self.unused += len(token_ids) - used
                out, self.pending = self.pending[:min(found)], ""
                return out
        keep = len(self.pending) - self._held_back()
        out, self.pending = self.pending[:keep], self.pending[keep:]
        return out

    def flush(self) -> str:
        """At the end of the request: everything not yet streamed (a held-back tail that did
        not become a stop string, an incomplete trailing character)."""
        if self.stopped:
            return ""
        self.pending += self._decode(self.ids[self.prefix:])[self.done:]
        out, self.pending = self.pending, ""
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.codec.decode(ids, self.skip_special_tokens)

    def _new_text(self) -> str:
        window = self._decode(self.ids[self.prefix:])
        complete = window.rstrip("\ufffd")
        if len(window) - len(complete) >= _MAX_CHAR_TOKENS:
            complete = window  # not a character in the making, but bytes that are no text
        new = complete[self.done:]
        self.done = max(self.done, len(complete))
        start = len(self.ids) - _CONTEXT_TOKENS
        if start >= self.prefix + _CONTEXT_TOKENS:
            # Slide the window: the text it has not produced yet (an incomplete character)
            # is its end, and stays its end.
            not_done = len(window) - self.done
            self.prefix = start
            self.done = len(self._decode(self.ids[start:])) - not_done
        return new

    def _held_back(self) -> int:
        """How many characters at the end of `pending` begin some stop string."""
        for size in range(min(len(self.pending), self.longest_stop - 1), 0, -1):
            if any(s.startswith(self.pending[-size:]) for s in self.stop):
                return size
        return 0
