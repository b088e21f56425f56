"""The whole system, as `splitserve up` runs it: real processes on loopback serving the real SmolLM2 weights.

Two clusters: disaggregated (the session's shared ``smollm2_up``: 1 prefill + 1 decode pod; prompts shorter than the
conditional-disaggregation threshold prefill on the decode pod, longer ones on the prefill pod, so both paths run),
and mixed (one pod doing both phases). Through the router, over gRPC and over HTTP, greedy answers must equal the
offline ``LLM.generate`` answers token for token (codec ``none``). Outside clients are the real ones: the ``openai``
package and ``grpcurl``. Every process's /metrics must count exactly the requests this module sent (differences
from a snapshot taken before its first request, since other modules share the cluster), and a real Prometheus
must have scraped them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine import SamplingParams
from splitserve.launcher import Cluster
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 24
THRESHOLD = 32  # conditional disaggregation: prompts under 32 tokens prefill on the decode pod
SHORT_PROMPTS = ["The capital of France is", "def add(a, b):"]
LONG_PROMPTS = [
    "<|im_start|>system\nYou are a helpful assistant who answers in one short sentence.<|im_end|>\n"
    "<|im_start|>user\nWhy is the sky blue during the day but red at sunset?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON configuration file and return it as a dict, "
    "raising a clear error when the file is missing.\"\"\"\n",
]
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def disaggregated(smollm2_up):
    assert smollm2_up.config.conditional_prefill_threshold == THRESHOLD
    return smollm2_up


@pytest.fixture(scope="module")
def before(disaggregated):
    """Every process's samples before this module's first request, and what Prometheus holds of them."""
    snapshot = {role: _metrics(_pod_metrics_url(disaggregated, role)) for role in ("prefill", "decode")}
    snapshot["router"] = _metrics(f"{_http(disaggregated)}/metrics")
    snapshot["prometheus"] = _scraped_by_role(disaggregated, {
        "router": _value(snapshot["router"], "splitserve_e2e_request_latency_seconds_count", role="router"),
        "decode": _value(snapshot["decode"], "splitserve_e2e_request_latency_seconds_count", role="decode")})
    return snapshot


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, start_cluster):
    cluster = start_cluster(tmp_path_factory.mktemp("mixed"), model="smollm2-135m", prefill=0, decode=0, mixed=1,
                            kv_codec="none", kv_cache_memory_bytes=256 << 20, prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(smollm2):
    """Offline greedy answers, the single-process reference."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = SHORT_PROMPTS + LONG_PROMPTS
    return {p: out for p, out in zip(prompts, smollm2.generate(prompts, params))}


def _router_address(cluster: Cluster) -> str:
    return f"{cluster.config.host}:{cluster.config.grpc_port}"


def _http(cluster: Cluster) -> str:
    return f"http://{cluster.config.host}:{cluster.config.http_port}"


def _grpc_generate(cluster: Cluster, prompt: str) -> tuple[list[int], str, generate_pb2.Complete]:
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens, text, complete = [], "", None
    with grpc.insecure_channel(_router_address(cluster)) as channel:
        for response in generate_pb2_grpc.GenerationStub(channel).Generate(
                generate_pb2.GenerateRequest(text=prompt, sampling_params=params), timeout=120):
            kind = response.WhichOneof("response")
            assert kind != "error", response.error.message
            if kind == "chunk":
                tokens += response.chunk.token_ids
                text += response.chunk.text
            else:
                complete = response.complete
    return tokens, text, complete


def _http_completion(cluster: Cluster, prompt: str) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    request = urllib.request.Request(f"{_http(cluster)}/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab))


def _added(samples: dict, before: dict, name: str, **labels) -> float:
    """How much ``name`` (with ``labels``) grew since the ``before`` snapshot."""
    return _value(samples, name, **labels) - _value(before, name, **labels)


def _pod_metrics_url(cluster: Cluster, role: str) -> str:
    pod = next(p for p in cluster.pods if p.role == role)
    return f"http://{cluster.config.host}:{pod.metrics_port}/metrics"


# ---- disaggregated cluster (tests run in file order: the metrics test counts what the earlier ones sent) ----

def test_disaggregated_grpc_matches_offline_token_for_token(disaggregated, reference, before):
    for prompt, expected in reference.items():
        tokens, text, complete = _grpc_generate(disaggregated, prompt)
        assert tokens == expected.token_ids, prompt
        assert text == expected.text
        assert complete.usage.completion_tokens == len(expected.token_ids)
        assert complete.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_disaggregated_http_matches_offline(disaggregated, reference):
    for prompt, expected in reference.items():
        reply = _http_completion(disaggregated, prompt)
        assert reply["choices"][0]["text"] == expected.text, prompt
        assert reply["usage"]["completion_tokens"] == len(expected.token_ids)


def test_long_prompts_went_through_the_prefill_pod_and_short_ones_did_not(disaggregated, reference, before):
    prefill = _metrics(_pod_metrics_url(disaggregated, "prefill"))
    long_prompts_sent = 2 * len(LONG_PROMPTS)  # once over gRPC, once over HTTP
    assert _added(prefill, before["prefill"], "splitserve_request_prefill_time_seconds_count") == long_prompts_sent
    assert _added(prefill, before["prefill"], "splitserve_kv_transfer_bytes_total", codec="none") > 0
    decode = _metrics(_pod_metrics_url(disaggregated, "decode"))
    assert _added(decode, before["decode"], "splitserve_kv_transfer_bytes_total", codec="none") == \
        _added(prefill, before["prefill"], "splitserve_kv_transfer_bytes_total", codec="none")


def test_every_process_counts_the_requests_sent(disaggregated, reference, before):
    sent = 2 * len(reference)
    router = _metrics(f"{_http(disaggregated)}/metrics")
    for name in ("splitserve_time_to_first_token_seconds_count", "splitserve_e2e_request_latency_seconds_count",
                 "splitserve_request_time_per_output_token_seconds_count"):
        assert _added(router, before["router"], name, role="router") == sent, name
    assert _added(router, before["router"], "splitserve_request_success_total", finished_reason="length") + \
        _added(router, before["router"], "splitserve_request_success_total", finished_reason="stop") == sent
    expected_tokens = 2 * sum(len(o.token_ids) for o in reference.values())
    assert _added(router, before["router"], "splitserve_generation_tokens_total") == expected_tokens
    decode = _metrics(_pod_metrics_url(disaggregated, "decode"))
    assert _added(decode, before["decode"], "splitserve_e2e_request_latency_seconds_count", role="decode") == sent
    assert _added(decode, before["decode"], "splitserve_request_success_total") == sent


def test_prometheus_scraped_every_process(disaggregated, reference, before):
    sent = 2 * len(reference)
    expected = {role: before["prometheus"][role] + sent for role in ("router", "decode")}
    _scraped_by_role(disaggregated, expected)


def _scraped_by_role(cluster: Cluster, expected: dict[str, float]) -> dict[str, float]:
    """Polls Prometheus until its per-role request counts are ``expected`` (what the processes' /metrics say)."""
    if not any(p.name == "prometheus" for p in cluster.processes):
        pytest.fail("prometheus is not installed (the bootstrap installs it)")
    query = "sum by (role) (splitserve_e2e_request_latency_seconds_count)"
    url = (f"http://{cluster.config.host}:{cluster.config.prometheus_port}/api/v1/query?"
           + urllib.parse.urlencode({"query": query}))
    deadline = time.monotonic() + 30
    by_role: dict[str, float] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=10) as reply:
            result = json.load(reply)["data"]["result"]
        by_role = {r["metric"]["role"]: float(r["value"][1]) for r in result}
        if all(by_role.get(role, 0.0) == count for role, count in expected.items()):
            return by_role
        time.sleep(1)
    pytest.fail(f"Prometheus holds {by_role}, not {expected}")


def test_openai_client_completions_and_chat(disaggregated, smollm2):
    from openai import OpenAI

    client = OpenAI(base_url=f"{_http(disaggregated)}/v1", api_key="unused")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = smollm2.chat(question, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text

    chat = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert chat.choices[0].message.content == expected
    assert "Paris" in expected
    streamed = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=MAX_TOKENS,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected

    prompt = LONG_PROMPTS[1]
    completion = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == completion.choices[0].text
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_grpcurl_lists_checks_health_and_streams(disaggregated):
    address = _router_address(disaggregated)
    listed = subprocess.run([GRPCURL, "-plaintext", address, "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert {"splitserve.v1.Generation", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    health = subprocess.run([GRPCURL, "-plaintext", address, "grpc.health.v1.Health/Check"],
                            capture_output=True, text=True, timeout=30)
    assert json.loads(health.stdout)["status"] == "SERVING"
    request = json.dumps({"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_tokens": 8}})
    streamed = subprocess.run([GRPCURL, "-plaintext", "-d", request, address, "splitserve.v1.Generation/Generate"],
                              capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr
    messages = [json.loads(m) for m in _json_objects(streamed.stdout)]
    assert [("chunk" in m) for m in messages[:-1]] == [True] * (len(messages) - 1)
    assert messages[-1]["complete"]["usage"]["completion_tokens"] == 8  # grpcurl prints proto field names
    pod = disaggregated.address(next(p for p in disaggregated.pods if p.role == "decode"))
    pod_services = subprocess.run([GRPCURL, "-plaintext", pod, "list"], capture_output=True, text=True, timeout=30)
    assert {"splitserve.v1.Decode", "splitserve.v1.KVTransfer"} <= set(pod_services.stdout.split())


def _json_objects(stream: str) -> list[str]:
    """grpcurl prints one pretty JSON object per message, back to back."""
    objects, depth, start = [], 0, 0
    for i, ch in enumerate(stream):
        if ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                objects.append(stream[start:i + 1])
    return objects


# ---- mixed cluster ---------------------------------------------------------------------------------------------

def test_mixed_pod_matches_offline_token_for_token(mixed, reference):
    for prompt, expected in reference.items():
        tokens, text, _ = _grpc_generate(mixed, prompt)
        assert tokens == expected.token_ids, prompt
    mixed_metrics = _metrics(_pod_metrics_url(mixed, "mixed"))
    assert _value(mixed_metrics, "splitserve_request_success_total", role="mixed") == len(reference)
