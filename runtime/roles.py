"""The roles a splitserve process plays. A role names a pod in the registry, in its metrics (label ``role``) and
in ``splitserve up``'s plan."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    PREFILL = "prefill"  # prefills prompts and pushes their KV to decode pods
    DECODE = "decode"  # takes in pushed KV and decodes (prefills short or cached prompts itself)
    MIXED = "mixed"  # both phases in one process: the colocated baseline
    ROUTER = "router"  # the front door; not a pod

    @property
    def can_decode(self) -> bool:
        return self in (Role.DECODE, Role.MIXED)


POD_ROLES = (Role.PREFILL, Role.DECODE, Role.MIXED)
