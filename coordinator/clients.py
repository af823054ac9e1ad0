"""Clients of the draft and target services: the one place where the coordinator converts
between its plain Python records and the internal protobuf messages."""
import dataclasses
import itertools
import queue
import threading
import time

import grpc

from batchspec import errors
from batchspec import server as server_lib
from batchspec.params import SamplingParams
from batchspec.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from coordinator.sequence import TokenLogprob

_END = object()


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model: str
    vocab_size: int
    eos_token_ids: list[int]
    max_context_len: int
    num_sequences: int
    num_cached_tokens: int
    # (rows, tokens, seconds) of forwards measured at the service's start-up
    step_costs: tuple[tuple[int, int, float], ...] = ()
    device: str = ""  # e.g. "cpu", "cuda:0"
    packs_positions: bool = False  # a verify pays for each row's real tokens only
    instance_id: str = ""  # new at every start of the service
    draining: bool = False  # shutting down: takes no new sequence
    # a target: the width of the features it returns; a draft: of those it reads (0: none)
    feature_width: int = 0
    calibrated: bool = False  # a draft whose probabilities track acceptance
    vocabulary: str = ""  # a digest of what its token ids mean ("": unknown)


@dataclasses.dataclass(frozen=True)
class ProposeSpec:
    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: list[int]
    sampling: SamplingParams
    features: object = None  # cache_pb2.Features for a draft that reads them


@dataclasses.dataclass(frozen=True)
class Proposal:
    seq_id: int
    draft_token_ids: list[int]
    cache_len: int
    cut: bool = False  # a confidence cut ended it short: it holds what the draft was sure of


@dataclasses.dataclass(frozen=True)
class VerifySpec:
    seq_id: int
    expected_cache_len: int
    append_token_ids: list[int]
    draft_token_ids: list[int]
    sampling: SamplingParams
    logprobs: int | None = None  # see Sequence.logprobs
    token_masks: tuple[bytes, ...] = ()  # structured output: see grammar.Constraint.masks
    # verify the first num_proposed tokens the target's hosted draft proposes first (then
    # draft_token_ids and token_masks are empty); 0: draft_token_ids
    num_proposed: int = 0
    # with a presence or frequency penalty: {token id: times output} before the first output
    output_counts: dict[int, int] | None = None
    # a verify of rounds: what a lookup's draft goes on with (VerifyEntry.continuation_token_ids)
    continuation: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False  # the request goes on past end-of-sequence tokens


@dataclasses.dataclass(frozen=True)
class Timing:
    """A service's own account of a command; round trip minus compute is RPC + encoding."""

    compute_seconds: float = 0.0
    realign_seconds: float = 0.0
    forward_seconds: float = 0.0

    def __add__(self, other: "Timing") -> "Timing":
        """Two commands' times added up (a step that called two drafts)."""
        return Timing(self.compute_seconds + other.compute_seconds,
                      self.realign_seconds + other.realign_seconds,
                      self.forward_seconds + other.forward_seconds)


def _timing(message) -> Timing:
    return Timing(message.compute_seconds, message.realign_seconds, message.forward_seconds)


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
    seq_id: int
    num_accepted: int
    output_token_ids: list[int]
    cache_len: int
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked
    features: object = None  # cache_pb2.Features of the positions cached, when asked
    # a verify of rounds (VerifyCommand.rounds): (drafts verified, accepted) of each round run
    rounds: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Hosted:
    """What a target's hosted draft answered the propose of a verify command."""

    proposals: list[Proposal]  # one per propose entry, in order; none where it refused
    timing: Timing  # the draft's own account (inside the verify's)
    error: errors.BatchspecError | None = None  # why it refused


def _logprobs(token_ids, wire) -> list[TokenLogprob]:
    return [TokenLogprob(t, w.logprob, tuple(zip(w.top_token_ids, w.top_logprobs)))
            for t, w in zip(token_ids, wire)]


class CommandStream:
    """One bidirectional command stream: `call` sends a command and waits for its result.
    A broken stream raises errors.Unavailable; a refused command raises its typed error."""

    def __init__(self, method, command_type, stall_timeout_s: float = 120.0,
                 instance_id: str | None = None):
        """instance_id: the service instance this stream is for (see ServiceClient.instance);
        the service refuses the stream if it is another."""
        self._stall_timeout_s = stall_timeout_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._command_type = command_type
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        metadata = ((server_lib.INSTANCE_METADATA, instance_id),) if instance_id else None
        self._responses = method(iter(self._requests.get, _END), metadata=metadata)
        self._watchdog = _Watchdog(stall_timeout_s, self._responses.cancel)

    def call(self, timeout: float | None = None, **command):
        """Send one command and wait for its result. With a timeout, the service is told how
        long we wait (it refuses what it cannot start in time). A service that does not answer
        within stall_timeout_s, whatever the timeout, is taken for hung: the stream is
        cancelled under it (raising Unavailable), so a hang is found before the requests'
        deadlines run out."""
        with self._lock:
            command_id = next(self._ids)
            timeout_ms = min(int(timeout * 1000), 2**32 - 1) if timeout else 0
            self._requests.put(self._command_type(command_id=command_id, timeout_ms=timeout_ms,
                                                  **command))
            self._watchdog.arm()
            try:
                result = next(self._responses)
            except (grpc.RpcError, StopIteration) as error:
                raise errors.Unavailable(f"command stream broke: {_describe(error)}") from error
            finally:
                self._watchdog.disarm()
        if result.command_id != command_id:
            raise errors.Unavailable(f"result {result.command_id} answers no command "
                                     f"(expected {command_id})")
        result_type = result.WhichOneof("result")
        if result_type == "error":
            raise errors.from_status_code(result.error.code, result.error.message,
                                          result.error.reason)
        return getattr(result, result_type)

    def close(self):
        self._watchdog.close()
        self._requests.put(_END)
        self._responses.cancel()


class _Watchdog:
    """Calls `cancel` once a command has waited more than limit_s for its result. One thread
    per stream looks every limit_s / 4 (at most every second), so sending a command, on the
    path of every step, starts no thread (as a threading.Timer per command did)."""

    def __init__(self, limit_s: float, cancel):
        self._limit_s = limit_s
        self._cancel = cancel
        self._sent_at: float | None = None  # time.monotonic() of the command awaiting a result
        self._closed = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="stream watchdog").start()

    def arm(self) -> None:
        self._sent_at = time.monotonic()

    def disarm(self) -> None:
        self._sent_at = None

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(min(1.0, self._limit_s / 4)):
            sent_at = self._sent_at
            if sent_at is not None and time.monotonic() - sent_at > self._limit_s:
                self._cancel()
                return


def _describe(error) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return "stream ended"


def _model_info(info) -> ModelInfo:
    return ModelInfo(info.model, info.vocab_size, list(info.eos_token_ids),
                     info.max_context_len, info.num_sequences, info.num_cached_tokens,
                     tuple((c.rows, c.tokens, c.seconds) for c in info.step_costs),
                     info.device, info.packs_positions, info.instance_id, info.draining,
                     info.feature_width, info.calibrated, info.vocabulary)


class Probe:
    """A Describe in flight (ServiceClient.probe)."""

    def __init__(self, future):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def info(self) -> ModelInfo | None:
        """Once done: the service's ModelInfo, or None when it did not answer in time."""
        try:
            return _model_info(self._future.result())
        except (grpc.RpcError, grpc.FutureCancelledError):
            return None


class Answered:
    """A probe already answered (a draft in this process: coordinator.local_draft, the
    benchmark's in-process engines)."""

    def __init__(self, info: ModelInfo):
        self._info = info

    def done(self) -> bool:
        return True

    def info(self) -> ModelInfo:
        return self._info


class ServiceClient:
    """What both internal services answer: cache commands and Describe."""

    stub_type = None
    command_type = None

    def __init__(self, address: str, stall_timeout_s: float = 120.0, credentials=None,
                 tls_name: str | None = None):
        """credentials: grpc.ChannelCredentials for (mutual) TLS; None for plaintext.
        tls_name: the name the service's certificate must carry, where it is not the
        address's host (a replica found by DNS or Kubernetes is dialled by IP)."""
        self.address = address
        self.stall_timeout_s = stall_timeout_s
        options = server_lib.CHANNEL_OPTIONS
        if credentials is not None and tls_name:
            options = options + [("grpc.ssl_target_name_override", tls_name)]
        self.channel = server_lib.open_channel(address, credentials, options)
        self.stub = self.stub_type(self.channel)
        self._stream: CommandStream | None = None
        # The service instance our caches there belong to (ModelInfo.instance_id), once it
        # described itself: streams are opened for it alone. None: not known yet.
        self.instance: str | None = None

    @property
    def stream(self) -> CommandStream:
        if self._stream is None:
            self._stream = CommandStream(self.stub.RunCommands, self.command_type,
                                         self.stall_timeout_s, self.instance)
        return self._stream

    def probe(self, timeout: float | None = None) -> "Probe":
        """Ask the service to describe itself, without waiting: gRPC carries the call on its
        own threads. The service answers Describe only when its runner takes commands, so an
        answer means it is back; no answer within the stall timeout means it is still down."""
        return Probe(self.stub.Describe.future(cache_pb2.DescribeRequest(),
                                               timeout=timeout or self.stall_timeout_s))

    def reset(self) -> None:
        """Drop the stream (after a failure); the next call opens a new one."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def wait_ready(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as error:
            raise errors.Unavailable(f"{self.address} not reachable in {timeout}s") from error

    def describe(self, timeout: float = 10.0) -> ModelInfo:
        try:
            return _model_info(self.stub.Describe(cache_pb2.DescribeRequest(), timeout=timeout))
        except grpc.RpcError as error:
            raise errors.Unavailable(f"{self.address}: {_describe(error)}") from error

    def prefill(self, entries: list[tuple[int, list[int]]],
                copies: dict[int, int] | None = None, features: dict | None = None,
                return_features: bool = False):
        """copies: seq_id -> the sequence whose cache it starts from (PrefillEntry.copy_from);
        features: seq_id -> cache_pb2.Features (a draft that reads them). Returns the cache
        lengths, or with return_features (the target) (lengths, Features per entry)."""
        copies, features = copies or {}, features or {}
        result = self.stream.call(prefill=cache_pb2.PrefillCommand(
            return_features=return_features, entries=[
                cache_pb2.PrefillEntry(seq_id=s, token_ids=t, copy_from=copies.get(s),
                                       features=features.get(s))
                for s, t in entries]))
        if return_features:
            return list(result.cache_lens), list(result.features)
        return list(result.cache_lens)

    def trim(self, entries: list[tuple[int, int, int]]) -> list[int]:
        result = self.stream.call(trim=cache_pb2.TrimCommand(entries=[
            cache_pb2.TrimEntry(seq_id=s, expected_cache_len=e, keep_len=k)
            for s, e, k in entries]))
        return list(result.cache_lens)

    def release(self, seq_ids: list[int]) -> int:
        return self.stream.call(release=cache_pb2.ReleaseCommand(seq_ids=seq_ids)).num_sequences

    def close(self) -> None:
        self.reset()
        self.channel.close()


def _sampling(spec: SamplingParams) -> cache_pb2.SamplingParams:
    return cache_pb2.SamplingParams(
        temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed,
        presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty,
        logit_bias=dict(spec.logit_bias))


class DraftClient(ServiceClient):
    stub_type = draft_pb2_grpc.DraftServiceStub
    command_type = draft_pb2.DraftCommand

    def propose(self, num_drafts: int, realign: bool, specs: list[ProposeSpec],
                timeout: float | None = None,
                min_confidence: float = 0.0) -> tuple[list[Proposal], Timing]:
        result = self.stream.call(timeout=timeout, propose=propose_command(
            num_drafts, realign, specs, min_confidence))
        return _proposals(result), _timing(result.timing)


def propose_command(num_drafts: int, realign: bool, specs: list[ProposeSpec],
                    min_confidence: float = 0.0) -> draft_pb2.ProposeCommand:
    """A propose, for a draft service or for a target's hosted draft (TargetClient.verify)."""
    return draft_pb2.ProposeCommand(
        num_draft_tokens=num_drafts, realign=realign, min_draft_confidence=min_confidence,
        entries=[draft_pb2.ProposeEntry(seq_id=s.seq_id, expected_cache_len=s.expected_cache_len,
                                        keep_len=s.keep_len, append_token_ids=s.append_token_ids,
                                        sampling=_sampling(s.sampling), features=s.features)
                 for s in specs])


def _proposals(result: draft_pb2.ProposeResult) -> list[Proposal]:
    return [Proposal(e.seq_id, list(e.draft_token_ids), e.cache_len, e.cut)
            for e in result.entries]


class TargetClient(ServiceClient):
    stub_type = target_pb2_grpc.TargetServiceStub
    command_type = target_pb2.TargetCommand
    # a draft reads the target's features: verifies return those of the positions cached
    features_for_drafts = False

    def verify(self, realign: bool, specs: list[VerifySpec], timeout: float | None = None,
               return_features: bool | None = None,
               propose: draft_pb2.ProposeCommand | None = None, plain_steps: int = 1,
               rounds: int = 1):
        """(outcomes, Timing) of a verify; with `propose` (propose_command's, for the draft
        the target hosts, run first), (outcomes, Timing, Hosted). plain_steps > 1: specs
        without drafts, each decoding that many tokens (VerifyCommand.plain_steps); rounds
        > 1: up to that many rounds of `propose` and of the specs' lines (their drafts, then
        their continuation: VerifyCommand.rounds)."""
        if return_features is None:
            return_features = self.features_for_drafts
        command = target_pb2.VerifyCommand(realign=realign, return_features=return_features,
                                           propose=propose, plain_steps=plain_steps,
                                           rounds=rounds, entries=[
            target_pb2.VerifyEntry(seq_id=s.seq_id, expected_cache_len=s.expected_cache_len,
                                   append_token_ids=s.append_token_ids,
                                   draft_token_ids=s.draft_token_ids,
                                   sampling=_sampling(s.sampling),
                                   logprobs=None if s.logprobs is None
                                   else cache_pb2.LogprobsSpec(num_top=s.logprobs),
                                   token_masks=s.token_masks, num_proposed=s.num_proposed,
                                   output_token_counts=s.output_counts,
                                   continuation_token_ids=s.continuation if rounds > 1 else (),
                                   ignore_eos=s.ignore_eos)
            for s in specs])
        result = self.stream.call(timeout=timeout, verify=command)
        outcomes = [VerifyOutcome(e.seq_id, e.num_accepted, list(e.output_token_ids),
                                  e.cache_len, _logprobs(e.output_token_ids, e.logprobs)
                                  if s.logprobs is not None else None,
                                  e.features if return_features else None,
                                  tuple(zip(e.round_drafts, e.round_accepted)))
                    for e, s in zip(result.entries, specs)]
        if propose is None:
            return outcomes, _timing(result.timing)
        if result.WhichOneof("proposed") == "propose":
            hosted = Hosted(_proposals(result.propose), _timing(result.propose.timing))
        else:
            refused = result.propose_error
            hosted = Hosted([], Timing(), errors.from_status_code(refused.code, refused.message,
                                                                  refused.reason))
        return outcomes, _timing(result.timing), hosted

    def features(self, prefixes: list[tuple[int, list[int]]]) -> list:
        """The target's Features of every position of each (seq_id, tokens) prefix, computed
        without touching its caches."""
        result = self.stream.call(features=target_pb2.FeaturesCommand(entries=[
            target_pb2.FeaturesEntry(seq_id=s, token_ids=t) for s, t in prefixes]))
        return list(result.features)

    def prefill_scored(self, entries: list[tuple[int, list[int]]],
                       scoring: dict[int, tuple[int, int]]) -> dict[int, list[TokenLogprob]]:
        """prefill, scoring the prompts of the sequences in `scoring` (seq_id: (num_top,
        next_token_id)); returns each one's TokenLogprobs (prompt tokens but the first)."""
        result = self.stream.call(prefill=cache_pb2.PrefillCommand(entries=[
            cache_pb2.PrefillEntry(
                seq_id=s, token_ids=t, next_token_id=scoring[s][1] if s in scoring else 0,
                prompt_logprobs=cache_pb2.LogprobsSpec(num_top=scoring[s][0])
                if s in scoring else None) for s, t in entries]))
        return {s: _logprobs(t[1:] + [scoring[s][1]], scored.tokens)
                for (s, t), scored in zip(entries, result.prompt_logprobs) if s in scoring}
