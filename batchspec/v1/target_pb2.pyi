from batchspec.v1 import cache_pb2 as _cache_pb2
from batchspec.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyEntry(_message.Message):
    __slots__ = ("seq_id", "expected_cache_len", "append_token_ids", "draft_token_ids", "sampling", "logprobs", "token_masks", "num_proposed", "output_token_counts", "continuation_token_ids", "ignore_eos")
    class OutputTokenCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    expected_cache_len: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _cache_pb2.SamplingParams
    logprobs: _cache_pb2.LogprobsSpec
    token_masks: _containers.RepeatedScalarFieldContainer[bytes]
    num_proposed: int
    output_token_counts: _containers.ScalarMap[int, int]
    continuation_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, seq_id: _Optional[int] = ..., expected_cache_len: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_cache_pb2.SamplingParams, _Mapping]] = ..., logprobs: _Optional[_Union[_cache_pb2.LogprobsSpec, _Mapping]] = ..., token_masks: _Optional[_Iterable[bytes]] = ..., num_proposed: _Optional[int] = ..., output_token_counts: _Optional[_Mapping[int, int]] = ..., continuation_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class VerifyCommand(_message.Message):
    __slots__ = ("realign", "entries", "return_features", "propose", "plain_steps", "rounds")
    REALIGN_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    realign: bool
    entries: _containers.RepeatedCompositeFieldContainer[VerifyEntry]
    return_features: bool
    propose: _draft_pb2.ProposeCommand
    plain_steps: int
    rounds: int
    def __init__(self, realign: _Optional[bool] = ..., entries: _Optional[_Iterable[_Union[VerifyEntry, _Mapping]]] = ..., return_features: _Optional[bool] = ..., propose: _Optional[_Union[_draft_pb2.ProposeCommand, _Mapping]] = ..., plain_steps: _Optional[int] = ..., rounds: _Optional[int] = ...) -> None: ...

class VerifyResultEntry(_message.Message):
    __slots__ = ("seq_id", "num_accepted", "output_token_ids", "cache_len", "logprobs", "features", "round_drafts", "round_accepted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROUND_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_accepted: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_cache_pb2.TokenLogprobs]
    features: _cache_pb2.Features
    round_drafts: _containers.RepeatedScalarFieldContainer[int]
    round_accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_accepted: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_cache_pb2.TokenLogprobs, _Mapping]]] = ..., features: _Optional[_Union[_cache_pb2.Features, _Mapping]] = ..., round_drafts: _Optional[_Iterable[int]] = ..., round_accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class FeaturesCommand(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FeaturesEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[FeaturesEntry, _Mapping]]] = ...) -> None: ...

class FeaturesEntry(_message.Message):
    __slots__ = ("seq_id", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FeaturesResult(_message.Message):
    __slots__ = ("features",)
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    features: _containers.RepeatedCompositeFieldContainer[_cache_pb2.Features]
    def __init__(self, features: _Optional[_Iterable[_Union[_cache_pb2.Features, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("entries", "timing", "propose", "propose_error")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[VerifyResultEntry]
    timing: _cache_pb2.CommandTiming
    propose: _draft_pb2.ProposeResult
    propose_error: _cache_pb2.CommandError
    def __init__(self, entries: _Optional[_Iterable[_Union[VerifyResultEntry, _Mapping]]] = ..., timing: _Optional[_Union[_cache_pb2.CommandTiming, _Mapping]] = ..., propose: _Optional[_Union[_draft_pb2.ProposeResult, _Mapping]] = ..., propose_error: _Optional[_Union[_cache_pb2.CommandError, _Mapping]] = ...) -> None: ...

class TargetCommand(_message.Message):
    __slots__ = ("command_id", "timeout_ms", "prefill", "verify", "trim", "release", "features")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    timeout_ms: int
    prefill: _cache_pb2.PrefillCommand
    verify: VerifyCommand
    trim: _cache_pb2.TrimCommand
    release: _cache_pb2.ReleaseCommand
    features: FeaturesCommand
    def __init__(self, command_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., prefill: _Optional[_Union[_cache_pb2.PrefillCommand, _Mapping]] = ..., verify: _Optional[_Union[VerifyCommand, _Mapping]] = ..., trim: _Optional[_Union[_cache_pb2.TrimCommand, _Mapping]] = ..., release: _Optional[_Union[_cache_pb2.ReleaseCommand, _Mapping]] = ..., features: _Optional[_Union[FeaturesCommand, _Mapping]] = ...) -> None: ...

class TargetResult(_message.Message):
    __slots__ = ("command_id", "error", "prefill", "verify", "trim", "release", "features")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    error: _cache_pb2.CommandError
    prefill: _cache_pb2.PrefillResult
    verify: VerifyResult
    trim: _cache_pb2.TrimResult
    release: _cache_pb2.ReleaseResult
    features: FeaturesResult
    def __init__(self, command_id: _Optional[int] = ..., error: _Optional[_Union[_cache_pb2.CommandError, _Mapping]] = ..., prefill: _Optional[_Union[_cache_pb2.PrefillResult, _Mapping]] = ..., verify: _Optional[_Union[VerifyResult, _Mapping]] = ..., trim: _Optional[_Union[_cache_pb2.TrimResult, _Mapping]] = ..., release: _Optional[_Union[_cache_pb2.ReleaseResult, _Mapping]] = ..., features: _Optional[_Union[FeaturesResult, _Mapping]] = ...) -> None: ...
