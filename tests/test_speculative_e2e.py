"""Speculative decoding through a real cluster (`splitserve up --speculative-method ngram`, then ``suffix``, then
``draft`` with the model drafting for itself, since SmolLM2-135M is the smallest of its family): the
decode pod's greedy answers equal the offline engine's without speculation, token for token, and its /metrics count
the drafts it verified and accepted for these requests. ``ngram`` is the session's SmolLM2 cluster
(``smollm2_up`` in tests/conftest.py, which speculates so); the other two start their own.
"""

from __future__ import annotations

import pytest

from splitserve.engine import SamplingParams
from tests.test_e2e_serving import _added, _grpc_generate, _metrics, _pod_metrics_url
from tests.test_speculative import _input_grounded_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 24  # what _grpc_generate asks for


@pytest.fixture(scope="module", params=["ngram", "suffix", "draft"])
def speculating(request, tmp_path_factory, start_cluster):
    if request.param == "ngram":
        shared = request.getfixturevalue("smollm2_up")
        assert (shared.config.speculative_method, shared.config.num_speculative_tokens) == ("ngram", 4)
        yield shared
        return
    # Prompts under 4096 tokens prefill on the decode pod here, and the rest would go to the prefill pod; the
    # e2e serving tests cover that path, this one covers the decode pod's speculation.
    cluster = start_cluster(tmp_path_factory.mktemp("spec"), model="smollm2-135m", kv_codec="none", prefill=1,
                            decode=1, mixed=0, scheduling="disaggregated", conditional_prefill_threshold=64,
                            kv_cache_memory_bytes=256 << 20,
                            prometheus=False, speculative_method=request.param, num_speculative_tokens=4,
                            speculative_model="smollm2-135m" if request.param == "draft" else "")
    yield cluster
    cluster.stop()


def test_greedy_answers_with_speculation_equal_offline_without(speculating, smollm2):
    prompts = ["The capital of France is", *_input_grounded_prompts()]  # short: prefilled on D; long: on P
    expected = smollm2.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    before = _metrics(_pod_metrics_url(speculating, "decode"))
    for prompt, reference in zip(prompts, expected):
        tokens, text, complete = _grpc_generate(speculating, prompt)
        assert tokens == reference.token_ids
        assert text == reference.text
        assert complete.usage.completion_tokens == len(reference.token_ids)
    decode = _metrics(_pod_metrics_url(speculating, "decode"))
    drafted = _added(decode, before, "splitserve_spec_decode_num_draft_tokens_total")
    accepted = _added(decode, before, "splitserve_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert _added(decode, before, "splitserve_spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
