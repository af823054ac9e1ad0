from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class LogprobsSpec(_message.Message):
    __slots__ = ("num_top",)
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    num_top: int
    def __init__(self, num_top: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillEntry(_message.Message):
    __slots__ = ("seq_id", "token_ids", "prompt_logprobs", "next_token_id", "copy_from", "features")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COPY_FROM_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: LogprobsSpec
    next_token_id: int
    copy_from: int
    features: Features
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[LogprobsSpec, _Mapping]] = ..., next_token_id: _Optional[int] = ..., copy_from: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("num_positions", "width", "values_f16")
    NUM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    VALUES_F16_FIELD_NUMBER: _ClassVar[int]
    num_positions: int
    width: int
    values_f16: bytes
    def __init__(self, num_positions: _Optional[int] = ..., width: _Optional[int] = ..., values_f16: _Optional[bytes] = ...) -> None: ...

class PrefillCommand(_message.Message):
    __slots__ = ("entries", "return_features")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PrefillEntry]
    return_features: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[PrefillEntry, _Mapping]]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("cache_lens", "prompt_logprobs", "features")
    CACHE_LENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    cache_lens: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    features: _containers.RepeatedCompositeFieldContainer[Features]
    def __init__(self, cache_lens: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., features: _Optional[_Iterable[_Union[Features, _Mapping]]] = ...) -> None: ...

class TrimEntry(_message.Message):
    __slots__ = ("seq_id", "expected_cache_len", "keep_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    KEEP_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    expected_cache_len: int
    keep_len: int
    def __init__(self, seq_id: _Optional[int] = ..., expected_cache_len: _Optional[int] = ..., keep_len: _Optional[int] = ...) -> None: ...

class TrimCommand(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TrimEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[TrimEntry, _Mapping]]] = ...) -> None: ...

class TrimResult(_message.Message):
    __slots__ = ("cache_lens",)
    CACHE_LENS_FIELD_NUMBER: _ClassVar[int]
    cache_lens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cache_lens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseCommand(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResult(_message.Message):
    __slots__ = ("num_sequences",)
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    def __init__(self, num_sequences: _Optional[int] = ...) -> None: ...

class CommandError(_message.Message):
    __slots__ = ("code", "message", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "max_context_len", "num_sequences", "num_cached_tokens", "device", "dtype", "step_costs", "packs_positions", "instance_id", "draining", "max_sequences", "max_cached_tokens", "feature_width", "calibrated", "vocabulary")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_COSTS_FIELD_NUMBER: _ClassVar[int]
    PACKS_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_len: int
    num_sequences: int
    num_cached_tokens: int
    device: str
    dtype: str
    step_costs: _containers.RepeatedCompositeFieldContainer[StepCost]
    packs_positions: bool
    instance_id: str
    draining: bool
    max_sequences: int
    max_cached_tokens: int
    feature_width: int
    calibrated: bool
    vocabulary: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context_len: _Optional[int] = ..., num_sequences: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., step_costs: _Optional[_Iterable[_Union[StepCost, _Mapping]]] = ..., packs_positions: _Optional[bool] = ..., instance_id: _Optional[str] = ..., draining: _Optional[bool] = ..., max_sequences: _Optional[int] = ..., max_cached_tokens: _Optional[int] = ..., feature_width: _Optional[int] = ..., calibrated: _Optional[bool] = ..., vocabulary: _Optional[str] = ...) -> None: ...

class StepCost(_message.Message):
    __slots__ = ("rows", "tokens", "seconds", "context")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    rows: int
    tokens: int
    seconds: float
    context: int
    def __init__(self, rows: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., context: _Optional[int] = ...) -> None: ...

class CommandTiming(_message.Message):
    __slots__ = ("compute_seconds", "realign_seconds", "forward_seconds")
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REALIGN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    compute_seconds: float
    realign_seconds: float
    forward_seconds: float
    def __init__(self, compute_seconds: _Optional[float] = ..., realign_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ...) -> None: ...
