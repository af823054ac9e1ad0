"""Structured output: a request's format as a grammar, and each sequence's place in it.

The grammar engine is llguidance: it needs no torch (the coordinator has none), computes a
mask over a 49k vocabulary in tens of microseconds, takes consumed tokens back (drafts are
tried against the grammar and rolled back), and compiles JSON schemas itself. The coordinator
holds one matcher per constrained sequence, at the sequence's committed tokens; before each
verification it masks every position the row outputs from, and cuts a greedy row's draft
where the grammar forbids it (see `drafting.DraftedCohort.constrained`). The target applies the
masks, so greedy answers are the target's own under the constraint and sampling draws from
the target's masked distribution.

Masks are bit sets: bit t of little-endian 32-bit word t // 32 allows token t, which is
byte t // 8, bit t % 8.
"""
import dataclasses
import json
import threading

import llguidance

from batchspec import errors

FORMATS = ("json_object", "json_schema", "regex")


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    kind: str  # one of FORMATS
    value: str = ""  # json_schema: the schema as JSON text; regex: the expression


def allows(mask: bytes, token_id: int) -> bool:
    return bool(mask[token_id >> 3] >> (token_id & 7) & 1)


class Grammars:
    """Compiles formats against the served tokenizer. The engine's view of the tokenizer is
    built on first use (about 0.2 s for SmolLM2's 49k vocabulary) and shared after."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer = None
        self._unusable = None  # why the tokenizer cannot be used, once that is known
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None and self._unusable is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json, n_vocab=self.vocab_size,
                        eos_token=sorted(self.eos_token_ids))
                except ValueError as error:  # a tokenizer whose token bytes it cannot tell
                    self._unusable = str(error)
            if self._unusable is not None:
                raise errors.InvalidArgument("structured output is not available with this "
                                             f"model's tokenizer: {self._unusable}",
                                             "response_format")
            return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> "Grammar":
        """The format as a checked grammar; raises InvalidArgument saying what is wrong."""
        def bad(message: str) -> errors.InvalidArgument:
            return errors.InvalidArgument(message, "response_format")

        if fmt.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif fmt.kind == "json_schema":
            try:
                schema = json.loads(fmt.value)
            except ValueError as error:
                raise bad(f"json_schema is not JSON: {error}")
            if not isinstance(schema, dict):
                raise bad("json_schema must be a JSON object (a schema)")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        elif fmt.kind == "regex":
            if not fmt.value:
                raise bad("regex is empty")
            grammar = llguidance.LLMatcher.grammar_from_regex(fmt.value)
        else:
            raise bad(f"response format {fmt.kind!r} is not one of {', '.join(FORMATS)}")
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer())
        if is_error:
            raise bad(f"the {fmt.kind} cannot be used: {messages[0]}")
        return Grammar(self, grammar)


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A compiled format; `start` gives a fresh matcher for one sequence."""

    grammars: Grammars
    text: str

    def start(self) -> "Constraint":
        matcher = llguidance.LLMatcher(self.grammars.tokenizer(), self.text, log_level=0)
        if matcher.is_error():
            raise errors.InvalidArgument(f"the format cannot be used: {matcher.get_error()}")
        return Constraint(matcher, self.grammars.eos_token_ids)


class Constraint:
    """One sequence's place in its grammar: the matcher has consumed exactly the sequence's
    generated tokens (an end-of-sequence token ends the sequence and is not consumed)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self._eos = eos_token_ids
        self._all = b"\xff" * len(self._mask())  # the engine's mask size (whole words)

    def masks(self, draft_token_ids: list[int]) -> tuple[list[bytes], int]:
        """(masks, allowed): one mask per output position of a row verifying these drafts
        (len(drafts) + 1), and how many leading drafts the grammar allows. Past the first
        forbidden draft (which the target will reject) or an allowed end of sequence, the
        positions are never output from and their masks allow everything. The matcher is
        left where it was."""
        masks, allowed, _ = self.cut(draft_token_ids, 0)
        return masks + [self._all] * (len(draft_token_ids) + 1 - len(masks)), allowed

    def cut(self, draft_token_ids: list[int], extend: int) -> tuple[list[bytes], int, list[int]]:
        """(masks, allowed, forced) for a row that verifies drafts[:allowed] + forced: the
        grammar's forced continuation after the allowed drafts (at most `extend` tokens, in
        its own tokenization, which the target may split differently: they are drafts, not
        certainties), and one mask per output position (allowed + len(forced) + 1). The
        matcher is left where it was."""
        masks, consumed = [self._mask()], 0
        for token_id in draft_token_ids:
            if not allows(masks[-1], token_id) or token_id in self._eos:
                break
            if not self._matcher.consume_token(token_id):
                raise errors.BatchspecError(f"grammar: {self._matcher.get_error()}")
            consumed += 1
            masks.append(self._mask())
        allowed = consumed + (consumed < len(draft_token_ids)
                              and allows(masks[-1], draft_token_ids[consumed]))
        forced = []
        if allowed == consumed and extend > 0:  # the matcher stands after the allowed drafts
            for token_id in self._matcher.compute_ff_tokens()[:extend]:
                if token_id in self._eos or not self._matcher.consume_token(token_id):
                    break
                forced.append(token_id)
                masks.append(self._mask())
        masks += [self._all] * (allowed + len(forced) + 1 - len(masks))  # after an end
        if consumed + len(forced) and not self._matcher.rollback(consumed + len(forced)):
            raise errors.BatchspecError(f"grammar: {self._matcher.get_error()}")
        return masks, allowed, forced

    def advance(self, token_ids: list[int]) -> None:
        """The sequence committed these tokens (the target picked them under the masks)."""
        for token_id in token_ids:
            if token_id in self._eos:
                return
            if not self._matcher.consume_token(token_id):
                raise errors.BatchspecError(
                    f"grammar: token {token_id} was committed against the grammar: "
                    f"{self._matcher.get_error()}")

    def _mask(self) -> bytes:
        mask = self._matcher.compute_bitmask()
        if self._matcher.is_error() or not any(mask):
            raise errors.BatchspecError(f"grammar: no token is allowed "
                                        f"({self._matcher.get_error() or 'dead end'})")
        return mask
