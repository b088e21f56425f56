"""Weight formats per role through a real cluster (``splitserve up --prefill-quantization X --decode-quantization
Y``), on the real SmolLM2 GGUF (its blocks are the point of the ``gguf`` format):

- one format everywhere: greedy answers over gRPC and HTTP equal the offline engine's with that format
  (``LLM(model, quantization=...)``), token for token, whether the prompt prefilled on the prefill pod (long
  prompts) or on the decode pod (short ones, under the conditional-disaggregation threshold);
- prefill pods on float weights, decode pods on the file's blocks: the KV handshake accepts the pair (the KV layout
  is what must match), answers come back on both paths, and the router's ``/pods`` and each pod's
  ``splitserve_engine_info`` say which pod runs which format. Across formats answers may differ, so only their
  arrival is checked (docs/quantization.md).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.launcher import Cluster
from tests.test_e2e_serving import (
    LONG_PROMPTS,
    MAX_TOKENS,
    SHORT_PROMPTS,
    THRESHOLD,
    _grpc_generate,
    _http,
    _http_completion,
    _metrics,
    _pod_metrics_url,
    _value,
)

pytestmark = [pytest.mark.e2e, pytest.mark.model]

# The one-format case runs for each of these. gguf everywhere is what the session's SmolLM2 cluster (``smollm2_up``,
# tests/test_e2e_serving.py's) runs where the native kernels do (its pods' ``auto``): then it is the cluster checked.
ONE_FORMAT = ["gguf"]
# (prefill pods' format, decode pods' format): float prefill, decode on the GGUF file's own blocks.
MIXED_FORMATS = ("none", "gguf")
PROMPTS = SHORT_PROMPTS + LONG_PROMPTS


def _start(start_cluster, run_dir, prefill_quantization: str, decode_quantization: str) -> Cluster:
    return start_cluster(run_dir, model="smollm2-135m", kv_codec="none", prefill=1, decode=1, mixed=0,
                         scheduling="disaggregated", conditional_prefill_threshold=THRESHOLD,
                         kv_cache_memory_bytes=256 << 20, prometheus=False,
                         prefill_quantization=prefill_quantization, decode_quantization=decode_quantization)


@pytest.fixture(scope="module", params=ONE_FORMAT)
def one_format(request, tmp_path_factory, start_cluster):
    """A cluster whose pods all run the format: the session's SmolLM2 cluster when they resolved ``auto`` to it (its
    speculation keeps greedy answers exact), else one of its own."""
    shared = request.getfixturevalue("smollm2_up")
    if _formats(shared) == {("prefill", request.param), ("decode", request.param)}:
        assert shared.config.conditional_prefill_threshold == THRESHOLD
        yield request.param, shared
        return
    cluster = _start(start_cluster, tmp_path_factory.mktemp(f"one-{request.param}"), request.param, request.param)
    yield request.param, cluster
    cluster.stop()


@pytest.fixture(scope="module")
def mixed_formats(tmp_path_factory, start_cluster):
    cluster = _start(start_cluster, tmp_path_factory.mktemp("mixed-formats"), *MIXED_FORMATS)
    yield cluster
    cluster.stop()


def _offline(smollm2, quantization: str) -> LLM:
    """The offline engine with ``quantization``: the session's when it resolved ``auto`` to it, else its own."""
    if smollm2.engine.config.quantization == quantization:
        return smollm2
    return LLM(model="smollm2-135m", quantization=quantization, kv_cache_memory_bytes=256 << 20)


def _formats(cluster: Cluster) -> set[tuple[str, str]]:
    """(role, weight format) of the cluster's pods, as the router's ``/pods`` reports them."""
    with urllib.request.urlopen(f"{_http(cluster)}/pods", timeout=10) as reply:
        return {(pod["role"], pod["quantization"]) for pod in json.load(reply)["pods"]}


def test_with_one_format_everywhere_answers_equal_the_offline_engine_with_that_format(one_format, smollm2):
    quantization, cluster = one_format
    expected = _offline(smollm2, quantization).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for prompt, reference in zip(PROMPTS, expected):
        tokens, text, _ = _grpc_generate(cluster, prompt)
        assert (tokens, text) == (reference.token_ids, reference.text), f"gRPC, {quantization}: {prompt!r}"
        choice = _http_completion(cluster, prompt)["choices"][0]
        assert choice["text"] == reference.text, f"HTTP, {quantization}: {prompt!r}"
    assert _formats(cluster) == {("prefill", quantization), ("decode", quantization)}


def test_prefill_and_decode_pods_of_different_formats_serve_together(mixed_formats):
    prefill_format, decode_format = MIXED_FORMATS
    for prompt in PROMPTS:  # short ones prefill on the decode pod, long ones on the prefill pod (KV handed over)
        tokens, text, complete = _grpc_generate(mixed_formats, prompt)
        assert 0 < len(tokens) == complete.usage.completion_tokens <= MAX_TOKENS and text, prompt
        choice = _http_completion(mixed_formats, prompt)["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["text"], prompt
    assert _formats(mixed_formats) == {("prefill", prefill_format), ("decode", decode_format)}
    for role, quantization in (("prefill", prefill_format), ("decode", decode_format)):
        samples = _metrics(_pod_metrics_url(mixed_formats, role))
        assert _value(samples, "splitserve_engine_info", role=role, quantization=quantization) == 1, role
    prefill = _metrics(_pod_metrics_url(mixed_formats, "prefill"))
    assert _value(prefill, "splitserve_kv_transfer_bytes_total") > 0  # the long prompts' KV crossed formats
