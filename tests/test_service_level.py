"""A request's own service level (docs/api.md, "Latency targets and priority"): ``slo_ttft_s`` / ``slo_tpot_s`` and
``priority`` in an HTTP body, ``slo_ttft_seconds`` / ``slo_tpot_seconds`` and ``priority`` in a gRPC
``GenerateRequest``. Through the real router of the tiny cluster: a bad value is refused naming its field, the
router's goodput counts each request against its own targets (one it cannot meet is not counted, the same request
with loose targets is), and a priority is served like any request (the order it buys is in test_pods.py)."""

from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.intake import ServiceLevel
from splitserve.runtime.errors import StatusError
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"
IMPOSSIBLE = {"slo_ttft_s": 1e-9, "slo_tpot_s": 1e-9}
LOOSE = {"slo_ttft_s": 600.0, "slo_tpot_s": 600.0}


def _within_slo(cluster) -> float:
    url = f"http://{cluster.config.host}:{cluster.config.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "splitserve_requests_within_slo_total" and s.labels.get("role") == "router")


@pytest.mark.parametrize("ttft, tpot", [(None, None), (0.5, None), (None, 0.02), (2.0, 0.1)])
def test_targets_that_are_positive_seconds_or_unset_are_taken(ttft, tpot):
    assert ServiceLevel.checked(ttft, tpot, 0, ("a", "b", "c")) == ServiceLevel(ttft, tpot)


@pytest.mark.parametrize("ttft, tpot, named", [(0.0, None, "a"), (-1.0, None, "a"), (None, float("nan"), "b"),
                                               (None, float("inf"), "b")])
def test_a_target_that_is_not_positive_seconds_is_refused_naming_it(ttft, tpot, named):
    with pytest.raises(StatusError, match=f"^{named}: must be a number of seconds > 0"):
        ServiceLevel.checked(ttft, tpot, 0, ("a", "b", "c"))


@pytest.mark.parametrize("priority, taken", [(0, True), (-2**31, True), (2**31 - 1, True), (2**31, False),
                                             (-2**31 - 1, False)])
def test_a_priority_is_any_int32(priority, taken):
    if taken:
        assert ServiceLevel.checked(None, None, priority, ("a", "b", "c")).priority == priority
    else:
        with pytest.raises(StatusError, match=r"^c: must be an integer in \[-2\^31, 2\^31\)"):
            ServiceLevel.checked(None, None, priority, ("a", "b", "c"))


def test_http_goodput_counts_each_request_against_its_own_targets(tiny_pd_up, tiny_openai):
    before = _within_slo(tiny_pd_up)
    tiny_openai.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0,
                                   extra_body=IMPOSSIBLE)
    assert _within_slo(tiny_pd_up) == before  # answered, but not within its own targets
    tiny_openai.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0,
                                   extra_body=LOOSE)
    assert _within_slo(tiny_pd_up) == before + 1


def test_http_refuses_a_bad_target_naming_it(tiny_openai):
    with pytest.raises(openai.BadRequestError, match="slo_tpot_s: must be a number of seconds > 0"):
        tiny_openai.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=2, extra_body={"slo_tpot_s": -0.1})


def _grpc_generate(cluster, prompt: str = PROMPT, max_tokens: int = 4, **fields) -> str:
    """The greedy answer's text over gRPC, ``fields`` set in the ``GenerateRequest``."""
    request = generate_pb2.GenerateRequest(text=prompt, sampling_params=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens), **fields)
    text = ""
    with grpc.insecure_channel(f"{cluster.config.host}:{cluster.config.grpc_port}") as channel:
        for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60):
            assert response.WhichOneof("response") != "error", response.error.message
            text += response.chunk.text
    return text


def test_grpc_goodput_counts_each_request_against_its_own_targets(tiny_pd_up):
    before = _within_slo(tiny_pd_up)
    _grpc_generate(tiny_pd_up, slo_ttft_seconds=1e-9, slo_tpot_seconds=1e-9)
    assert _within_slo(tiny_pd_up) == before
    _grpc_generate(tiny_pd_up, slo_ttft_seconds=600.0, slo_tpot_seconds=600.0)
    assert _within_slo(tiny_pd_up) == before + 1


def test_grpc_refuses_a_bad_target_naming_it(tiny_pd_up):
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(tiny_pd_up, slo_ttft_seconds=0.0)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("slo_ttft_seconds: must be a number of seconds > 0")


def test_a_prioritized_request_gets_the_same_answer_over_http_and_grpc(tiny_pd_up, tiny_openai):
    """Priority orders the pods' queues; it changes no answer. A prompt long enough for the prefill pod, greedy."""
    long_prompt = " ".join([PROMPT] * 3)
    answers = [tiny_openai.completions.create(model="tiny-random", prompt=long_prompt, max_tokens=6, temperature=0,
                                              extra_body=extra).choices[0].text
               for extra in ({}, {"priority": -5}, {"priority": 7})]
    assert answers[0] == answers[1] == answers[2]
    assert _grpc_generate(tiny_pd_up, long_prompt, max_tokens=6, priority=-5) == answers[0]
    with pytest.raises(openai.BadRequestError, match="priority"):
        tiny_openai.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=2, extra_body={"priority": 2**40})
