"""gRPC edge of the coordinator: validates and converts the public API, streams events.
The one module that converts between `batchspec.v1.generate` messages and engine records."""
import dataclasses
import logging
import math
import random
import time

from batchspec import errors
from batchspec.params import SamplingParams
from batchspec.v1 import generate_pb2, generate_pb2_grpc
from coordinator.engine import Engine
from coordinator.sequence import Finish
from coordinator.text import Detokenizer, TextCodec

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


def validate(request: generate_pb2.GenerateRequest, limits: Limits,
             codec: TextCodec | None) -> ValidRequest:
    """Check a request; raises InvalidArgument saying what to fix."""
    bad = errors.InvalidArgument
    if request.prompt and request.prompt_token_ids:
        raise bad("set either prompt or prompt_token_ids, not both")
    if request.prompt:
        if codec is None:
            raise bad("this coordinator has no tokenizer: send prompt_token_ids, or start it "
                      "with --tokenizer")
        prompt_ids = codec.encode(request.prompt)
    else:
        prompt_ids = list(request.prompt_token_ids)
    if not prompt_ids:
        raise bad("the prompt is empty: send a non-empty prompt or prompt_token_ids")
    outside = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if outside:
        raise bad(f"prompt_token_ids {outside[:5]} are outside the vocabulary "
                  f"[0, {limits.vocab_size})")
    if request.max_new_tokens == 0:
        raise bad("max_new_tokens must be >= 1")
    if request.max_new_tokens > limits.max_new_tokens:
        raise bad(f"max_new_tokens must be <= {limits.max_new_tokens}")
    if len(prompt_ids) + request.max_new_tokens > limits.max_context_len:
        raise bad(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                  f"({request.max_new_tokens}) exceeds the model's context of "
                  f"{limits.max_context_len} tokens")
    if request.stop and codec is None:
        raise bad("stop strings need a tokenizer; this coordinator has none")
    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
    return ValidRequest(prompt_ids, request.max_new_tokens, to_sampling(request),
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


class CoordinatorServicer(generate_pb2_grpc.CoordinatorServicer):
    def __init__(self, engine: Engine, limits: Limits, codec: TextCodec | None):
        self.engine = engine
        self.limits = limits
        self.codec = codec

    def Generate(self, request, context):
        started = time.monotonic()
        try:
            valid = validate(request, self.limits, self.codec)
            remaining = context.time_remaining()  # huge when the client set no deadline
            deadline = started + remaining if remaining is not None and remaining < 1e6 else None
            detok = Detokenizer(self.codec, valid.stop)
            stop_check = ((lambda seq: detok.stop_index(seq.generated_token_ids) is not None)
                          if valid.stop else None)
            handle = self.engine.submit(valid.prompt_token_ids, valid.max_new_tokens,
                                        valid.sampling, ignore_eos=valid.ignore_eos,
                                        deadline=deadline, stop_check=stop_check)
        except errors.BatchspecError as error:
            errors.abort_with(context, error)
        context.add_callback(lambda: self.engine.cancel(handle))
        yield from self._stream(handle, detok, context, request.request_id, started)

    def _stream(self, handle, detok, context, request_id, started):
        seq = handle.seq
        while True:
            event = handle.events.get()
            if event.error is not None:
                log.info("request %s (seq %d) failed: %s", request_id or "-", seq.seq_id,
                         event.error)
                errors.abort_with(context, event.error)
            final = event.finish is not None
            response = generate_pb2.GenerateResponse(
                token_ids=event.token_ids, text=detok.delta(seq.generated_token_ids, final))
            if final:
                response.finish_reason = _FINISH[event.finish]
                response.stats.CopyFrom(to_stats(seq))
                log_finished(request_id, seq, time.monotonic() - started)
            yield response
            if final:
                return


def to_stats(seq) -> generate_pb2.RequestStats:
    return generate_pb2.RequestStats(
        num_drafted_tokens=seq.stats.num_drafted_tokens,
        num_accepted_tokens=seq.stats.num_accepted_tokens,
        num_target_forward_passes=seq.stats.num_target_forward_passes,
        num_generated_tokens=seq.num_generated, num_prompt_tokens=len(seq.prompt_token_ids))


def log_finished(request_id, seq, seconds: float) -> None:
    drafted = seq.stats.num_drafted_tokens
    acceptance = seq.stats.num_accepted_tokens / drafted if drafted else 0.0
    log.info("request %s seq=%d prompt_tokens=%d tokens=%d acceptance=%.2f steps=%d "
             "time=%.3fs finish=%s", request_id or "-", seq.seq_id, len(seq.prompt_token_ids),
             seq.num_generated, acceptance, seq.stats.num_target_forward_passes, seconds,
             seq.finish.value)
