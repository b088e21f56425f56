"""The SLO regimes a goodput map is scored on, and the shape of the ``bench compare`` run they come from, shared by
``bench compare --slo-map`` (which measures them) and ``splitserve simulate slo-map`` / ``validate`` (which replay
the same run in simulation).

A regime is an SLO pair as multiples of the machine's single-request TTFT ``T0`` and TPOT ``P0``, measured first
on the colocated baseline with ``CALIBRATION_REQUESTS`` requests, one at a time: TaiChi's three regimes, tight TTFT
with relaxed TPOT (``2 T0``, ``5 P0``), balanced (``4 T0``, ``2.5 P0``), relaxed TTFT with tight TPOT (``12 T0``,
``1.5 P0``).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.measure.serve_metrics import SLO

CALIBRATION_REQUESTS = 6  # single requests that measure T0 and P0 (their medians)
BASELINE_BUDGET = 128  # the colocated baseline's chunked-prefill token budget
COMPARE_NUM_PROMPTS = 20  # requests per rate of bench compare's full run (docs/PERFORMANCE.md)


@dataclass(frozen=True)
class Regime:
    """An SLO pair as multiples of the single-request TTFT and TPOT."""

    name: str
    ttft_x: float
    tpot_x: float

    def slo(self, ttft0: float, tpot0: float, scale: float = 1.0) -> SLO:
        return SLO(ttft=self.ttft_x * ttft0 * scale, tpot=self.tpot_x * tpot0 * scale)


REGIMES = (Regime("tight-ttft", 2.0, 5.0), Regime("balanced", 4.0, 2.5), Regime("tight-tpot", 12.0, 1.5))
BALANCED = REGIMES[1]
