"""``DecodeConfig``: a decode or mixed pod's settings, filled by ``runtime.config.parse_config`` from flags
(``--kv-lease-s``) and ``SPLITSERVE_*`` environment variables. The fields every pod shares come from ``PodConfig``;
checked in ``__post_init__``, so a bad value stops the pod at start, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import KV_LEASE_S
from kvtransfer.codecs import available_codecs
from runtime.config import member
from runtime.kv_codecs import check_kv_codecs
from runtime.pod import PodConfig
from runtime.roles import Role


@dataclass
class DecodeConfig(PodConfig):
    """A splitserve decode pod (or mixed pod): takes in prompt KV and streams generated tokens."""

    port: int = field(default=50062, metadata={"help": "gRPC port of the Decode and KVTransfer services (0: any)."})
    role: Role = field(default=Role.DECODE, metadata={"help": (
        "'decode' (prompts prefilled on prefill pods, or here when the router says so) or 'mixed' (the colocated "
        "baseline: both phases here); it names the pod in the registry and the metrics.")})
    kv_lease_s: float = field(default=KV_LEASE_S, metadata={"help": (
        "How long pushed KV waits for its Decode call when the push names no lease.")})
    accepted_kv_codecs: list[str] = field(default_factory=available_codecs, metadata={"help": (
        "KV codecs this pod decodes (comma-separated); pushes with others fail the handshake.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.role = member(Role, "role", self.role)
        if not self.role.can_decode:
            raise ValueError(f"role must be one of {Role.DECODE}, {Role.MIXED}, got {self.role.value!r}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        check_kv_codecs("accepted_kv_codecs", self.accepted_kv_codecs)
