"""The default path (issue 35): hybrid placement keeps the user's TPOT target, the one service level's defaults.

The served cluster under ``splitserve up``'s defaults is in tests/test_hybrid_cluster.py."""

from __future__ import annotations

import dataclasses

from splitserve.router.pods.registry import PodInfo
from tests.test_hybrid_placement import MODEL, TIGHT_TTFT, decide, prefill_pod


def decode_pod_keeping_no_tpot(running: int) -> PodInfo:
    """A decode pod that does not chunk by TPOT (no --tpot-slack-chunking): it reports no allowance."""
    load = prefill_pod().load
    load = dataclasses.replace(load, num_running=running, running_context_tokens=300 * running, step_time=MODEL,
                               tpot_allowance_seconds=None, queued_prefill_tokens=0, prefill_tokens_per_second=0.0)
    return PodInfo("d", "decode", load, set(), serving=True)


def test_a_decode_pod_that_keeps_no_tpot_is_not_lent_a_prompt_that_would_break_its_decodes_tpot():
    """P's queue is long (2.1 s), so lending would win (a 1.4 s prefill on D); but D would prefill the whole prompt
    in one 1.4 s step beside its two decodes, over the 0.5 s TPOT target: the prompt goes to P."""
    plan = decide(prefill_pod(queued=600), decode_pod_keeping_no_tpot(running=2), TIGHT_TTFT)
    assert plan.prefill is not None and plan.prefix_tokens == 0, plan.reason
    assert "would break the 0.5 s TPOT target of 2 decodes" in plan.reason


def test_a_decode_pod_with_nothing_decoding_is_lent_to_whatever_its_chunking():
    plan = decide(prefill_pod(queued=600), decode_pod_keeping_no_tpot(running=0), TIGHT_TTFT)
    assert plan.prefill is None and plan.reason.startswith("hybrid lent"), plan.reason
