"""OpenAI API parity through the disaggregated path: the ``openai`` tiny_openai against a real router, prefill pod and
decode pod (``splitserve up``, the tiny-random model: one token per byte, so that token-level asks are easy to
check), every prompt prefilled on P and decoded on D (``conditional_prefill_threshold=0``). Answers are checked
against the offline engine with the same parameters: the prefill pod samples the first token and the decode pod
the rest, so a constraint that one of them dropped shows."""

from __future__ import annotations

import re

import pytest

from splitserve.engine import LLM
from splitserve.engine.sampling.params import SamplingParams

pytestmark = [pytest.mark.e2e]

PROMPT = "hello world"


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
def test_token_constraints_are_kept_by_both_pods_and_match_the_offline_engine(tiny_openai, offline, asked, temperature,
                                                                               seed):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=PROMPT, max_tokens=12, temperature=temperature,
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


# --- several choices: n samples, a list of prompts, echo -----------------------------------------------------------


def offline_text(offline: LLM, prompt: str | list[int], **params) -> str:
    return offline.generate(prompt, SamplingParams(max_tokens=8, **params))[0].text


def test_seeded_samples_equal_separate_requests_seeded_seed_plus_their_index(tiny_openai, offline):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=PROMPT, n=3, seed=7, temperature=1.0,
                                       max_tokens=8)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    texts = [choice.text for choice in answer.choices]
    assert texts == [offline_text(offline, PROMPT, seed=7 + i, temperature=1.0) for i in range(3)]
    assert len(set(texts)) == 3
    assert answer.usage.prompt_tokens == len(tokens_of(offline, PROMPT))  # the prompt counted once
    assert answer.usage.completion_tokens == 3 * 8


def test_a_list_of_prompts_gets_n_choices_each_in_prompt_order(tiny_openai, offline):
    prompts = ["abc", [80, 81, 82, 83]]
    answer = tiny_openai.completions.create(model="tiny-random", prompt=prompts, n=2, seed=3, temperature=1.0,
                                       max_tokens=8)
    expected = [offline_text(offline, prompt, seed=3 + sample, temperature=1.0)
                for prompt in prompts for sample in range(2)]
    assert [choice.text for choice in answer.choices] == expected
    assert answer.usage.prompt_tokens == len(tokens_of(offline, "abc")) + 4


def test_streamed_choices_carry_their_index_and_the_usage_of_all(tiny_openai, offline):
    stream = tiny_openai.completions.create(model="tiny-random", prompt=["abc", PROMPT], seed=1, temperature=1.0,
                                       max_tokens=8, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = ["", ""], [None, None], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
        usage = chunk.usage or usage
    expected = offline.generate(["abc", PROMPT], SamplingParams(max_tokens=8, seed=1, temperature=1.0))
    assert texts == [output.text for output in expected]
    assert finished == [output.finish_reason for output in expected]
    assert usage.completion_tokens == sum(len(output.token_ids) for output in expected)
    assert usage.prompt_tokens == 3 + len(tokens_of(offline, PROMPT))


def test_chat_with_n_samples(tiny_openai):
    answer = tiny_openai.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}], n=2,
                                            seed=5, temperature=1.0, max_tokens=6)
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_output(tiny_openai, offline, stream):
    answer = tiny_openai.completions.create(model="tiny-random", prompt=[PROMPT, [80, 81]], echo=True, temperature=0,
                                       max_tokens=8, stream=stream)
    chunks = answer if stream else [answer]
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [PROMPT + offline_text(offline, PROMPT, temperature=0),
                     offline.tokenizer.decode([80, 81]) + offline_text(offline, [80, 81], temperature=0)]


# --- gRPC: the same fields in SamplingParams ----------------------------------------------------------------------


def grpc_text(tiny_pd_up, **params) -> tuple[str, int]:
    import grpc

    from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    text, finish_reason = "", None
    with grpc.insecure_channel(f"{tiny_pd_up.config.host}:{tiny_pd_up.config.grpc_port}") as channel:
        request = generate_pb2.GenerateRequest(text=PROMPT, sampling_params=common_pb2.SamplingParams(**params))
        for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            assert response.WhichOneof("response") != "error", response.error.message
            if response.HasField("chunk"):
                text += response.chunk.text
            else:
                finish_reason = response.complete.finish_reason
    return text, finish_reason


def test_grpc_structured_output_and_token_constraints(tiny_pd_up):
    from splitserve.v1 import common_pb2

    for seed in range(4):
        text, finish_reason = grpc_text(tiny_pd_up, temperature=1.0, seed=seed, max_tokens=16, structured_output=(
            common_pb2.StructuredOutput(regex="[a-c]{2,5}x")))
        assert re.fullmatch("[a-c]{2,5}x", text) and finish_reason == common_pb2.FINISH_REASON_STOP
        text, _ = grpc_text(tiny_pd_up, temperature=1.0, seed=seed, max_tokens=16, structured_output=(
            common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["alpha", "beta"]))))
        assert text in ("alpha", "beta")
    text, _ = grpc_text(tiny_pd_up, temperature=0.0, max_tokens=5, logit_bias={72: 100.0})
    assert text == "fffff"


def test_grpc_refuses_a_spec_that_does_not_compile(tiny_pd_up):
    import grpc

    from splitserve.v1 import common_pb2

    with pytest.raises(grpc.RpcError) as raised:
        grpc_text(tiny_pd_up, max_tokens=4, structured_output=common_pb2.StructuredOutput(regex="(unclosed"))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in raised.value.details() and "cannot compile the regex" in raised.value.details()


def test_grpc_n_streams_each_sample_with_its_index_equal_to_separate_seeded_requests(tiny_pd_up):
    import grpc

    from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    texts, completes, ids = ["", "", ""], [None, None, None], set()
    params = common_pb2.SamplingParams(n=3, seed=9, temperature=1.0, max_tokens=8)
    with grpc.insecure_channel(f"{tiny_pd_up.config.host}:{tiny_pd_up.config.grpc_port}") as channel:
        request = generate_pb2.GenerateRequest(request_id="grpc-n", text=PROMPT, sampling_params=params)
        for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            assert response.WhichOneof("response") != "error", response.error.message
            ids.add(response.request_id)
            if response.HasField("chunk"):
                texts[response.index] += response.chunk.text
            else:
                completes[response.index] = response.complete
    assert ids == {"grpc-n"} and all(complete is not None for complete in completes)
    assert texts == [grpc_text(tiny_pd_up, seed=9 + i, temperature=1.0, max_tokens=8)[0] for i in range(3)]
    assert len(set(texts)) == 3
