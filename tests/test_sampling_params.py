"""SamplingParams: defaults, normalization, and one ValueError naming the field for every bad value."""

import math

import pytest

from splitserve.engine.sampling.params import SamplingParams


def test_defaults_are_vllm_defaults_and_valid():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.max_tokens, p.min_tokens) == (None, [], [], 16, 0)
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens, p.include_stop_str_in_output) == (False, None, True, False)
    assert not p.is_greedy


def test_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_below_vllm_threshold():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_integer_numbers_become_floats():
    p = SamplingParams(temperature=2, top_p=1, repetition_penalty=1)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.repetition_penalty) is float


def test_boundary_values_are_accepted():
    SamplingParams(
        top_p=1e-9, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2, seed=2**63 - 1,
        max_tokens=1, min_tokens=1, logprobs=20, stop_token_ids=[0],
    )
    SamplingParams(max_tokens=None, min_tokens=10_000, logprobs=0, seed=0, top_k=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -3),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", False),
        ("stop", [""]),
        ("stop", ""),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 3),
        ("max_tokens", -1),  # 0 is scoring: the prompt prefilled, nothing generated
        ("max_tokens", -5),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", 1.0),
        ("skip_special_tokens", "yes"),
        ("include_stop_str_in_output", None),
    ],
)
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert message.startswith(field + " "), message


def test_range_message_says_the_allowed_range_and_the_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 and finite, got -1$"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        SamplingParams(n=0)


def test_each_sample_is_one_request_seeded_seed_plus_its_index():
    params = SamplingParams(n=3, seed=2**63 - 2, temperature=0.5)
    assert [p.seed for p in map(params.for_sample, range(3))] == [2**63 - 2, 2**63 - 1, 0]
    assert params.for_sample(2) == SamplingParams(seed=0, temperature=0.5)
    assert SamplingParams(n=2).for_sample(1).seed is None


def test_dict_round_trip():
    p = SamplingParams(temperature=0.7, top_k=40, seed=7, stop=["x"], stop_token_ids=[2], max_tokens=None, logprobs=3)
    d = p.to_dict()
    assert d["seed"] == 7 and d["max_tokens"] is None and d["stop"] == ["x"]
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown sampling parameter\\(s\\): best_of, foo"):
        SamplingParams.from_dict({"foo": 1, "best_of": 2})


def test_from_dict_validates():
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams.from_dict({"top_p": 0})
    assert math.isclose(SamplingParams.from_dict({"top_p": 0.5}).top_p, 0.5)
