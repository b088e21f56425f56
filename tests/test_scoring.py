"""Scoring through the disaggregated path: prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's legacy ``echo`` +
``logprobs``) and ``max_tokens: 0``, over HTTP with the ``openai`` tiny_openai and over gRPC, against a real router, a
prefill pod and a decode pod (``splitserve up``, the tiny-random model: one token per byte). Prompts of 8 tokens or
more prefill on P, shorter ones on D (``conditional_prefill_threshold=8``), so both pods' ways are covered. Every
logprob must equal the offline engine's to the bit: the same model, the same kernels, the prompt computed whole
(no prefix cache) on whichever pod prefills."""

from __future__ import annotations

import time
import urllib.request

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine import LLM
from splitserve.engine.sampling.params import SamplingParams
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

pytestmark = [pytest.mark.e2e]

LONG = "the quick brown fox"  # on P
SHORT = "hey"  # on D


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model="tiny-random", num_blocks=128)


def offline_scores(offline: LLM, prompt: str | list[int], num_top: int, max_tokens: int = 0):
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, prompt_logprobs=num_top, temperature=0.0))[0]


def pod_metric(tiny_pd_up, role: str, name: str) -> float:
    pod = next(p for p in tiny_pd_up.pods if p.role == role)
    with urllib.request.urlopen(f"http://{tiny_pd_up.config.host}:{pod.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def token_text(offline: LLM, token_id: int) -> str:
    return offline.tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(tiny_openai, tiny_pd_up, offline, prompt):
    counters = ("splitserve_kv_transfer_bytes_total", "splitserve_request_success_total")
    before = {role: [pod_metric(tiny_pd_up, role, name) for name in counters] for role in ("prefill", "decode")}
    answer = tiny_openai.completions.create(model="tiny-random", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    expected = offline_scores(offline, prompt, 2)
    choice = answer.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    ids = expected.prompt_token_ids
    assert choice.logprobs.tokens == [token_text(offline, t) for t in ids]
    assert choice.logprobs.token_logprobs == [None] + [entry.logprob for entry in expected.prompt_logprobs[1:]]
    assert choice.logprobs.top_logprobs[0] is None
    for top, entry in zip(choice.logprobs.top_logprobs[1:], expected.prompt_logprobs[1:]):
        wanted = {**dict(list(entry.top.items())[:2]), entry.token_id: entry.logprob}
        assert top == {token_text(offline, t): value for t, value in wanted.items()}
    offsets = [sum(len(token_text(offline, t)) for t in ids[:i]) for i in range(len(ids))]
    assert choice.logprobs.text_offset == offsets
    # Nothing was generated, so nothing was transferred: no KV left P, D ran nothing for the prompts P scored.
    after = {role: [pod_metric(tiny_pd_up, role, name) for name in counters] for role in ("prefill", "decode")}
    assert after["prefill"][0] == before["prefill"][0] and after["decode"][0] == before["decode"][0]
    scored_on_d = len(ids) < 8
    assert after["decode"][1] - before["decode"][1] == (1 if scored_on_d else 0)
    assert after["prefill"][1] == before["prefill"][1]  # the prefill pod counts no finished requests of its own


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_prompt_logprobs_come_with_a_generated_answer_in_vllms_shape(tiny_openai, offline, prompt):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=prompt, max_tokens=4, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    expected = offline_scores(offline, prompt, 3, max_tokens=4)
    choice = answer.model_dump()["choices"][0]
    assert choice["text"] == expected.text and choice["logprobs"] is None
    assert choice["prompt_logprobs"][0] is None
    for got, entry in zip(choice["prompt_logprobs"][1:], expected.prompt_logprobs[1:], strict=True):
        wanted = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, value) in enumerate(entry.top.items(), start=1):
            wanted.setdefault(token_id, (value, rank))
        assert got == {str(t): {"logprob": value, "rank": rank, "decoded_token": token_text(offline, t)}
                       for t, (value, rank) in wanted.items()}


def test_the_prefix_cache_does_not_drop_prompt_logprobs(tiny_openai, offline):
    asks = dict(model="tiny-random", prompt=LONG * 3, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    first, again = (tiny_openai.completions.create(**asks).model_dump()["choices"][0] for _ in range(2))
    assert again["prompt_logprobs"] == first["prompt_logprobs"]
    assert len(first["prompt_logprobs"]) == len(offline.tokenizer.encode(LONG * 3))


def test_the_loglikelihood_requests_of_evaluation_harnesses_match_the_offline_engine(tiny_openai, offline):
    """lm-eval's ``local-completions`` loglikelihood request: token id prompts in a batch, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``, temperature 0; the continuation's logprob is the sum of its tokens' entries, minus the last
    (the generated token)."""
    contexts = [offline.tokenizer.encode("Question: 2+2=", add_special_tokens=False)] * 2
    continuations = [offline.tokenizer.encode(text, add_special_tokens=False) for text in (" 4", " five")]
    prompts = [context + continuation for context, continuation in zip(contexts, continuations)]
    answer = tiny_openai.completions.create(model="tiny-random", prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0, seed=1234)
    for choice, prompt, context in zip(sorted(answer.choices, key=lambda c: c.index), prompts, contexts):
        expected = offline_scores(offline, prompt, 1, max_tokens=1)
        scored = choice.logprobs.token_logprobs[len(context):-1]
        assert scored == [entry.logprob for entry in expected.prompt_logprobs[len(context):]]
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1


def test_streamed_echo_sends_the_prompt_with_its_logprobs_first(tiny_openai, offline):
    stream = tiny_openai.completions.create(model="tiny-random", prompt=LONG, max_tokens=3, temperature=0, echo=True,
                                       logprobs=0, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    expected = offline_scores(offline, LONG, 0, max_tokens=3)
    assert chunks[0].text.startswith(LONG)
    assert chunks[0].logprobs.token_logprobs[:len(LONG)] == [None] + [e.logprob for e in expected.prompt_logprobs[1:]]
    assert "".join(chunk.text for chunk in chunks) == LONG + expected.text


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_grpc_scores_a_prompt_with_max_tokens_0(tiny_pd_up, offline, prompt):
    params = common_pb2.SamplingParams(max_tokens=0, prompt_logprobs=2)
    with grpc.insecure_channel(f"{tiny_pd_up.config.host}:{tiny_pd_up.config.grpc_port}") as channel:
        responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(
            generate_pb2.GenerateRequest(text=prompt, sampling_params=params), timeout=60))
    assert [r.WhichOneof("response") for r in responses] == ["chunk", "complete"]
    chunk, complete = responses[0].chunk, responses[1].complete
    assert list(chunk.token_ids) == [] and complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    expected = offline_scores(offline, prompt, 2).prompt_logprobs[1:]
    assert [(t.token_id, t.logprob, t.rank, {top.token_id: top.logprob for top in t.top_logprobs})
            for t in chunk.prompt_logprobs.tokens] == [(e.token_id, e.logprob, e.rank, e.top) for e in expected]
    assert complete.usage.completion_tokens == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": LONG, "max_tokens": 0}, "max_tokens"),
    ({"prompt": LONG, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": LONG, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": LONG, "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_scoring_fields_out_of_range_are_a_400_naming_the_field(tiny_pd_up, body, param):
    path = "chat/completions" if "messages" in body else "completions"
    reply = httpx.post(f"http://{tiny_pd_up.config.host}:{tiny_pd_up.config.http_port}/v1/{path}",
                       json={"model": "tiny-random", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert param in reply.json()["error"]["message"]


def test_tokenizer_info_names_the_special_tokens_as_lm_evals_remote_tokenizer_reads_them(tiny_pd_up, offline):
    base = f"http://{tiny_pd_up.config.host}:{tiny_pd_up.config.http_port}"
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    tokenizer = offline.tokenizer
    assert info["eos_token"] == tokenizer.id_to_token(tokenizer.eos_token_ids[0])
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] > 0
    # The remote tokenizer finds EOS's id by tokenizing its text without special tokens added.
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    assert tokens == [tokenizer.eos_token_ids[0]]


# --- n samples of one prompt: one prefill, one transfer, the prompt's blocks shared on the decode pod ---------------


def test_n_seeded_samples_share_one_prefill_and_one_kv_transfer(tiny_openai, tiny_pd_up, offline):
    def counters():
        return (pod_metric(tiny_pd_up, "prefill", "splitserve_prompt_tokens_total"),
                pod_metric(tiny_pd_up, "decode", "splitserve_kv_transfer_bytes_total"))

    prompt = LONG + " jumps"
    before = counters()
    tiny_openai.completions.create(model="tiny-random", prompt=prompt, max_tokens=2, temperature=0)
    one = counters()
    answer = tiny_openai.completions.create(model="tiny-random", prompt=prompt, n=3, seed=7, temperature=1.0,
                                       max_tokens=24)
    three = counters()
    expected = [offline.generate(prompt, SamplingParams(max_tokens=24, seed=7 + i, temperature=1.0))[0].text
                for i in range(3)]
    assert [choice.text for choice in answer.choices] == expected and len(set(expected)) == 3
    # The prefill pod computed the prompt once and the decode pod received its KV once, as for one sample.
    assert [b - a for a, b in zip(one, three)] == [b - a for a, b in zip(before, one)]
    assert one[0] - before[0] == len(offline.tokenizer.encode(prompt))


def test_samples_of_a_prompt_prefilled_on_the_decode_pod_go_on_their_own(tiny_openai, offline):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=SHORT, n=3, seed=9, temperature=1.0,
                                            max_tokens=8)
    assert [choice.text for choice in answer.choices] == [
        offline.generate(SHORT, SamplingParams(max_tokens=8, seed=9 + i, temperature=1.0))[0].text for i in range(3)]


def test_every_block_of_the_samples_is_free_afterwards(tiny_openai, tiny_pd_up):
    tiny_openai.completions.create(model="tiny-random", prompt=LONG * 2, n=4, seed=3, temperature=1.0, max_tokens=40,
                              extra_body={"ignore_eos": True})
    base = f"http://{tiny_pd_up.config.host}:{tiny_pd_up.config.http_port}"

    def decode_load() -> dict:
        pods = httpx.get(f"{base}/pods", timeout=30).json()["pods"]
        return next(pod for pod in pods if pod["role"] == "decode")["load"]

    load = decode_load()
    for _ in range(100):  # the pod's next load reports
        if load["free_kv_blocks"] == load["total_kv_blocks"]:
            break
        time.sleep(0.1)
        load = decode_load()
    assert load["free_kv_blocks"] == load["total_kv_blocks"] and load["num_running"] == 0


def test_best_of_returns_the_n_most_likely_of_its_seeded_samples(tiny_openai, offline):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=LONG, n=2, best_of=4, seed=5, temperature=1.0,
                                       max_tokens=8)
    samples = [offline.generate(LONG, SamplingParams(max_tokens=8, seed=5 + i, temperature=1.0, logprobs=0))[0]
               for i in range(4)]
    cumulative = [sum(entry[token] for token, entry in zip(s.token_ids, s.logprobs)) for s in samples]
    ranked = sorted(range(4), key=lambda i: -cumulative[i])
    assert [choice.text for choice in answer.choices] == [samples[i].text for i in ranked[:2]]
    assert [choice.index for choice in answer.choices] == [0, 1] and answer.choices[0].logprobs is None
    assert answer.usage.completion_tokens == sum(len(s.token_ids) for s in samples)  # every sample generated
