"""gRPC edge of the coordinator: validates and converts the public API, streams events.
The one module that converts between `batchspec.v1.generate` messages and engine records."""
import asyncio
import dataclasses
import logging
import math
import random
import time

import grpc
from google.protobuf import message

from batchspec import errors
from batchspec.params import SamplingParams
from batchspec.v1 import generate_pb2, generate_pb2_grpc
from coordinator.engine import Engine
from coordinator.sequence import Finish
from coordinator.text import TextCodec, TextStream

log = logging.getLogger(__name__)
SERVICE_NAME = "batchspec.v1.Coordinator"
MAX_STOP_STRINGS = 16

_FINISH = {Finish.STOP: generate_pb2.FINISH_REASON_STOP,
           Finish.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
           Finish.STOP_STRING: generate_pb2.FINISH_REASON_STOP_STRING}


@dataclasses.dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context_len: int
    max_new_tokens: int = 4096


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool


class Undecodable(bytes):
    """Bytes that arrived as a GenerateRequest but do not parse as one."""

    request_id = ""  # for the log line


def parse_request(data: bytes):
    """The request deserializer: undecodable bytes reach the servicer (which refuses them with
    INVALID_ARGUMENT, like any bad input) instead of failing inside gRPC with UNKNOWN."""
    try:
        return generate_pb2.GenerateRequest.FromString(data)
    except message.DecodeError:
        return Undecodable(data)


def add_to_server(servicer, server) -> None:
    """Register Generate with parse_request (the generated function parses with FromString)."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=parse_request,
        response_serializer=generate_pb2.GenerateResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def validate(request: generate_pb2.GenerateRequest, limits: Limits,
             codec: TextCodec | None, default_max_new_tokens: int | None = None) -> ValidRequest:
    """Check a request; raises InvalidArgument saying what to fix. With
    default_max_new_tokens, a max_new_tokens of 0 means that many, or what the context leaves
    after the prompt if less (the HTTP edge's default); without, 0 is refused."""
    bad = errors.InvalidArgument
    if isinstance(request, Undecodable):
        raise bad(f"the request ({len(request)} bytes) does not parse as a "
                  "batchspec.v1.GenerateRequest")
    given = [name for name in ("prompt", "prompt_token_ids", "messages")
             if getattr(request, name)]
    if len(given) > 1:
        raise bad(f"set one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
    if (request.prompt or request.messages) and codec is None:
        raise bad("this coordinator has no tokenizer: send prompt_token_ids, or start it "
                  "with --tokenizer")
    if request.messages:
        prompt_ids = codec.encode_chat([(m.role, m.content) for m in request.messages])
    elif request.prompt and request.chat and codec.chat_template is not None:
        prompt_ids = codec.encode_chat([("user", request.prompt)])
    elif request.prompt:
        prompt_ids = codec.encode(request.prompt)
    else:
        prompt_ids = list(request.prompt_token_ids)
    if not prompt_ids:
        raise bad("the prompt is empty: send a non-empty prompt or prompt_token_ids")
    outside = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise bad(f"prompt_token_ids {outside[:5]} are outside the vocabulary "
                  f"[0, {limits.vocab_size})")
    max_new_tokens = request.max_new_tokens
    if max_new_tokens == 0 and default_max_new_tokens is not None:
        max_new_tokens = max(1, min(default_max_new_tokens, limits.max_new_tokens,
                                    limits.max_context_len - len(prompt_ids)))
    if max_new_tokens == 0:
        raise bad("max_new_tokens must be >= 1")
    if max_new_tokens > limits.max_new_tokens:
        raise bad(f"max_new_tokens must be <= {limits.max_new_tokens}")
    if len(prompt_ids) + max_new_tokens > limits.max_context_len:
        raise bad(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                  f"({max_new_tokens}) exceeds the model's context of "
                  f"{limits.max_context_len} tokens")
    if request.stop and codec is None:
        raise bad("stop strings need a tokenizer; this coordinator has none")
    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    return ValidRequest(prompt_ids, max_new_tokens, to_sampling(request),
                        list(request.stop), request.ignore_eos)


def to_sampling(request: generate_pb2.GenerateRequest) -> SamplingParams:
    bad = errors.InvalidArgument
    temperature = request.temperature if request.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be a finite number >= 0, not {temperature}")
    top_k = request.top_k if request.HasField("top_k") else 0
    if top_k < 0:
        raise bad(f"top_k must be >= 0 (0 means no limit), not {top_k}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise bad(f"top_p must be in (0, 1], not {top_p}")
    seed = request.seed if request.HasField("seed") else random.getrandbits(63)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


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


async def stream_events(engine: Engine, valid: ValidRequest, codec: TextCodec | None, *,
                        include_special_tokens: bool = False, deadline: float | None = None,
                        on_admitted=None):
    """Submit a valid request and yield its engine events until the one that finishes it;
    raises the error that ends it. A consumer that stops early (the client went away)
    cancels it, which frees its slot and caches at the next step. on_admitted(handle) is
    called once it is queued (for the log line)."""
    text = (TextStream(codec, valid.stop, skip_special_tokens=not include_special_tokens)
            if codec else None)
    events = LoopEvents(asyncio.get_running_loop())
    handle = engine.submit(valid.prompt_token_ids, valid.max_new_tokens, valid.sampling,
                           ignore_eos=valid.ignore_eos, deadline=deadline, text=text,
                           events=events)
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
            engine.cancel(handle)


class CoordinatorServicer(generate_pb2_grpc.CoordinatorServicer):
    """Generate on grpc.aio: an open stream is a suspended coroutine, not a thread, so the
    number of streams is bounded by admission (the pool and the queue), not by workers."""

    def __init__(self, engine: Engine, limits: Limits, codec: TextCodec | None):
        self.engine = engine
        self.limits = limits
        self.codec = codec

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        ending = Ending(request.request_id, time.monotonic())
        try:
            valid = validate(request, self.limits, self.codec)
            remaining = context.time_remaining()  # None when the client set no deadline
            if remaining is not None and remaining < 1e6:
                ending.deadline = ending.started + remaining
            async for event in stream_events(
                    self.engine, valid, self.codec,
                    include_special_tokens=request.include_special_tokens,
                    deadline=ending.deadline, on_admitted=ending.admitted):
                response = generate_pb2.GenerateResponse(
                    token_ids=event.token_ids, text=event.text,
                    num_accepted_draft_tokens=event.num_accepted, draft_text=event.draft_text)
                if event.finish is not None:
                    response.finish_reason = _FINISH[event.finish]
                    response.stats.CopyFrom(to_stats(ending.seq))
                    ending.reason = f"finished ({event.finish.value})"
                yield response
        except errors.BatchspecError as error:
            ending.fail(error, admitted=ending.seq is not None)
            await errors.abort_async(context, error)
        except asyncio.CancelledError:  # the client went away, or its deadline passed
            ending.reason = "deadline" if ending.past_deadline() else "cancelled"
            raise
        finally:
            ending.log()


@dataclasses.dataclass
class Ending:
    """How a request ended, for its one log line."""

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
            self.reason = "invalid" if code == grpc.StatusCode.INVALID_ARGUMENT else "refused"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.reason = "deadline"
        elif code == grpc.StatusCode.CANCELLED:
            self.reason = "cancelled"
        else:
            self.reason = "failed"
        self.detail = f"{code.name}: {error}"

    def log(self) -> None:
        seq = self.seq
        reason = self.reason or "cancelled"  # ended by the server's shutdown or a closed loop
        fields = [f"request {self.request_id or '-'}", f"ended={reason}"]
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


def to_stats(seq) -> generate_pb2.RequestStats:
    return generate_pb2.RequestStats(
        num_drafted_tokens=seq.stats.num_drafted_tokens,
        num_accepted_tokens=seq.stats.num_accepted_tokens,
        num_target_forward_passes=seq.stats.num_target_forward_passes,
        num_generated_tokens=seq.num_generated, num_prompt_tokens=len(seq.prompt_token_ids))
