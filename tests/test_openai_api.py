"""The OpenAI-compatible HTTP API (router/openai/app.py) in front of a fake Router.

The fake streams a fixed answer ("Hello", ", world", "!": tokens [1], [2, 3], [4]) with exact logprobs, or fails in
the ways a real router does. The app runs in a real uvicorn server on a free loopback port; tests drive it with
httpx (exact bytes, statuses, disconnects) and with the official ``openai`` client (what users run).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import openai
import pytest
import uvicorn
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from splitserve.engine.sampling.params import SamplingParams, StructuredOutput
from splitserve.engine.sequence import PromptLogprob
from splitserve.router.config import RouterConfig
from splitserve.router.intake import DEFAULT_SERVICE, RouterRequest, ServiceLevel
from splitserve.router.openai.app import ServerSentEvents, create_app
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.runtime.errors import StatusError
from splitserve.runtime.metrics import RouterMetrics

MODEL = "fake-model"
VOCAB = {0: "<eos>", 1: "Hello", 2: ",", 3: " world", 4: "!", 5: " there", 6: "é"}
ANSWER = [([1], "Hello"), ([2, 3], ", world"), ([4], "!")]
# Each output token's candidates, most likely first. Token 4 was sampled although 5 and 0 were likelier.
RANKINGS = {
    1: [(1, -0.25), (5, -1.5), (0, -3.0)],
    2: [(2, -0.5), (4, -1.0), (3, -2.0)],
    3: [(3, -0.125), (6, -2.5), (0, -4.0)],
    4: [(5, -0.75), (0, -1.25), (4, -2.0)],
}
CACHED_TOKENS = 2
MAX_MODEL_LEN = 4096


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[token_id] for token_id in ids)

    def id_to_token(self, token_id: int) -> str:
        return VOCAB[token_id]


class FakeRouter:
    """Router's interface; records what it was asked and how each generation ended."""

    model_name = MODEL

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, decode_pods=["10.0.0.7:50060"])
        self.tokenizer = FakeTokenizer()
        self.metrics = RouterMetrics(MODEL)
        self.reset()

    def reset(self):
        self.is_ready = True
        self.requests: list[RouterRequest] = []
        self.rendered_chats: list[list[dict]] = []
        self.chat_options: list[dict] = []  # the template options of each rendered chat
        self.tokenized: list[tuple[str, bool]] = []  # (text, add_special_tokens) of each text tokenized
        self.error_before_first: Exception | None = None
        self.error_after_deltas: Exception | None = None
        self.finish_reason = "stop"
        self.finish_error: StatusError | None = None  # Completion.error, with finish_reason "error"
        self.repeat = 1  # how many times the answer's deltas are streamed
        self.pause_s = 0.0  # before each output
        self.started = threading.Event()
        self.finished = threading.Event()  # generate reached its end (its Completion or its own error)
        self.closed_early = threading.Event()  # generate was closed or cancelled before its end

    async def make_request(self, prompt, params: SamplingParams, request_id: str | None = None, *,
                           add_special_tokens: bool = True, timeout_s: float | None = None,
                           service: ServiceLevel = DEFAULT_SERVICE) -> RouterRequest:
        token_ids = prompt if isinstance(prompt, list) else await self.tokenize(prompt, add_special_tokens)
        if len(token_ids) == 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"logprobs: must be <= {self.config.max_logprobs}")
        text = prompt if isinstance(prompt, str) else None
        return RouterRequest(request_id=request_id or f"req{len(self.requests)}", prompt_token_ids=token_ids,
                             params=params, prompt_text=text, arrival_time=time.monotonic(), timeout_s=timeout_s,
                             slo_ttft_s=service.ttft_s, slo_tpot_s=service.tpot_s,
                             priority=service.priority)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenized.append((text, add_special_tokens))
        return [7] * len(text)  # one token per character

    async def detokenize(self, token_ids: list[int]) -> str:
        if any(t not in VOCAB for t in token_ids):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "tokens: token ids must be in the vocabulary")
        return self.tokenizer.decode(token_ids)

    async def apply_chat_template(self, messages: list[dict], **options) -> str:
        self.rendered_chats.append(messages)
        self.chat_options.append(options)
        if messages[-1]["role"] == "assistant" and not options.get("continue_final_message"):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "messages: the conversation must end with a user's")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if options.get("add_generation_prompt") else "")

    async def generate(self, request: RouterRequest):
        self.requests.append(request)
        self.started.set()
        try:
            if self.error_before_first is not None:
                raise self.error_before_first
            prompt_logprobs = self._prompt_logprobs(request)
            for _ in range(self.repeat):
                for token_ids, text in ANSWER:
                    await asyncio.sleep(self.pause_s)
                    yield OutputDelta(token_ids, text, self._logprobs(token_ids, request.params.logprobs),
                                      prompt_logprobs)
                    prompt_logprobs = None  # in the first delta only
            if self.error_after_deltas is not None:
                raise self.error_after_deltas
            self.finished.set()
            yield Completion(self.finish_reason, None, prompt_tokens=len(request.prompt_token_ids),
                             completion_tokens=4 * self.repeat, cached_tokens=CACHED_TOKENS, timings={},
                             error=self.finish_error)
        except Exception:
            self.finished.set()
            raise
        finally:
            if not self.finished.is_set():
                self.closed_early.set()

    @staticmethod
    def _prompt_logprobs(request: RouterRequest) -> list[PromptLogprob] | None:
        """Every prompt token after the first at -0.5, ranked second after "!"."""
        if request.params.prompt_logprobs is None:
            return None
        return [PromptLogprob(token_id, -0.5, 2, {4: -0.25, token_id: -0.5, 0: -1.0})
                for token_id in request.prompt_token_ids[1:]]

    @staticmethod
    def _logprobs(token_ids: list[int], num_top: int | None) -> list[dict[int, float]] | None:
        if num_top is None:
            return None
        # As the router hands them over: the top alternatives in rank order, then the sampled token if missing.
        tops = [dict(RANKINGS[token_id][:num_top]) for token_id in token_ids]
        for token_id, top in zip(token_ids, tops):
            top.setdefault(token_id, dict(RANKINGS[token_id])[token_id])
        return tops

    async def abort(self, request_id: str) -> bool:
        return False

    def ready(self) -> bool:
        return self.is_ready

    def pods(self) -> list[dict]:
        return [{"address": "10.0.0.7:50060", "role": "decode", "healthy": self.is_ready}]


@pytest.fixture(scope="module")
def served():
    router = FakeRouter()
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield router, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def fake(served) -> FakeRouter:
    router, _ = served
    router.reset()
    return router


@pytest.fixture
def http(served, fake):
    with httpx.Client(base_url=served[1], timeout=10) as client:
        yield client


@pytest.fixture
def client(served, fake) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)


def sse_data(response: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream, JSON-decoded except the final "[DONE]"."""
    events = response.text.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payload = event.removeprefix("data: ")
        payloads.append(payload if payload == "[DONE]" else json.loads(payload))
    return payloads


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 2}}


# ---------------------------------------------------------------------------------------- completions


def test_completion_with_the_openai_client(client, fake):
    completion = client.completions.create(model=MODEL, prompt="Hi yo", temperature=0, seed=7, stop=["\n"])
    assert completion.id == "cmpl-req0"
    assert completion.object == "text_completion"
    assert completion.model == MODEL
    assert [(c.index, c.text, c.finish_reason, c.logprobs) for c in completion.choices] == [
        (0, "Hello, world!", "stop", None)]
    assert completion.usage.model_dump(exclude_none=True) == USAGE
    params = fake.requests[0].params
    assert (params.max_tokens, params.temperature, params.seed, params.stop, params.logprobs) == (
        16, 0.0, 7, ["\n"], None)
    assert fake.finished.is_set() and not fake.closed_early.is_set()


def test_completion_passes_every_sampling_field_to_sampling_params(http, fake):
    body = {
        "prompt": [3, 1, 4], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 11,
        "presence_penalty": 0.25, "frequency_penalty": -0.5, "user": "someone", "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.25, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [0],
        "skip_special_tokens": False, "include_stop_str_in_output": True, "logprobs": 1,
        "logit_bias": {"5": -2.5, "7": 100}, "allowed_token_ids": [5, 6, 7], "bad_words": ["darn"],
    }
    assert http.post("/v1/completions", json=body).status_code == 200
    assert fake.requests[0].prompt_token_ids == [3, 1, 4]
    assert fake.requests[0].params == SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.9, stop=["END"], seed=11, presence_penalty=0.25,
        frequency_penalty=-0.5, top_k=40, min_p=0.05, repetition_penalty=1.25, min_tokens=2, ignore_eos=True,
        stop_token_ids=[0], skip_special_tokens=False, include_stop_str_in_output=True, logprobs=1,
        logit_bias={5: -2.5, 7: 100.0}, allowed_token_ids=[5, 6, 7], bad_words=["darn"])


@pytest.mark.parametrize("field, value, expected", [
    ("response_format", {"type": "json_object"}, StructuredOutput(json_object=True)),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string"}}},
     StructuredOutput(json='{"type": "string"}')),
    ("guided_json", {"type": "integer"}, StructuredOutput(json='{"type": "integer"}')),
    ("guided_json", '{"type": "integer"}', StructuredOutput(json='{"type": "integer"}')),
    ("guided_regex", "a+", StructuredOutput(regex="a+")),
    ("guided_choice", ["x", "y"], StructuredOutput(choice=("x", "y"))),
    ("guided_grammar", 'start: "a"', StructuredOutput(grammar='start: "a"')),
    ("structured_outputs", {"json": {"type": "null"}}, StructuredOutput(json='{"type": "null"}')),
    ("structured_outputs", {"choice": ["x"]}, StructuredOutput(choice=("x",))),
    ("structured_outputs", {"json_object": True}, StructuredOutput(json_object=True)),
    ("response_format", {"type": "text"}, None),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_structured_output_field_becomes_the_requests_structured_output(http, fake, path, field, value,
                                                                              expected):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    assert http.post(path, json={**body, field: value}).status_code == 200
    assert fake.requests[0].params.structured_output == expected


def test_a_batch_of_one_prompt_is_that_prompt(http, fake):
    assert http.post("/v1/completions", json={"prompt": ["Hi"]}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": [[5, 6]]}).status_code == 200
    assert [(r.prompt_text, r.prompt_token_ids) for r in fake.requests] == [("Hi", [7, 7]), (None, [5, 6])]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "Hi"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_requests_own_latency_targets_and_priority_reach_the_router(http, fake, path, extra):
    assert http.post(path, json={**extra, "slo_ttft_s": 0.5, "slo_tpot_s": 0.02, "priority": -3}).status_code == 200
    assert http.post(path, json={**extra, "slo_tpot_s": 0.1, "priority": None}).status_code == 200
    assert [(r.slo_ttft_s, r.slo_tpot_s, r.priority) for r in fake.requests] == [(0.5, 0.02, -3), (None, 0.1, 0)]
    refused = http.post(path, json={**extra, "slo_ttft_s": 0})
    assert refused.status_code == 400 and "slo_ttft_s: must be a number of seconds > 0" in refused.text
    for priority, why in [(2**31, "must be an integer in [-2^31, 2^31)"), ("high", "priority")]:
        refused = http.post(path, json={**extra, "priority": priority})
        assert refused.status_code == 400 and why in refused.text, refused.text


def test_max_tokens_null_means_until_the_context_is_full(http, fake):
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": None}).status_code == 200
    assert fake.requests[0].params.max_tokens is None


def test_completion_stream_with_the_openai_client(client, fake):
    stream = client.completions.create(model=MODEL, prompt="Hi yo", stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert {chunk.id for chunk in chunks} == {"cmpl-req0"}
    assert {chunk.object for chunk in chunks} == {"text_completion"}
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == [
        ("Hello", None), (", world", None), ("!", None), ("", "stop")]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(exclude_none=True) == USAGE


def test_completion_stream_is_server_sent_events_ending_in_done(http, fake):
    response = http.post("/v1/completions", json={"prompt": "Hi yo", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = sse_data(response)
    assert events[-1] == "[DONE]"
    assert [e["choices"] for e in events[:-1]] == [
        [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None, "stop_reason": None,
         "prompt_logprobs": None}],
        [{"index": 0, "text": ", world", "logprobs": None, "finish_reason": None, "stop_reason": None,
         "prompt_logprobs": None}],
        [{"index": 0, "text": "!", "logprobs": None, "finish_reason": None, "stop_reason": None,
         "prompt_logprobs": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": None,
         "prompt_logprobs": None}],
    ]
    assert all(e["usage"] is None for e in events[:-1])  # no usage chunk unless include_usage


def test_completion_logprobs_in_openai_legacy_format(client, fake):
    completion = client.completions.create(model=MODEL, prompt="Hi yo", logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == ["Hello", ",", " world", "!"]
    assert logprobs.token_logprobs == [-0.25, -0.5, -0.125, -2.0]
    assert logprobs.top_logprobs == [
        {"Hello": -0.25, " there": -1.5},
        {",": -0.5, "!": -1.0},
        {" world": -0.125, "é": -2.5},
        {" there": -0.75, "<eos>": -1.25, "!": -2.0},  # the sampled token joins the top 2
    ]
    assert logprobs.text_offset == [0, 5, 6, 12]
    assert fake.requests[0].params.logprobs == 2


def test_echo_with_logprobs_scores_the_prompt_before_the_output(client, fake):
    completion = client.completions.create(model=MODEL, prompt=[1, 5], logprobs=1, echo=True)
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].text == "Hello thereHello, world!"
    assert logprobs.tokens == ["Hello", " there", "Hello", ",", " world", "!"]
    assert logprobs.token_logprobs == [None, -0.5, -0.25, -0.5, -0.125, -2.0]
    assert logprobs.top_logprobs[:2] == [None, {"!": -0.25, " there": -0.5}]  # the top 1 and the prompt's token
    assert logprobs.text_offset == [0, 5, 11, 16, 17, 23]  # counted from the prompt's first token
    assert fake.requests[0].params.prompt_logprobs == 1


def test_prompt_logprobs_come_in_vllms_shape(http, fake):
    choice = http.post("/v1/completions", json={"prompt": [1, 5, 6], "prompt_logprobs": 2}).json()["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == "Hello, world!"
    entry = {"logprob": -0.5, "rank": 2}
    assert choice["prompt_logprobs"] == [None] + [
        {str(token_id): {**entry, "decoded_token": VOCAB[token_id]}, "4": {"logprob": -0.25, "rank": 1,
                                                                          "decoded_token": "!"}}
        for token_id in (5, 6)]


def test_completion_logprobs_zero_gives_only_the_sampled_token(http, fake):
    choice = http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 0}).json()["choices"][0]
    assert choice["logprobs"]["top_logprobs"] == [{"Hello": -0.25}, {",": -0.5}, {" world": -0.125}, {"!": -2.0}]


def test_streamed_logprobs_keep_counting_text_offsets_across_chunks(http, fake):
    response = http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1, "stream": True})
    deltas = [e["choices"][0]["logprobs"] for e in sse_data(response)[:3]]
    assert [d["tokens"] for d in deltas] == [["Hello"], [",", " world"], ["!"]]
    assert [d["text_offset"] for d in deltas] == [[0], [5, 6], [12]]
    assert [d["top_logprobs"] for d in deltas][2] == [{" there": -0.75, "!": -2.0}]


# ----------------------------------------------------------------------------------------------- chat


def test_chat_with_the_openai_client(client, fake):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
    assert chat.id == "chatcmpl-req0"
    assert chat.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason, c.logprobs) for c in chat.choices] == [
        (0, "assistant", "Hello, world!", "stop", None)]
    # Text parts are joined by newlines before the template sees them.
    assert fake.rendered_chats == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]]
    prompt = "<system>Be brief.<user>Hi\nthere<assistant>"  # the fake makes one token per character
    assert fake.requests[0].prompt_text == prompt
    assert chat.usage.model_dump(exclude_none=True) == {**USAGE, "prompt_tokens": 42, "total_tokens": 46}
    assert fake.requests[0].params.max_tokens == 5


def test_chat_without_max_tokens_runs_until_the_context_is_full(http, fake):
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200
    assert fake.requests[0].params.max_tokens is None
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3})
    assert fake.requests[1].params.max_tokens == 3


def test_chat_stream_with_the_openai_client(client, fake):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert {(chunk.id, chunk.object) for chunk in chunks} == {("chatcmpl-req0", "chat.completion.chunk")}
    deltas = [(c.choices[0].delta.role, c.choices[0].delta.content, c.choices[0].finish_reason) for c in chunks[:-1]]
    assert deltas == [("assistant", "", None), (None, "Hello", None), (None, ", world", None), (None, "!", None),
                      (None, None, "stop")]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(exclude_none=True) == {**USAGE, "prompt_tokens": 19, "total_tokens": 23}


def test_chat_stream_deltas_carry_only_what_is_new(http, fake):
    response = http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    events = sse_data(response)
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": ", world"}, {"content": "!"}, {}]
    assert events[-1] == "[DONE]"


def test_chat_logprobs_with_the_openai_client(client, fake):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [
        ("Hello", -0.25, list(b"Hello")), (",", -0.5, [44]), (" world", -0.125, list(b" world")), ("!", -2.0, [33])]
    assert [[(top.token, top.logprob) for top in t.top_logprobs] for t in content] == [
        [("Hello", -0.25), (" there", -1.5)],
        [(",", -0.5), ("!", -1.0)],
        [(" world", -0.125), ("é", -2.5)],
        [(" there", -0.75), ("<eos>", -1.25)],  # exactly the top 2: the sampled token is reported above
    ]
    assert content[2].top_logprobs[1].bytes == [0xC3, 0xA9]


def test_chat_logprobs_without_top_logprobs(http, fake):
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["top_logprobs"]) for t in content] == [("Hello", []), (",", []), (" world", []), ("!", [])]
    assert fake.requests[0].params.logprobs == 0


# --------------------------------------------------------------------------------------- bad requests


def error_of(response: httpx.Response) -> dict:
    assert set(response.json()) == {"error"}
    return response.json()["error"]


@pytest.mark.parametrize("body, param, message", [
    ({"temperature": -1}, "temperature", "temperature must be >= 0 and finite, got -1.0"),
    ({"temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0"),
    ({"n": 0}, "n", "n must be >= 1, got 0"),
    ({"n": 129}, "n", "n: 1 prompt(s) x n = 129 make 129 choices, more than the limit of 128 per request"),
    ({"prompt": ["a"] * 65, "n": 2}, "prompt",
     "prompt: 65 prompt(s) x n = 2 make 130 choices, more than the limit of 128 per request"),
    ({"n": 1.0}, "n", "n: Input should be a valid integer"),
    ({"max_tokens": 0}, "max_tokens",
     "max_tokens must be >= 1 (0, which generates nothing, is for scoring a prompt: /v1/completions with echo)"),
    ({"max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"stop": ""}, "stop", "stop strings must be non-empty, got an empty string"),
    ({"stop": [1]}, "stop[0]", "stop[0]: Input should be a valid string"),
    ({"logprobs": -1}, "logprobs", "logprobs: Input should be greater than or equal to 0"),
    ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20] or None, got 21"),
    ({"best_of": 2, "n": 3}, "best_of", "best_of must be >= n (3), got 2"),
    ({"best_of": 0}, "best_of", "best_of: Input should be greater than or equal to 1"),
    ({"best_of": 2, "stream": True}, "best_of", "best_of: the samples are ranked once they are all done, so they "
     "cannot be streamed; set stream to false"),
    ({"best_of": 129}, "best_of", "best_of: 1 prompt(s) x n = 129 make 129 choices, more than the limit of 128 per "
     "request"),
    ({"logit_bias": {"x1": -100}}, "logit_bias", "logit_bias keys must be token ids, got 'x1'"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "logit_bias must map token ids >= 0 to biases in [-100.0, 100.0], "
     "got 1: 101.0"),
    ({"logit_bias": {"1": "big"}}, "logit_bias.1", "logit_bias.1: Input should be a valid number"),
    ({"allowed_token_ids": []}, "allowed_token_ids",
     "allowed_token_ids must be a non-empty list of token ids >= 0, got []"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids",
     "allowed_token_ids must be a non-empty list of token ids >= 0, got [-1]"),
    ({"bad_words": [" "]}, "bad_words", "bad_words must be non-empty words, got an empty one"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options: stream_options is only allowed when stream is true"),
    ({"prompt": [1, "two"]}, "prompt", "prompt: prompt must be a string, a list of token ids, or a list of those"),
    ({"prompt": None}, "prompt", "prompt: prompt must be a string, a list of token ids, or a list of those"),
    ({"prompt": []}, "prompt", "prompt: must not be empty"),
    ({"min_tokens": 20}, "min_tokens", "min_tokens must be <= max_tokens (16), got 20"),
])
def test_bad_completion_fields_are_400_naming_the_field(http, fake, body, param, message):
    response = http.post("/v1/completions", json={"prompt": "Hi", **body})
    assert response.status_code == 400
    assert error_of(response) == {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "invalid_argument"}
    assert fake.requests == []


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "messages: List should have at least 1 item after validation, not 0"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role",
     "messages[0].role: Input should be 'system', 'user', 'assistant' or 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content",
     'messages[0].content: content parts must be {"type": "text", "text": "..."}; only text is supported'),
    ({"messages": [{"role": "user"}]}, "messages[0]",
     "messages[0]: content is required (null only for an assistant's tool calls)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: tool_choice 'required' needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, "tool_choice", "tool_choice: tool_choice names 'g', which is not one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name",
     "tools[0].function.name: String should match pattern '^[A-Za-z0-9_.-]{1,64}$'"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs: top_logprobs needs logprobs set to true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20] or None, got 21"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1 (0, which generates "
     "nothing, is for scoring a prompt: /v1/completions with echo)"),
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "guided_regex: only one structured output per request; response_format is set too"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]}, "messages",
     "messages: the conversation must end with a user's"),
])
def test_bad_chat_fields_are_400_naming_the_field(http, fake, body, param, message):
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})
    assert response.status_code == 400
    assert error_of(response) == {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "invalid_argument"}
    assert fake.requests == []


# Known fields this server does not honour yet, each with a value that asks for something: refused by name.
UNSUPPORTED = [
    ("guided_decoding_backend", "xgrammar"), ("structural_tag", {"type": "structural_tag"}),
    ("truncate_prompt_tokens", 10), ("use_beam_search", True),
    ("logits_processors", ["x"]),
    ("spaces_between_special_tokens", False), ("return_tokens_as_token_ids", True), ("store", True),
    ("service_tier", "flex"), ("cache_salt", "s"), ("kv_transfer_params", {}), ("metadata", {"a": "b"}),
]
CHAT_ONLY_UNSUPPORTED = [
    ("chat_template", "{{ messages }}"), ("documents", [{"text": "d"}]), ("reasoning_effort", "high"),
    ("modalities", ["text", "audio"]), ("functions", [{"name": "f"}]), ("prompt_logprobs", 1), ("best_of", 3),
]


@pytest.mark.parametrize("field, value", UNSUPPORTED + [("suffix", " end")])
def test_known_but_unsupported_completion_fields_are_refused_by_name(http, fake, field, value):
    response = http.post("/v1/completions", json={"prompt": "Hi", field: value})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["param"], error["code"]) == (field, "invalid_argument")
    assert error["message"].startswith(f"{field}: {field} is not supported: ")
    assert fake.requests == []


@pytest.mark.parametrize("field, value", UNSUPPORTED + CHAT_ONLY_UNSUPPORTED)
def test_known_but_unsupported_chat_fields_are_refused_by_name(http, fake, field, value):
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], field: value})
    assert response.status_code == 400
    assert error_of(response)["param"] == field
    assert fake.requests == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "some_future_field": 1}, "some_future_field"),
    ("/v1/completions", {"prompt": "Hi", "messages": []}, "messages"),
    ("/v1/completions", {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "weight": 2}]}, "messages[0].weight"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "suffix": "x"}, "suffix"),
])
def test_unknown_fields_are_refused_by_name(http, fake, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert error_of(response) == {
        "message": f"{param}: unknown field; this server refuses fields it does not know rather than ignore them "
                   "(docs/api.md)", "type": "invalid_request_error", "param": param, "code": "invalid_argument"}


def test_the_openai_client_sees_vllm_extras_refused_by_name(client, fake):
    for extra, param in (({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
                         ({"typo_field": 1}, "typo_field")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           extra_body=extra)
        assert (refused.value.status_code, refused.value.param) == (400, param)


def test_neutral_values_of_unsupported_fields_and_ignored_fields_are_accepted(client, fake):
    """What SDKs and clients send without asking for anything: nulls, defaults, a previous answer sent back."""
    previous = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None}
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}, previous, {"role": "user", "content": "More"}],
        n=1, user="u-1", response_format={"type": "text"}, tools=[], parallel_tool_calls=True, store=False,
        extra_body={"best_of": 1, "echo": False, "logit_bias": {}, "guided_json": None, "length_penalty": 1,
                    "safety_identifier": "s-1", "service_tier": "auto", "include_reasoning": True})
    assert len(fake.requests) == 1


def test_chat_template_options_and_special_tokens_reach_the_router(client, fake):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once", "name": "bot"}]
    client.chat.completions.create(model=MODEL, messages=messages, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert fake.chat_options == [{"add_generation_prompt": False, "continue_final_message": True,
                                  "template_kwargs": {"enable_thinking": False}}]
    assert fake.rendered_chats[0][1] == {"role": "assistant", "content": "Once", "name": "bot"}
    assert fake.tokenized[-1] == ("<user>Hi<assistant>Once", True)
    client.chat.completions.create(model=MODEL, messages=messages[:1])
    assert fake.chat_options[1] == {"add_generation_prompt": True, "continue_final_message": False,
                                    "template_kwargs": None}
    assert fake.tokenized[-1][1] is False  # vLLM's default for chat: the template writes the special tokens
    client.completions.create(model=MODEL, prompt="Hi", extra_body={"add_special_tokens": False})
    assert fake.tokenized[-1] == ("Hi", False)


def test_continue_final_message_needs_add_generation_prompt_off(http, fake):
    body = {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}
    error = error_of(http.post("/v1/chat/completions", json=body))
    assert error["param"] == "continue_final_message"
    assert error["message"] == ("continue_final_message: continue_final_message cannot be combined with "
                                "add_generation_prompt; set add_generation_prompt to false")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http, fake):
    body = {"prompt": "Hi yo", "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}}
    events = sse_data(http.post("/v1/completions", json=body))
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 3, 4, 4, 4]
    assert {e["usage"]["prompt_tokens"] for e in events[:-1]} == {5}
    assert events[3]["usage"] == USAGE and events[4]["usage"] == USAGE  # the finish chunk and the usage chunk
    chat = sse_data(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], **{k: v for k, v in body.items() if k != "prompt"}}))
    assert [e["usage"]["completion_tokens"] for e in chat[:-1]] == [0, 1, 3, 4, 4, 4]
    refused = http.post("/v1/completions", json={**body, "stream_options": {"continuous_usage_stats": True}})
    assert error_of(refused)["message"] == "stream_options.continuous_usage_stats: continuous_usage_stats needs " \
                                           "include_usage set to true"


def test_user_and_request_id_fields(http, fake):
    response = http.post("/v1/completions", json={"prompt": "Hi", "user": "u", "request_id": "mine-1"})
    assert response.json()["id"] == "cmpl-mine-1"
    assert response.headers["x-request-id"] == "mine-1"
    assert fake.requests[0].request_id == "mine-1"


def test_body_that_is_not_json_is_400_without_param(http, fake):
    response = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_argument")
    assert error["message"].startswith("JSON decode error")


def test_bad_request_is_a_bad_request_error_in_the_openai_client(client, fake):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", n=0)
    assert raised.value.status_code == 400
    assert raised.value.param == "n"
    assert raised.value.code == "invalid_argument"


@pytest.mark.parametrize("prompt", ["", []])
def test_prompt_the_router_rejects_is_400_naming_the_field(http, fake, prompt):
    response = http.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 400
    assert error_of(response) == {"message": "prompt: must not be empty", "type": "invalid_request_error",
                                  "param": "prompt", "code": "invalid_argument"}


def test_unknown_model_is_404(http, fake):
    response = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    assert response.status_code == 404
    assert error_of(response) == {
        "message": "the model 'gpt-4' does not exist; this server serves 'fake-model'",
        "type": "not_found_error", "param": "model", "code": "not_found"}


def test_unknown_route_is_404_in_openai_shape(http, fake):
    response = http.post("/v1/embeddings", json={"input": "Hi"})
    assert response.status_code == 404
    assert error_of(response) == {"message": "Not Found", "type": "not_found_error", "param": None, "code": None}
    assert http.get("/v1/completions").status_code == 405


# ------------------------------------------------------------------------------------ router failures

ROUTER_FAILURES = [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "every decode pod is full"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error", "no decode pod is known"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error", "request timed out after 300 s"),
]


@pytest.mark.parametrize("code, status, error_type, message", ROUTER_FAILURES)
@pytest.mark.parametrize("stream", [False, True])
def test_router_error_before_the_first_token_is_an_http_status(http, fake, code, status, error_type, message,
                                                               stream):
    fake.error_before_first = StatusError(code, message)
    response = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert error_of(response) == {"message": message, "type": error_type, "param": None, "code": code.name.lower()}


@pytest.mark.parametrize("stream", [False, True])
def test_shed_load_answers_429_with_retry_after_in_whole_seconds(http, fake, stream):
    fake.error_before_first = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queues too long; retry later",
                                          retry_after_s=2.2)
    response = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
    assert (response.status_code, response.headers["retry-after"]) == (429, "3")
    fake.error_before_first = StatusError(grpc.StatusCode.UNAVAILABLE, "no decode pod is known")
    assert "retry-after" not in http.post("/v1/completions", json={"prompt": "Hi"}).headers


def test_full_router_is_a_rate_limit_error_in_the_openai_client(client, fake):
    fake.error_before_first = StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "every decode pod is full")
    with pytest.raises(openai.RateLimitError, match="every decode pod is full"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)


def test_router_error_after_streaming_started_is_an_error_event_then_done(http, fake):
    fake.error_after_deltas = StatusError(grpc.StatusCode.UNAVAILABLE, "decode pod 10.0.0.7:50061 went away")
    response = http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert response.status_code == 200
    events = sse_data(response)
    assert [e["choices"][0]["delta"] for e in events[:4]] == [
        {"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": ", world"}, {"content": "!"}]
    assert events[4:] == [{"error": {"message": "decode pod 10.0.0.7:50061 went away",
                                     "type": "service_unavailable_error", "param": None, "code": "unavailable"}},
                          "[DONE]"]


def test_error_event_raises_in_the_openai_client(client, fake):
    fake.error_after_deltas = StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "request timed out after 300 s")
    texts = []
    with pytest.raises(openai.APIError, match="request timed out after 300 s"):
        for chunk in client.completions.create(model=MODEL, prompt="Hi", stream=True):
            texts.append(chunk.choices[0].text)
    assert texts == ["Hello", ", world", "!"]


POD_LOST = StatusError(grpc.StatusCode.UNAVAILABLE, "pod 10.0.0.7:50061: connection reset")


@pytest.mark.parametrize("finish_reason, finish_error, status, error_type, message, code", [
    ("abort", None, 499, "cancelled_error", "request cmpl-req0 was aborted before it finished", "cancelled"),
    ("error", POD_LOST, 503, "service_unavailable_error", "pod 10.0.0.7:50061: connection reset", "unavailable"),
    ("error", None, 500, "server_error", "request cmpl-req0 failed on the pods", "internal"),
])
def test_abort_and_error_finishes_are_errors(http, fake, finish_reason, finish_error, status, error_type, message,
                                             code):
    fake.finish_reason, fake.finish_error = finish_reason, finish_error
    response = http.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == status
    assert error_of(response) == {"message": message, "type": error_type, "param": None, "code": code}
    fake.reset()
    fake.finish_reason, fake.finish_error = finish_reason, finish_error
    events = sse_data(http.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
    assert [e["choices"][0]["text"] for e in events[:3]] == ["Hello", ", world", "!"]
    assert events[3:] == [{"error": {"message": message, "type": error_type, "param": None, "code": code}}, "[DONE]"]


def test_unexpected_failure_is_500_without_its_details(http, fake):
    fake.error_before_first = RuntimeError("secret internals")
    response = http.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 500
    assert error_of(response) == {"message": "internal server error", "type": "server_error", "param": None,
                                  "code": "internal"}
    fake.reset()
    fake.error_after_deltas = RuntimeError("secret internals")
    events = sse_data(http.post("/v1/completions", json={"prompt": "Hi", "stream": True}))
    assert events[3:] == [{"error": {"message": "internal server error", "type": "server_error", "param": None,
                                     "code": "internal"}}, "[DONE]"]


def test_answer_that_ends_before_any_text_still_finishes_the_stream(http, fake):
    fake.repeat = 0
    events = sse_data(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "stream": True}))
    assert [e["choices"][0]["delta"] for e in events[:-1]] == [{"role": "assistant", "content": ""}, {}]
    assert events[-1] == "[DONE]"
    body = http.post("/v1/completions", json={"prompt": "Hi"}).json()
    assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == ("", 0)


# ---------------------------------------------------------------------------------- client disconnects


def test_client_disconnect_during_a_stream_closes_the_router_generator(served, fake):
    fake.repeat, fake.pause_s = 100, 0.05  # 300 deltas: 15 s if nobody stopped it
    with httpx.Client(base_url=served[1], timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as response:
            first = next(response.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "Hello"
    assert fake.closed_early.wait(5)
    assert not fake.finished.is_set()


def test_client_that_stops_reading_a_fast_stream_closes_the_router_generator(served, fake):
    # Far more events than the socket buffers hold: the server is blocked sending when the client goes away.
    fake.repeat = 1_000_000
    with httpx.Client(base_url=served[1], timeout=10) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as response:
            next(response.iter_lines())
            time.sleep(0.5)
    assert fake.closed_early.wait(5)
    assert not fake.finished.is_set()


def test_client_disconnect_before_the_first_token_closes_the_router_generator(served, fake):
    fake.pause_s = 30  # a prefill that never comes
    with httpx.Client(base_url=served[1], timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert fake.started.is_set()
    assert fake.closed_early.wait(5)
    assert not fake.finished.is_set()


def test_client_disconnect_during_a_whole_response_closes_the_router_generator(served, fake):
    fake.repeat, fake.pause_s = 100, 0.05
    with httpx.Client(base_url=served[1], timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert fake.started.is_set()
    assert fake.closed_early.wait(5)
    assert not fake.finished.is_set()


def test_event_stream_response_closes_its_events_however_it_ends():
    """Even when the server only learns of the hang-up by a failed send, and something still holds the events
    generator (so garbage collection would not close it), the response closes it."""
    closed = []

    async def events():
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            closed.append("closed")

    async def serve_until_the_connection_breaks():
        sent = []

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                raise OSError("connection reset by peer")

        async def receive():
            await asyncio.Event().wait()

        generator = events()
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}  # no disconnect listener: failed sends tell
        with pytest.raises(ClientDisconnect):
            await ServerSentEvents(generator)(scope, receive, send)
        assert closed == ["closed"]
        assert [message["type"] for message in sent] == ["http.response.start", "http.response.body",
                                                         "http.response.body"]

    asyncio.run(serve_until_the_connection_breaks())


# -------------------------------------------------------------------------------- models, health, metrics


def test_models_lists_the_served_model(client, http, fake):
    assert [(m.id, m.object, m.owned_by) for m in client.models.list()] == [(MODEL, "model", "splitserve")]
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert (body["data"][0]["max_model_len"], body["data"][0]["root"]) == (MAX_MODEL_LEN, MODEL)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_health_follows_router_readiness(http, fake):
    response = http.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    fake.is_ready = False
    response = http.get("/health")
    assert (response.status_code, response.json()) == (503, {"status": "no decode-capable pod is known"})


def test_pods_lists_what_the_router_routes_to(http, fake):
    response = http.get("/pods")
    assert (response.status_code, response.json()) == (
        200, {"pods": [{"address": "10.0.0.7:50060", "role": "decode", "healthy": True}]})
    fake.is_ready = False
    assert http.get("/pods").json()["pods"][0]["healthy"] is False


def test_metrics_are_the_prometheus_exposition(http, fake):
    fake.metrics.prompt_tokens.inc(5)
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST  # as the exposition says, unchanged
    assert 'splitserve_prompt_tokens_total{model_name="fake-model",role="router"} 5.0' in response.text


def test_tokenize_detokenize_and_version(http, fake):
    assert http.post("/tokenize", json={"prompt": "Hi!"}).json() == {
        "count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [7, 7, 7], "token_strs": None}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": False})
    assert chat.json()["count"] == len("<user>Hi<assistant>")
    assert fake.tokenized[-1] == ("<user>Hi<assistant>", False)
    assert http.post("/detokenize", json={"tokens": [1, 2, 3]}).json() == {"prompt": "Hello, world"}
    assert error_of(http.post("/detokenize", json={"tokens": [99]}))["param"] == "tokens"
    both = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}  # a chat, with a field it does not take
    assert error_of(http.post("/tokenize", json=both))["param"] == "prompt"
    assert error_of(http.post("/tokenize", content=b"[", headers={"content-type": "application/json"}))[
        "message"].startswith("the body is not valid JSON")
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]
