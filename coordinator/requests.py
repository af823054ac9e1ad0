"""The requests part: what a request is on its way in and out, shared by both public edges.

An edge (gRPC or HTTP) turns its own wire format into a `RequestInput`, `validate` checks it
against the served model's `Limits` and gives a `ValidRequest`, and `stream_events` submits it
and yields its `Event`s. Neither edge imports the other; nothing here knows either wire format.
"""
import asyncio
import dataclasses
import logging
import math
import queue
import random
import threading
import time

from batchspec import errors
from batchspec.params import SamplingParams, logit_adjustments
from coordinator.grammar import Grammar, Grammars, ResponseFormat
from coordinator.sequence import Finish, Sequence, TokenLogprob
from coordinator.text import TextCodec, TextStream

log = logging.getLogger(__name__)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # most likely tokens per position a request may ask for (as OpenAI)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model and the coordinator allow a request."""

    vocab_size: int
    max_context_len: int
    max_new_tokens: int = 4096


@dataclasses.dataclass(frozen=True)
class RequestInput:
    """A request as an edge received it, before any check. Exactly one of prompt,
    prompt_token_ids and messages should be set; None: the field was not given."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    chat: bool = False  # send `prompt` as one user message through the chat template
    max_new_tokens: int = 0  # 0: not given
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # log-probabilities (None: not asked; n: with the n most likely tokens per position)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # structured output (None: free text)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None  # each sequence of the request starts its own matcher


def validate(request: RequestInput, limits: Limits, codec: TextCodec | None,
             default_max_new_tokens: int | None = None,
             grammars: Grammars | None = None) -> ValidRequest:
    """Check a request; raises InvalidArgument saying what to fix. With
    default_max_new_tokens, a max_new_tokens of 0 means that many, or what the context leaves
    after the prompt if less (the HTTP edge's default); without, 0 is refused. grammars:
    compiles a response format (None: structured output is refused)."""
    bad = errors.InvalidArgument
    prompt_ids = _prompt_token_ids(request, codec)
    outside = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise bad(f"prompt_token_ids {outside[:5]} are outside the vocabulary "
                  f"[0, {limits.vocab_size})", "prompt_token_ids")
    if len(prompt_ids) >= limits.max_context_len:
        raise errors.ContextLengthExceeded(
            f"the prompt ({len(prompt_ids)} tokens) leaves no room for an answer in the "
            f"model's context of {limits.max_context_len} tokens: shorten it",
            "prompt_token_ids")
    max_new_tokens = request.max_new_tokens
    if max_new_tokens == 0 and default_max_new_tokens is not None:
        max_new_tokens = max(1, min(default_max_new_tokens, limits.max_new_tokens,
                                    limits.max_context_len - len(prompt_ids)))
    if max_new_tokens < 1:
        raise bad("max_new_tokens must be >= 1", "max_new_tokens")
    if max_new_tokens > limits.max_new_tokens:
        raise bad(f"max_new_tokens must be <= {limits.max_new_tokens}", "max_new_tokens")
    if len(prompt_ids) + max_new_tokens > limits.max_context_len:
        raise errors.ContextLengthExceeded(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's context of {limits.max_context_len} tokens", "max_new_tokens")
    if request.stop and codec is None:
        raise bad("stop strings need a tokenizer; this coordinator has none")
    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise bad(f"{name} asks for {value} alternatives per token; at most "
                      f"{MAX_TOP_LOGPROBS}", name)
    return ValidRequest(prompt_ids, max_new_tokens, to_sampling(request, limits.vocab_size),
                        list(request.stop), request.ignore_eos, request.logprobs,
                        request.prompt_logprobs, _grammar(request, grammars))


def _grammar(request: RequestInput, grammars: Grammars | None) -> Grammar | None:
    """The request's response format compiled (None: none asked for)."""
    if request.response_format is None:
        return None
    if grammars is None:
        raise errors.InvalidArgument("structured output needs a tokenizer; this coordinator "
                                     "has none (start it with --tokenizer)")
    if request.ignore_eos:
        raise errors.InvalidArgument("ignore_eos cannot be combined with a response format: "
                                     "the format ends where end-of-sequence is allowed")
    return grammars.compile(request.response_format)


def _prompt_token_ids(request: RequestInput, codec: TextCodec | None) -> list[int]:
    """The prompt as token ids: given, or encoded (chat messages through the template)."""
    bad = errors.InvalidArgument
    given = [name for name in ("prompt", "prompt_token_ids", "messages")
             if getattr(request, name)]
    if len(given) > 1:
        raise bad(f"set one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
    if (request.prompt or request.messages) and codec is None:
        raise bad("this coordinator has no tokenizer: send prompt_token_ids, or start it "
                  "with --tokenizer")
    if request.messages:
        prompt_ids = codec.encode_chat(list(request.messages))
    elif request.prompt and request.chat and codec.chat_template is not None:
        prompt_ids = codec.encode_chat([("user", request.prompt)])
    elif request.prompt:
        prompt_ids = codec.encode(request.prompt)
    else:
        prompt_ids = list(request.prompt_token_ids)
    if not prompt_ids:
        raise bad("the prompt is empty: send a non-empty prompt or prompt_token_ids", "prompt")
    return prompt_ids


def to_sampling(request: RequestInput, vocab_size: int | None = None) -> SamplingParams:
    """Sampling parameters, the unset ones at their defaults (greedy; a random seed; no
    penalty or bias); logit_bias's token ids checked against `vocab_size` where given."""
    bad = errors.InvalidArgument
    temperature = 0.0 if request.temperature is None else request.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be a finite number >= 0, not {temperature}", "temperature")
    top_k = 0 if request.top_k is None else request.top_k
    if not 0 <= top_k < 2**31:  # (an int32 on the wire)
        raise bad(f"top_k must be in [0, 2**31) (0 means no limit), not {top_k}", "top_k")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise bad(f"top_p must be in (0, 1], not {top_p}", "top_p")
    seed = random.getrandbits(63) if request.seed is None else request.seed
    if not 0 <= seed < 2**64:  # (a uint64 on the wire)
        raise bad(f"seed must be in [0, 2**64), not {seed}", "seed")
    presence = request.presence_penalty or 0.0
    frequency = request.frequency_penalty or 0.0
    bias = dict(request.logit_bias)
    if len(bias) != len(request.logit_bias):
        raise bad("logit_bias names a token more than once", "logit_bias")
    wrong = logit_adjustments(presence, frequency, bias, vocab_size)
    if wrong is not None:
        field, message = wrong
        raise bad(message, field)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          presence_penalty=presence, frequency_penalty=frequency,
                          logit_bias=tuple(sorted((t, b) for t, b in bias.items() if b)))


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's stream receives: new tokens, and at the end a finish or an error."""

    token_ids: list[int]
    finish: Finish | None = None
    error: errors.BatchspecError | None = None
    text: str = ""  # their text, when the request has a TextStream
    num_drafted: int = 0  # drafts verified in the step that committed these tokens
    num_accepted: int = 0  # the first this many of token_ids were accepted draft tokens
    # target forward passes the step ran for them: one a verify, one a token of plain steps
    num_passes: int = 0
    draft_text: str = ""  # the part of `text` they gave (a prefix of it)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first event, when asked


class RequestHandle:
    """One submitted request: its sequence, its deadline, where its events go."""

    def __init__(self, seq: Sequence, deadline: float | None, events=None):
        self.seq = seq
        self.deadline = deadline  # time.monotonic() value, or None
        # where the engine thread puts this request's events: anything with put(Event)
        # (a queue.Queue by default; the public edges pass LoopEvents)
        self.events = events if events is not None else queue.Queue()
        self.cancelled = threading.Event()
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def fail(self, error: errors.BatchspecError) -> None:
        self.events.put(Event([], error=error))


class LoopEvents:
    """A request's event queue that the engine thread fills and an asyncio handler awaits:
    `put` (any thread) hands the event to the event loop, which wakes the handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self):
        return await self._queue.get()


async def stream_events(router, valid: ValidRequest, codec: TextCodec | None, *,
                        include_special_tokens: bool = False, deadline: float | None = None,
                        on_admitted=None, together=None):
    """Submit a valid request to `router` and yield its events until the one that finishes
    it; raises the error that ends it. A consumer that stops early (the client went away)
    cancels it, which frees its slot and caches at the next step. on_admitted(handle) is
    called once it is queued (for the log line). together: requests given the same value
    go to the same target (see Router.submit)."""
    text = (TextStream(codec, valid.stop, skip_special_tokens=not include_special_tokens)
            if codec else None)
    events = LoopEvents(asyncio.get_running_loop())
    handle = router.submit(valid.prompt_token_ids, valid.max_new_tokens, valid.sampling,
                           ignore_eos=valid.ignore_eos, deadline=deadline, text=text,
                           events=events, logprobs=valid.logprobs,
                           prompt_logprobs=valid.prompt_logprobs,
                           constraint=valid.grammar.start() if valid.grammar else None,
                           together=together)
    if on_admitted is not None:
        on_admitted(handle)
    finished = False
    try:
        while not finished:
            event = await events.get()
            if event.error is not None:
                raise event.error
            finished = event.finish is not None
            yield event
    finally:
        if not finished:
            router.cancel(handle)


@dataclasses.dataclass
class Ending:
    """How a request ended, for its one log line (either edge)."""

    edge: str  # "grpc" or "http"
    request_id: str
    started: float
    deadline: float | None = None
    seq: object = None
    reason: str | None = None
    detail: str = ""

    def admitted(self, handle) -> None:
        self.seq = handle.seq

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline - 0.05

    def fail(self, error: errors.BatchspecError, admitted: bool) -> None:
        code = errors.to_status_code(error)
        if not admitted:
            self.reason = "invalid" if code.name == "INVALID_ARGUMENT" else "refused"
        elif code.name == "DEADLINE_EXCEEDED":
            self.reason = "deadline"
        elif code.name == "CANCELLED":
            self.reason = "cancelled"
        else:
            self.reason = "failed"
        self.detail = f"{code.name}: {error}"

    def log(self) -> None:
        seq = self.seq
        reason = self.reason or "cancelled"  # ended by the server's shutdown or a closed loop
        fields = [f"request {loggable(self.request_id) or '-'}", f"edge={self.edge}",
                  f"ended={reason}"]
        if seq is not None:
            drafted = seq.stats.num_drafted_tokens
            acceptance = seq.stats.num_accepted_tokens / drafted if drafted else 0.0
            fields += [f"seq={seq.seq_id}", f"prompt_tokens={len(seq.prompt_token_ids)}",
                       f"tokens={seq.num_generated}", f"acceptance={acceptance:.2f}",
                       f"steps={seq.stats.num_target_forward_passes}"]
        fields.append(f"time={time.monotonic() - self.started:.3f}s")
        if self.detail:
            fields.append(f"error={self.detail!r}")
        log.info(" ".join(fields))


def loggable(text: str, limit: int = 128) -> str:
    """A client's string for a log line: at most `limit` characters (then "..."), each
    unprintable one escaped, so that one record stays one line."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")
