from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "first_token_id", "first_token_logprob", "resume_token_ids", "tpot_target_seconds", "kv_request_id", "priority", "kv_prefix_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    first_token_id: int
    first_token_logprob: _common_pb2.TokenLogprob
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tpot_target_seconds: float
    kv_request_id: str
    priority: int
    kv_prefix_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., tpot_target_seconds: _Optional[float] = ..., kv_request_id: _Optional[str] = ..., priority: _Optional[int] = ..., kv_prefix_tokens: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: DecodeChunk
    complete: DecodeComplete
    def __init__(self, chunk: _Optional[_Union[DecodeChunk, _Mapping]] = ..., complete: _Optional[_Union[DecodeComplete, _Mapping]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.Logprobs
    prompt_logprobs: _common_pb2.Logprobs
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ...) -> None: ...

class DecodeComplete(_message.Message):
    __slots__ = ("finish_reason", "stop_token_id", "usage", "queue_seconds", "prefill_seconds")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    usage: _common_pb2.Usage
    queue_seconds: float
    prefill_seconds: float
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...
