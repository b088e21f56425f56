"""``PrefillConfig``: a prefill pod's settings, filled by ``splitserve.runtime.config.parse_config`` from flags
(``--overlap-transfer``) and ``SPLITSERVE_*`` environment variables. The fields every pod shares come from
``PodConfig``; checked in ``__post_init__``, so a bad value stops the pod at start, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.engine.config import EngineConfig
from splitserve.kvtransfer.shm_arena import DEFAULT_ARENA_BYTES
from splitserve.kvtransfer.wire import MAX_CHUNK_BYTES
from splitserve.runtime.pod_server import PodConfig
from splitserve.runtime.transport import MAX_MESSAGE_BYTES

KV_TRANSPORTS = ("auto", "grpc")


@dataclass
class PrefillConfig(PodConfig):
    """A splitserve prefill pod: prefills prompts and streams their KV to decode pods."""

    port: int = field(default=50061, metadata={"help": "gRPC port of the Prefill service (0: any free port)."})
    overlap_transfer: bool = field(default=True, metadata={"help": (
        "Send each layer's KV while later layers compute (--no-overlap-transfer: after the prefill step).")})
    max_chunk_bytes: int = field(default=MAX_CHUNK_BYTES, metadata={"help": (
        "Payload + scales of one KV chunk on the wire.")})
    inject_corrupt_chunks: float = field(default=0.0, metadata={"help": (
        "Fault injection, for reliability tests and soak runs only: the share of KV chunks sent with a flipped byte "
        "after their checksum (the decode pod refuses them, DATA_LOSS; the router retries). 0 in production.")})
    kv_min_agreement: float = field(default=0.97, metadata={"help": (
        "kv_codec auto: the least teacher-forced top-1 agreement with the lossless path (from the quality table) a "
        "codec needs to be chosen; lossless codecs always qualify.")})
    kv_quality_table: str = field(default="", metadata={"help": (
        "kv_codec auto: the codecs' measured quality (bench codecs --quality-table); empty: the table shipped for "
        "the model in kvtransfer/quality/, or none (then auto picks among lossless codecs).")})
    kv_transport: str = field(default="auto", metadata={"help": (
        "How KV reaches decode pods: 'auto' (through a shared-memory arena when the decode pod is on this host and "
        "offers a directory this pod sees, else gRPC: kvtransfer/shm.py) or 'grpc' (always).")})
    kv_shm_arena_bytes: int = field(default=DEFAULT_ARENA_BYTES, metadata={"help": (
        "Size of each shared-memory arena (one per decode pod on this host; memory is taken as it is written). A "
        "chunk that finds no room goes inline, over gRPC.")})
    kv_transfer_timeout_s: float = field(default=60.0, metadata={"help": (
        "Longest a prefill waits for the decode pod to acknowledge its KV (a shorter call deadline wins).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.kv_shm_arena_bytes < self.max_chunk_bytes:
            raise ValueError(f"kv_shm_arena_bytes must hold a chunk (max_chunk_bytes {self.max_chunk_bytes}), got "
                             f"{self.kv_shm_arena_bytes}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if not 0.0 <= self.kv_min_agreement <= 1.0:
            raise ValueError(f"kv_min_agreement must be in [0, 1], got {self.kv_min_agreement}")
        if self.kv_quality_table and not Path(self.kv_quality_table).is_file():
            raise ValueError(f"kv_quality_table: no file {self.kv_quality_table!r}")
        if not 0.0 <= self.inject_corrupt_chunks <= 1.0:
            raise ValueError(f"inject_corrupt_chunks must be in [0, 1], got {self.inject_corrupt_chunks}")
        if not 0 < self.max_chunk_bytes <= MAX_MESSAGE_BYTES // 2:
            raise ValueError(f"max_chunk_bytes must be in (0, {MAX_MESSAGE_BYTES // 2}], got {self.max_chunk_bytes}")

    def engine_config(self) -> EngineConfig:
        # A prefill pod runs no decode row: in bf16 prefill its model holds the bf16 form only.
        return dataclasses.replace(super().engine_config(), prefill_only=True)
