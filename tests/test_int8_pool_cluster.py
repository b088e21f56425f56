"""Pods whose KV pools store int8 rows, through ``splitserve up`` (the tiny random model, 1 prefill + 1 decode pod,
every prompt prefilled on P and pushed to D): the router's default ``kv_codec none`` (as ``auto`` would) carries P's
rows as they lie, not their float32 values, D stores them unchanged,
and every greedy answer is the offline engine's with an int8 pool, token for token, and the pushes' wire bytes are what
the rows take (head_dim codes and 2 bytes of scale per 16 of them, per token, head, layer, K and V). Pods of other
formats interoperate through the other codecs (tests/test_kv_rows.py)."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_formats import rows as kv_rows

pytestmark = [pytest.mark.e2e]

PROMPTS = ["the int8 pool holds rows of codes and a scale", "hello world, " * 6, "0123456789" * 5]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    cluster = start_cluster(tmp_path_factory.mktemp("int8-pools"), model="tiny-random", prefill=1, decode=1,
                            scheduling="disaggregated", conditional_prefill_threshold=0,
                            cache_dtype="int8", kv_cache_memory_bytes=16 << 20, prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster, openai_client):
    return openai_client(cluster)


def pod_samples(cluster, role: str, name: str) -> dict[str, float]:
    """``name``'s samples on the ``role`` pod, by their codec label."""
    pod = next(p for p in cluster.pods if p.role == role)
    with urllib.request.urlopen(f"http://{cluster.config.host}:{pod.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.labels.get("codec", ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_int8_pools_answer_as_the_offline_int8_engine_and_push_their_rows_as_they_lie(cluster, client):
    offline = LLM(model="tiny-random", num_blocks=128, cache_dtype="int8")
    float16 = LLM(model="tiny-random", num_blocks=128, cache_dtype="float16")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    largest_format_gap = 0.0
    for prompt in PROMPTS:
        answer = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=1, extra_body={"ignore_eos": True}).choices[0]
        expected = offline.generate(prompt, params)[0]
        assert answer.text == expected.text
        expected_logprobs = [lp[t] for lp, t in zip(expected.logprobs, expected.token_ids)]
        assert answer.logprobs.token_logprobs == pytest.approx(expected_logprobs, rel=0, abs=1e-6)
        other = float16.generate(prompt, params)[0]
        largest_format_gap = max(largest_format_gap, *(abs(a - lp[t]) for a, lp, t in zip(
            expected_logprobs, other.logprobs, other.token_ids)))
    assert largest_format_gap > 1e-4, "the answers do not depend on the pool's format: the check could not fail"
    wire = pod_samples(cluster, "prefill", "splitserve_kv_transfer_bytes_total")
    assert set(wire) == {"int8"}  # the default, none, sent the pool's rows: the int8 codec's bytes
    tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    cfg = offline.engine.model_config
    assert wire["int8"] == tokens * cfg.num_layers * 2 * cfg.num_kv_heads * kv_rows.row_width(torch.int8, cfg.head_dim)
