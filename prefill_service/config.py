"""``PrefillConfig``: a prefill pod's settings, filled by ``splitserve.config.parse_config`` from flags
(``--overlap-transfer``) and ``SPLITSERVE_*`` environment variables. The fields every pod shares come from
``PodConfig``; checked in ``__post_init__``, so a bad value stops the pod at start, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtransfer.codecs import available_codecs
from splitserve.pod import PodConfig


@dataclass
class PrefillConfig(PodConfig):
    """A splitserve prefill pod: prefills prompts and streams their KV to decode pods."""

    port: int = field(default=50061, metadata={"help": "gRPC port of the Prefill service (0: any free port)."})
    kv_codec: str = field(default="none", metadata={"help": "KV codec of requests that name none."})
    overlap_transfer: bool = field(default=True, metadata={"help": (
        "Send each layer's KV while later layers compute (--no-overlap-transfer: after the prefill step).")})
    kv_transfer_timeout_s: float = field(default=60.0, metadata={"help": (
        "Longest a prefill waits for the decode pod to acknowledge its KV (a shorter call deadline wins).")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.kv_codec not in available_codecs():
            raise ValueError(f"kv_codec must be one of {', '.join(available_codecs())}, got {self.kv_codec!r}")
