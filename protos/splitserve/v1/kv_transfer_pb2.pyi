from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_UNSPECIFIED: _ClassVar[KVKind]
    KV_KIND_KEY: _ClassVar[KVKind]
    KV_KIND_VALUE: _ClassVar[KVKind]
KV_KIND_UNSPECIFIED: KVKind
KV_KIND_KEY: KVKind
KV_KIND_VALUE: KVKind

class KVLayout(_message.Message):
    __slots__ = ("model_name", "num_layers", "num_kv_heads", "head_dim", "block_size", "cache_dtype", "quantization", "weights_fingerprint", "prefill_compute_dtype", "cpu_features", "tensor_parallel_size", "rank_kv_heads", "kv_window", "kv_window_layers")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: str
    quantization: str
    weights_fingerprint: str
    prefill_compute_dtype: str
    cpu_features: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_size: int
    rank_kv_heads: _containers.RepeatedCompositeFieldContainer[KVHeadRange]
    kv_window: int
    kv_window_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., prefill_compute_dtype: _Optional[str] = ..., cpu_features: _Optional[_Iterable[str]] = ..., tensor_parallel_size: _Optional[int] = ..., rank_kv_heads: _Optional[_Iterable[_Union[KVHeadRange, _Mapping]]] = ..., kv_window: _Optional[int] = ..., kv_window_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class KVHeadRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "compat_hash", "codec", "boot_id", "host_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    compat_hash: str
    codec: str
    boot_id: str
    host_id: str
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., compat_hash: _Optional[str] = ..., codec: _Optional[str] = ..., boot_id: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout", "supported_codecs", "compat_hash", "boot_id", "host_id", "shm_dir", "shm_dir_id")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_CODECS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_ID_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    supported_codecs: _containers.RepeatedScalarFieldContainer[str]
    compat_hash: str
    boot_id: str
    host_id: str
    shm_dir: str
    shm_dir_id: str
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., supported_codecs: _Optional[_Iterable[str]] = ..., compat_hash: _Optional[str] = ..., boot_id: _Optional[str] = ..., host_id: _Optional[str] = ..., shm_dir: _Optional[str] = ..., shm_dir_id: _Optional[str] = ...) -> None: ...

class KVPush(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVTransferHeader
    chunk: KVChunk
    trailer: KVTransferTrailer
    def __init__(self, header: _Optional[_Union[KVTransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., trailer: _Optional[_Union[KVTransferTrailer, _Mapping]] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "compat_hash", "lease_seconds", "num_claims", "sender_boot_id", "receiver_boot_id", "shm_arena", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    SENDER_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_ARENA_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    compat_hash: str
    lease_seconds: float
    num_claims: int
    sender_boot_id: str
    receiver_boot_id: str
    shm_arena: str
    first_token: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., compat_hash: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., num_claims: _Optional[int] = ..., sender_boot_id: _Optional[str] = ..., receiver_boot_id: _Optional[str] = ..., shm_arena: _Optional[str] = ..., first_token: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "seq", "layer", "kind", "token_start", "token_end", "codec", "dtype", "shape", "payload", "scales", "crc32c", "shm", "heads")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    layer: int
    kind: KVKind
    token_start: int
    token_end: int
    codec: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    scales: bytes
    crc32c: int
    shm: KVShmSpan
    heads: KVHeadRange
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., layer: _Optional[int] = ..., kind: _Optional[_Union[KVKind, str]] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., codec: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., shm: _Optional[_Union[KVShmSpan, _Mapping]] = ..., heads: _Optional[_Union[KVHeadRange, _Mapping]] = ...) -> None: ...

class KVShmSpan(_message.Message):
    __slots__ = ("offset", "payload_bytes", "scales_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCALES_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    payload_bytes: int
    scales_bytes: int
    def __init__(self, offset: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., scales_bytes: _Optional[int] = ...) -> None: ...

class KVTransferTrailer(_message.Message):
    __slots__ = ("num_chunks", "num_tokens")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_tokens: int
    def __init__(self, num_chunks: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("bytes_received", "num_blocks", "lease_remaining_seconds", "recompute")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    num_blocks: int
    lease_remaining_seconds: float
    recompute: bool
    def __init__(self, bytes_received: _Optional[int] = ..., num_blocks: _Optional[int] = ..., lease_remaining_seconds: _Optional[float] = ..., recompute: _Optional[bool] = ...) -> None: ...
