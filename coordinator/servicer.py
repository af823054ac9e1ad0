"""gRPC edge of the coordinator: converts the public API to and from the requests part.
The one module that converts between `batchspec.v1.generate` messages and engine records."""
import asyncio
import time

import grpc
from google.protobuf import message

from batchspec import errors
from batchspec.v1 import generate_pb2, generate_pb2_grpc
from coordinator.grammar import Grammars, ResponseFormat
from coordinator.requests import Ending, Limits, RequestInput, stream_events, validate
from coordinator.sequence import Finish
from coordinator.text import TextCodec

SERVICE_NAME = "batchspec.v1.Coordinator"

_FINISH = {Finish.STOP: generate_pb2.FINISH_REASON_STOP,
           Finish.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
           Finish.STOP_STRING: generate_pb2.FINISH_REASON_STOP_STRING}


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


def to_input(request: generate_pb2.GenerateRequest) -> RequestInput:
    """The request as the requests part reads it; undecodable bytes are refused here."""
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument(f"the request ({len(request)} bytes) does not parse as a "
                                     "batchspec.v1.GenerateRequest")

    def optional(name):
        return getattr(request, name) if request.HasField(name) else None

    return RequestInput(
        prompt=request.prompt, prompt_token_ids=tuple(request.prompt_token_ids),
        messages=tuple((m.role, m.content) for m in request.messages), chat=request.chat,
        max_new_tokens=request.max_new_tokens, temperature=optional("temperature"),
        top_k=optional("top_k"), top_p=optional("top_p"), seed=optional("seed"),
        stop=tuple(request.stop), ignore_eos=request.ignore_eos,
        logprobs=request.logprobs.num_top if request.HasField("logprobs") else None,
        prompt_logprobs=request.prompt_logprobs.num_top
        if request.HasField("prompt_logprobs") else None,
        response_format=to_format(request), presence_penalty=optional("presence_penalty"),
        frequency_penalty=optional("frequency_penalty"),
        logit_bias=tuple(request.logit_bias.items()))


def to_format(request: generate_pb2.GenerateRequest) -> ResponseFormat | None:
    if not request.HasField("response_format"):
        return None
    kind = request.response_format.WhichOneof("format")
    if kind is None:
        raise errors.InvalidArgument("response_format is set but names no format: set one of "
                                     "json_object, json_schema and regex")
    value = getattr(request.response_format, kind)
    if kind == "json_object":
        if not value:
            raise errors.InvalidArgument("response_format.json_object must be true when set")
        value = ""
    return ResponseFormat(kind, value)


class CoordinatorServicer(generate_pb2_grpc.CoordinatorServicer):
    """Generate on grpc.aio: an open stream is a suspended coroutine, not a thread, so the
    number of streams is bounded by admission (the pool and the queue), not by workers."""

    def __init__(self, router, limits: Limits, codec: TextCodec | None,
                 grammars: Grammars | None = None):
        self.router = router
        self.limits = limits
        self.codec = codec
        self.grammars = grammars

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        ending = Ending("grpc", request.request_id, time.monotonic())
        try:
            valid = validate(to_input(request), self.limits, self.codec,
                             grammars=self.grammars)
            remaining = context.time_remaining()  # None when the client set no deadline
            if remaining is not None and remaining < 1e6:
                ending.deadline = ending.started + remaining
            async for event in stream_events(
                    self.router, valid, self.codec,
                    include_special_tokens=request.include_special_tokens,
                    deadline=ending.deadline, on_admitted=ending.admitted):
                response = generate_pb2.GenerateResponse(
                    token_ids=event.token_ids, text=event.text,
                    num_accepted_draft_tokens=event.num_accepted, draft_text=event.draft_text,
                    logprobs=to_logprobs(event.logprobs or []),
                    prompt_logprobs=to_logprobs(event.prompt_logprobs or []))
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


def to_logprobs(scored) -> list[generate_pb2.TokenLogprob]:
    return [generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob,
                                      top_token_ids=[i for i, _ in t.top],
                                      top_logprobs=[v for _, v in t.top]) for t in scored]


def to_stats(seq) -> generate_pb2.RequestStats:
    return generate_pb2.RequestStats(
        num_drafted_tokens=seq.stats.num_drafted_tokens,
        num_accepted_tokens=seq.stats.num_accepted_tokens,
        num_target_forward_passes=seq.stats.num_target_forward_passes,
        num_generated_tokens=seq.num_generated, num_prompt_tokens=len(seq.prompt_token_ids))
