"""OpenAI API parity through the disaggregated path: the ``openai`` client against a real router, prefill pod and
decode pod (``splitserve up``, the tiny-random model: one token per byte, so that token-level asks are easy to
check), every prompt prefilled on P and decoded on D (``conditional_prefill_threshold=0``). Answers are checked
against the offline engine with the same parameters: the prefill pod samples the first token and the decode pod
the rest, so a constraint that one of them dropped shows."""

from __future__ import annotations

import pytest
from openai import OpenAI

from engine import LLM
from engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.e2e]

PROMPT = "hello world"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    cluster = start_cluster(tmp_path_factory.mktemp("parity"), model="tiny-random", prefill=1, decode=1,
                            kv_codec="none", conditional_prefill_threshold=0, kv_cache_memory_bytes=32 << 20,
                            prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=f"http://{cluster.config.host}:{cluster.config.http_port}/v1", api_key="unused",
                  max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model="tiny-random", num_blocks=128)


def tokens_of(offline: LLM, text: str) -> list[int]:
    return offline.tokenizer.encode(text, add_special_tokens=False)


CONSTRAINTS = [
    {"allowed_token_ids": [72, 73, 74, 223]},
    {"logit_bias": {"72": 100.0}},
    {"logit_bias": {"95": -100.0, "128": -100.0}},
    {"bad_words": ["o", "c}", "b"]},
]


@pytest.mark.parametrize("asked", CONSTRAINTS)
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5)])
def test_token_constraints_are_kept_by_both_pods_and_match_the_offline_engine(client, offline, asked, temperature,
                                                                               seed):
    answer = client.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=12, temperature=temperature,
                                       seed=seed, extra_body=asked)
    offline_params = {**asked, "logit_bias": {int(k): v for k, v in asked.get("logit_bias", {}).items()}}
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=temperature, seed=seed,
                                                       **offline_params))[0]
    assert answer.choices[0].text == expected.text
    plain = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=temperature, seed=seed))[0]
    assert expected.token_ids != plain.token_ids  # the constraint changed the answer
    output = tokens_of(offline, answer.choices[0].text)
    if "allowed_token_ids" in asked:
        assert set(output) <= set(asked["allowed_token_ids"])
    if "logit_bias" in asked and asked["logit_bias"].get("72", 0) > 0:
        assert output == [72] * 12
    for banned in [int(k) for k, v in asked.get("logit_bias", {}).items() if v < 0]:
        assert banned not in output
    for word in asked.get("bad_words", []):
        assert word not in answer.choices[0].text
