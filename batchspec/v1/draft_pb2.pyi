from batchspec.v1 import cache_pb2 as _cache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeEntry(_message.Message):
    __slots__ = ("seq_id", "expected_cache_len", "keep_len", "append_token_ids", "sampling", "features")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    KEEP_LEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _cache_pb2.SamplingParams
    features: _cache_pb2.Features
    def __init__(self, seq_id: _Optional[int] = ..., expected_cache_len: _Optional[int] = ..., keep_len: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_cache_pb2.SamplingParams, _Mapping]] = ..., features: _Optional[_Union[_cache_pb2.Features, _Mapping]] = ...) -> None: ...

class ProposeCommand(_message.Message):
    __slots__ = ("num_draft_tokens", "realign", "entries", "min_draft_confidence")
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REALIGN_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    num_draft_tokens: int
    realign: bool
    entries: _containers.RepeatedCompositeFieldContainer[ProposeEntry]
    min_draft_confidence: float
    def __init__(self, num_draft_tokens: _Optional[int] = ..., realign: _Optional[bool] = ..., entries: _Optional[_Iterable[_Union[ProposeEntry, _Mapping]]] = ..., min_draft_confidence: _Optional[float] = ...) -> None: ...

class ProposeResultEntry(_message.Message):
    __slots__ = ("seq_id", "draft_token_ids", "cache_len", "cut")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_len: int
    cut: bool
    def __init__(self, seq_id: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., cache_len: _Optional[int] = ..., cut: _Optional[bool] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("entries", "timing")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ProposeResultEntry]
    timing: _cache_pb2.CommandTiming
    def __init__(self, entries: _Optional[_Iterable[_Union[ProposeResultEntry, _Mapping]]] = ..., timing: _Optional[_Union[_cache_pb2.CommandTiming, _Mapping]] = ...) -> None: ...

class DraftCommand(_message.Message):
    __slots__ = ("command_id", "timeout_ms", "prefill", "propose", "trim", "release")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    timeout_ms: int
    prefill: _cache_pb2.PrefillCommand
    propose: ProposeCommand
    trim: _cache_pb2.TrimCommand
    release: _cache_pb2.ReleaseCommand
    def __init__(self, command_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., prefill: _Optional[_Union[_cache_pb2.PrefillCommand, _Mapping]] = ..., propose: _Optional[_Union[ProposeCommand, _Mapping]] = ..., trim: _Optional[_Union[_cache_pb2.TrimCommand, _Mapping]] = ..., release: _Optional[_Union[_cache_pb2.ReleaseCommand, _Mapping]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("command_id", "error", "prefill", "propose", "trim", "release")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    TRIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    error: _cache_pb2.CommandError
    prefill: _cache_pb2.PrefillResult
    propose: ProposeResult
    trim: _cache_pb2.TrimResult
    release: _cache_pb2.ReleaseResult
    def __init__(self, command_id: _Optional[int] = ..., error: _Optional[_Union[_cache_pb2.CommandError, _Mapping]] = ..., prefill: _Optional[_Union[_cache_pb2.PrefillResult, _Mapping]] = ..., propose: _Optional[_Union[ProposeResult, _Mapping]] = ..., trim: _Optional[_Union[_cache_pb2.TrimResult, _Mapping]] = ..., release: _Optional[_Union[_cache_pb2.ReleaseResult, _Mapping]] = ...) -> None: ...
