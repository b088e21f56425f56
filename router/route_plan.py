"""What placing a request decides, and what it decides from: the router's placement vocabulary.

- ``RoutePlan``: the decision, a decode pod D and a prefill pod P (None: D prefills), with why, the predicted
  TTFT (hybrid placement) and a split prefill's prefix length; routing policies (``policies.py``) and hybrid
  placement (``latency.py``) return it, ``placement.py`` acts on it;
- ``SLOTargets``: a request's TTFT and TPOT targets, its own or the router's;
- ``PromptBlocks``: a prompt's chained block hashes, for matching it against each pod's prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.block_manager import chained_block_hashes
from splitserve.router.pods.registry import PodInfo

if TYPE_CHECKING:
    from splitserve.router.config import RouterConfig
    from splitserve.router.intake import RouterRequest


@dataclass
class RoutePlan:
    prefill: PodInfo | None  # None: D prefills the prompt itself
    decode: PodInfo
    reason: str  # why this shape, for logs
    predicted_ttft_s: float | None = None  # hybrid placement's prediction (None: not predicted)
    prefix_tokens: int = 0  # a split prefill: P prefills this many leading prompt tokens, D the rest

    @property
    def decision(self) -> str:
        """The routing-decision metric's label."""
        if self.prefill is None:
            return "prefill_on_decode"
        return "split" if self.prefix_tokens else "disaggregated"


@dataclass(frozen=True)
class SLOTargets:
    """A request's latency targets, seconds: the router's --slo-ttft-s / --slo-tpot-s or the request's own."""

    ttft_s: float
    tpot_s: float

    @classmethod
    def of(cls, req: RouterRequest, config: RouterConfig) -> SLOTargets:
        """``req``'s own targets where it named them, else the router's."""
        return cls(req.slo_ttft_s or config.slo_ttft_s, req.slo_tpot_s or config.slo_tpot_s)


class PromptBlocks:
    """A prompt's chained block hashes, computed once per block size and reused for every candidate pod."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._hashes_by_block_size: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes_by_block_size:
            self._hashes_by_block_size[block_size] = chained_block_hashes(self.token_ids, block_size)
        return self._hashes_by_block_size[block_size]

    def cached_tokens(self, pod: PodInfo) -> int:
        """Prompt tokens at the start of the prompt whose blocks ``pod`` has in its prefix cache."""
        if not pod.block_hashes:
            return 0
        matched = 0
        for block_hash in self.hashes(pod.load.block_size):
            if block_hash not in pod.block_hashes:
                break
            matched += 1
        return matched * pod.load.block_size
