"""One request's sequence and the bookkeeping of what each service has cached for it.

Invariants between steps, for an active sequence with committed length L
(prompt + generated tokens):
- target.cache_len == L - 1: the target holds every committed token but the last, which is
  fed first in the next verification. While a long prompt is fed to it in chunks
  (`prefilling`), it holds fewer, and the sequence joins no step until it holds L - 1.
- for each draft kind d, with D = drafts[d]: D.valid_len <= D.cache_len and
  D.valid_len <= L - 1: the first valid_len positions of that draft's cache are committed
  tokens; what follows them (rejected proposals) is rolled back before its next proposal. A
  draft not used for a while falls behind; it is fed the tokens it missed when used again.
Lengths are explicit integers; nothing is derived from token values (pad and EOS may share ids).
"""
import collections
import dataclasses
import enum
import time

from batchspec.params import SamplingParams


class Finish(enum.Enum):
    STOP = "stop"  # an end-of-sequence token (kept in the output)
    LENGTH = "length"  # max_new_tokens reached
    STOP_STRING = "stop_string"  # a stop string appeared in the text


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target, and the most likely tokens at its
    position ((token id, log-probability), most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class Stats:
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forward_passes: int = 0


@dataclasses.dataclass
class ServiceCache:
    """What one service has cached for a sequence."""

    cache_len: int | None = None  # None: not cached there (must prefill before use)

    def _forget(self) -> None:  # forget_caches is the one caller
        self.cache_len = None


@dataclasses.dataclass
class DraftState(ServiceCache):
    """What one draft kind has cached for a sequence."""

    valid_len: int = 0
    # the kind refused the sequence's tokens (a vocabulary or a context it lacks): it never
    # drafts for it (forget keeps this)
    refused: bool = False

    def _forget(self) -> None:
        self.cache_len, self.valid_len = None, 0


@dataclasses.dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    sampling: SamplingParams = SamplingParams()
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    target: ServiceCache = dataclasses.field(default_factory=ServiceCache)
    drafts: list[DraftState] = dataclasses.field(default_factory=list)  # one per draft kind
    finish: Finish | None = None
    stats: Stats = dataclasses.field(default_factory=Stats)
    last_step: int = 0  # engine step at which the sequence last advanced (for fairness)
    cohort: int | None = None  # the cohort it is stepped with (scheduler); None: not yet placed
    created: float = dataclasses.field(default_factory=time.monotonic)
    # Optional coordinator.text.TextStream: the generated text and its stop strings.
    text: object = dataclasses.field(default=None, repr=False, compare=False)
    # Log-probabilities asked for (None: not asked; n: with n alternatives per position): of
    # the generated tokens, and of the prompt (scored by the target at admission; kept in
    # prompt_logprobs until the first event carries them).
    logprobs: int | None = None
    prompt_logprobs_top: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = dataclasses.field(default=None, repr=False)
    # Structured output: a grammar.Constraint at the generated tokens (None: unconstrained).
    constraint: object = dataclasses.field(default=None, repr=False, compare=False)
    # The target's features of its cached positions (coordinator.features.FeatureLog), kept
    # while a draft that reads them is configured; None: not known (asked for when needed).
    features: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        # computed once: admissions look prompts up among every active sequence
        self.prompt_hash = hash(tuple(self.prompt_token_ids))

    @property
    def committed_len(self) -> int:
        return len(self.token_ids)

    def prefill_entry(self, limit: int | None = None) -> tuple[int, list[int]]:
        """(seq_id, tokens) for a fresh cache: every committed token but the last, which the
        next step feeds (the cache invariant); with `limit`, only the first `limit` of them (a
        long prompt, fed the rest in chunks: Peers.extend_target)."""
        tokens = self.token_ids[:-1]
        return self.seq_id, tokens if limit is None else tokens[:limit]

    @property
    def prefilling(self) -> bool:
        """The target holds part of the prompt only: chunks of it are still to be fed."""
        return self.target.cache_len is not None and \
            self.target.cache_len < self.committed_len - 1

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def shares_prompt(self, other: "Sequence") -> bool:
        """Whether this fresh sequence's cache can start as a copy of `other`'s prompt (n
        choices of one request, a prompt asked again): the same prompt, of more than a token
        to cache, and nothing generated yet."""
        return not self.num_generated and len(self.prompt_token_ids) >= 3 \
            and self.prompt_hash == other.prompt_hash \
            and self.prompt_token_ids == other.prompt_token_ids

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def output_counts(self) -> dict[int, int] | None:
        """{token id: times generated} where a presence or frequency penalty reads it (the
        target's VerifyEntry.output_token_counts); None elsewhere. Counted afresh from the
        committed record, so nothing else has to follow a rollback or a move."""
        if not self.sampling.penalized:
            return None
        return dict(collections.Counter(self.generated_token_ids))

    @property
    def draft_room(self) -> int:
        """The most drafts a step may usefully verify for it: a step commits at most its
        drafts and one more token, so drafts past its remaining tokens but one are for
        nothing (none on its last token)."""
        return max(0, self.max_new_tokens - self.num_generated - 1)

    def commit(self, output_token_ids: list[int]) -> list[int]:
        """Append the step's output tokens, stopping at the first stop token (kept) and at
        max_new_tokens. Returns the tokens actually committed."""
        committed = []
        for token_id in output_token_ids:
            if self.finish is not None:
                break
            self.token_ids.append(token_id)
            committed.append(token_id)
            if token_id in self.stop_token_ids:
                self.finish = Finish.STOP
            elif self.num_generated >= self.max_new_tokens:
                self.finish = Finish.LENGTH
        if self.constraint is not None:
            self.constraint.advance(committed)
        return committed

    def cut_at_stop_string(self, unused: int) -> None:
        """Drop the last `unused` committed tokens, which came after a stop string's end in
        the text (a step commits several; the target alone would have stopped before them)."""
        if unused:
            del self.token_ids[-unused:]
            self.finish = Finish.STOP_STRING

    def draft_append_need(self, kind: int = 0) -> int:
        """Committed tokens draft `kind` must be fed before proposing (>= 1: the last one)."""
        return self.committed_len - min(self.drafts[kind].valid_len, self.committed_len - 1)


EVERY_KIND = None  # forget_caches(drafts=EVERY_KIND): every draft kind's record


def forget_caches(seqs, *, target: bool = False, drafts=()) -> None:
    """The one place a sequence's record of what a service caches for it is forgotten: the
    service lost or released it, or the sequence moves to another engine. `target`: the
    target's record; `drafts`: the draft kinds' (indices, or EVERY_KIND). A forgotten record
    means nothing is cached there: the sequence is prefilled there again before that service
    serves it (the target at admission, a draft when a step first gives it the row)."""
    for seq in seqs:
        if target:
            seq.target._forget()
        for state in (seq.drafts if drafts is EVERY_KIND
                      else [seq.drafts[index] for index in drafts]):
            state._forget()


def mixed(sequences: list[Sequence]) -> bool:
    """Rows at different committed lengths: the services must realign them (copy their
    caches into one padded batch) before a step; rows of one length never need it."""
    return len({s.committed_len for s in sequences}) > 1
