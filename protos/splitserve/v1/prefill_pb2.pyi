from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "decode_address", "kv_codec", "kv_lease_seconds", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    KV_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_address: str
    kv_codec: str
    kv_lease_seconds: float
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., kv_codec: _Optional[str] = ..., kv_lease_seconds: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "num_cached_tokens", "queue_seconds", "prefill_seconds", "kv_transfer", "prompt_logprobs", "more_first_token_ids", "more_first_token_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    queue_seconds: float
    prefill_seconds: float
    kv_transfer: KVTransferStats
    prompt_logprobs: _common_pb2.Logprobs
    more_first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    more_first_token_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., kv_transfer: _Optional[_Union[KVTransferStats, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.Logprobs, _Mapping]] = ..., more_first_token_ids: _Optional[_Iterable[int]] = ..., more_first_token_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class KVTransferStats(_message.Message):
    __slots__ = ("codec", "bytes_sent", "raw_bytes", "num_chunks", "transfer_seconds", "exposed_transfer_seconds", "transport")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    codec: str
    bytes_sent: int
    raw_bytes: int
    num_chunks: int
    transfer_seconds: float
    exposed_transfer_seconds: float
    transport: str
    def __init__(self, codec: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., exposed_transfer_seconds: _Optional[float] = ..., transport: _Optional[str] = ...) -> None: ...
