"""The KV codecs' names: what the router asks prefill pods to compress each request's KV with (its ``kv_codec``,
sent in every ``PrefillRequest``) and what a decode pod accepts (``accepted_kv_codecs``).

    KV_CODECS          the base names: none (raw), bf16, fp8, int8, int4, kivi8, kivi4, kivi2
    ZSTD_SUFFIX        "+zstd": any of them, then zstd over its payload and scales (lossless)
    AUTO               "auto": the router's kv_codec may name it; each prefill pod then picks per decode pod
                       (kvtransfer/link_codec.py) from the link's throughput and the codecs' measured quality
    kv_codec_names()   every name: the base ones, then each with "+zstd"
    check_kv_codec(field_name, name)   ValueError naming the config field unless ``name`` is one of them or AUTO
    check_kv_codecs(field_name, names) the same for a non-empty list of names

Names only, without torch: the router, which never imports the KV transfer, refuses an unknown codec at start. The
codecs themselves register under these names in ``kvtransfer/codecs/base.py``, which checks that it has a class for
each.
"""

from __future__ import annotations

KV_CODECS: tuple[str, ...] = ("none", "bf16", "fp8", "int8", "int4", "kivi8", "kivi4", "kivi2")
ZSTD_SUFFIX = "+zstd"
AUTO = "auto"


def kv_codec_names() -> list[str]:
    return [*KV_CODECS, *(name + ZSTD_SUFFIX for name in KV_CODECS)]


def check_kv_codec(field_name: str, name: str) -> None:
    if name != AUTO and name not in kv_codec_names():
        raise ValueError(f"{field_name} must be one of {', '.join(kv_codec_names())}, {AUTO}, got {name!r}")


def check_kv_codecs(field_name: str, names: list[str]) -> None:
    if not names or not set(names) <= set(kv_codec_names()):
        raise ValueError(f"{field_name} must name some of {', '.join(kv_codec_names())}, got {names!r}")
