"""Structured outputs through the disaggregated path, with the real model: the ``openai`` client against a router,
a prefill pod and a decode pod (``splitserve up``, SmolLM2-135M-Instruct), every prompt prefilled on P (which
samples the first token under the grammar) and decoded on D (which rebuilds the grammar from that token). Every
answer must parse and validate: 50 generated schemas at temperature 0 and 1, a pydantic model through
``chat.completions.parse``, regexes and choices; a spec that does not compile is a 400 naming its field."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MODEL = "smollm2-135m"
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    cluster = start_cluster(tmp_path_factory.mktemp("structured"), model=MODEL, prefill=1, decode=1, kv_codec="none",
                            scheduling="disaggregated", conditional_prefill_threshold=0,
                            kv_cache_memory_bytes=128 << 20, max_num_seqs=32, prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.config.host}:{cluster.config.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- 50 generated schemas ---------------------------------------------------------------------------------------


def generated_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema: nested objects, arrays, enums, bounded numbers, required and optional fields."""
    properties = {}
    for i in range(rng.randint(1, 3)):
        properties[f"{rng.choice(['name', 'size', 'kind', 'items', 'score', 'tag'])}_{i}"] = _value_schema(rng, depth)
    required = [name for name in properties if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value_schema(rng: random.Random, depth: int) -> dict:
    # One level of nesting (an object or an array in the top object), so that every answer fits in MAX_TOKENS.
    kinds = ["string", "integer", "number", "enum", "boolean"] + (["object", "array"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "object":
        return generated_schema(rng, depth + 1)
    return {"type": "array", "items": _value_schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}


SCHEMAS = [generated_schema(random.Random(seed)) for seed in range(50)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates_against_its_generated_schema(client, temperature):
    def answer(index_schema):
        index, schema = index_schema
        reply = client.chat.completions.create(
            model=MODEL, messages=ask("Fill in this JSON for an imaginary product."), temperature=temperature,
            seed=index, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}})
        return reply.choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(answer, enumerate(SCHEMAS)))
    for schema, choice in zip(SCHEMAS, choices):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


# --- the openai client's parse(), and vLLM's fields ----------------------------------------------------------------


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Household(BaseModel):
    city: str = Field(max_length=20)
    pets: list[Pet] = Field(max_length=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client, temperature):
    for seed in range(3):
        completion = client.chat.completions.parse(model=MODEL, messages=ask("Describe a household with pets."),
                                                   response_format=Household, temperature=temperature, seed=seed,
                                                   max_tokens=MAX_TOKENS)
        assert isinstance(completion.choices[0].message.parsed, Household)


def test_json_object_on_completions_and_chat(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=ask("Give the capital of France as a JSON object with a single key, city."),
        response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0.0)
    # Any object has no bound on its size: a prompt this small model answers in a few tokens, in float32 and bf16
    # prefill alike ("Reply with a JSON object whose only key is city." loops on nested keys past 256 tokens after
    # a bf16 prefill).
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(model=MODEL, prompt="A JSON object about Rome:", max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)


REGEX = r"(\+33|0)[1-9]( \d\d){4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", REGEX, lambda text: re.fullmatch(REGEX, text)),
    ("guided_choice", CHOICES, lambda text: text in CHOICES),
    ("structured_outputs", {"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ("structured_outputs", {"choice": CHOICES}, lambda text: text in CHOICES),
    ("guided_grammar", 'start: "yes" | "no" | number\nnumber: /[0-9]{1,3}/',
     lambda text: re.fullmatch(r"yes|no|[0-9]{1,3}", text)),
    ("guided_json", {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
     lambda text: jsonschema.validate(json.loads(text), {"type": "array", "items": {"type": "integer"}}) or True),
])
def test_regex_choice_grammar_and_json_always_match(client, field, value, check):
    def answer(seed):
        return client.completions.create(model=MODEL, prompt="The phone number of the office, and how it went:",
                                         temperature=1.0, seed=seed, max_tokens=64, n=1, extra_body={field: value})

    with ThreadPoolExecutor(8) as pool:
        for reply in pool.map(answer, range(8)):
            assert reply.choices[0].finish_reason == "stop"
            assert check(reply.choices[0].text), reply.choices[0].text


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "response_format: cannot compile the JSON schema"),
    ({"guided_regex": "(a"}, "guided_regex", "guided_regex: cannot compile the regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "guided_grammar: cannot compile the grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "structured_outputs: set exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice",
     "guided_choice: only one structured output per request; guided_regex is set too"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: must list at least one choice"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: the JSON schema is not JSON"),
    ({"guided_regex": "a", "ignore_eos": True}, "guided_regex",
     "guided_regex cannot be combined with ignore_eos or min_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "guided_decoding_backend is not supported"),
])
def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
    assert raised.value.param == param
    assert message in raised.value.message


def test_a_pathological_regex_compiles_and_constrains_without_blowing_up(client):
    # Nested counted repetitions blow up an eagerly built automaton; llguidance builds its lexer lazily, within
    # fuel limits per step (GRAMMAR_LIMITS), so the request is served and its output stays inside the language.
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=16, temperature=1.0, seed=0,
                                      extra_body={"guided_regex": "((a{1,100}){1,100}){1,100}b{1,1000}"})
    assert re.fullmatch("a*b*", reply.choices[0].text)


# --- tool calls ----------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_calls_always_parse(client, tool_choice, names, temperature):
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS,
                                               tool_choice=tool_choice, temperature=temperature, seed=seed,
                                               max_tokens=MAX_TOKENS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, names)


def test_streamed_tool_calls_arrive_as_deltas_the_client_assembles(client):
    stream = client.chat.completions.create(model=MODEL, messages=ask("What is the weather in Oslo?"), tools=TOOLS,
                                            tool_choice="required", temperature=0.0, max_tokens=MAX_TOKENS,
                                            stream=True, parallel_tool_calls=False)
    calls, finish_reason = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    assert finish_reason == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] in {"get_weather", "get_time"}
    json.loads(calls[0]["arguments"])


def test_a_conversation_with_calls_and_their_results_goes_on(client):
    first = client.chat.completions.create(model=MODEL, messages=ask("Weather in Rome?"), tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0.0, max_tokens=MAX_TOKENS)
    message = first.choices[0].message
    call = message.tool_calls[0]
    follow_up = ask("Weather in Rome?") + [message.model_dump(exclude_none=True),
                                           {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, temperature=0.0,
                                           max_tokens=32)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
