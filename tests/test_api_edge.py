"""The router's edge against a real router (gRPC and HTTP on loopback, the tiny-random tokenizer: one token per
byte) over fake pods: the configurable limits, each refused with 400 / INVALID_ARGUMENT naming the field; a big
prompt tokenized off the event loop while /health answers; the client's deadline; X-Request-Id and Abort; the
chat template's options; /tokenize, /detokenize, /version, /v1/models."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import openai
import pytest
from served_router import RouterInThread
from test_router_flow import LONG_PROMPT, MODEL, SCRIPT, TOKENIZER, eventually, run, running_cluster

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import tiny_random_tokenizer_data
from splitserve.router.config import RouterConfig
from splitserve.router.intake import encode_without_holding_the_gil
from splitserve.router.router import Router
from splitserve.runtime.errors import StatusError
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

LIMITS = dict(max_stop_strings=4, max_stop_string_bytes=8, max_stop_token_ids=2, max_tokens_limit=100,
              max_prompt_tokens=50, max_prompt_bytes=200, max_logprobs=3, max_request_bytes=4096)
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def limited():
    with RouterInThread(**LIMITS) as endpoints:
        yield endpoints


def error_of(response: httpx.Response) -> dict:
    assert set(response.json()) == {"error"}, response.text
    return response.json()["error"]


# --------------------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop",
     "stop: 5 stop strings, more than the limit of 4 (max_stop_strings)"),
    ("/v1/completions", {"stop": ["ok", "123456789"]}, "stop[1]",
     "stop[1]: 9 bytes, more than the limit of 8 bytes per stop string (max_stop_string_bytes)"),
    ("/v1/completions", {"stop": "ééééé"}, "stop[0]",
     "stop[0]: 10 bytes, more than the limit of 8 bytes per stop string (max_stop_string_bytes)"),
    ("/v1/completions", {"stop_token_ids": [1, 2, 3]}, "stop_token_ids",
     "stop_token_ids: 3 ids, more than the limit of 2 (max_stop_token_ids)"),
    ("/v1/completions", {"stop_token_ids": [2**40]}, "stop_token_ids",
     "stop_token_ids: token ids must be integers in [0, 259), got [1099511627776]"),
    ("/v1/completions", {"max_tokens": 101}, "max_tokens", "max_tokens: must be <= 100 (max_tokens_limit), got 101"),
    ("/v1/completions", {"max_tokens": 10**30}, "max_tokens", "max_tokens: must be <= 100 (max_tokens_limit), got"),
    ("/v1/completions", {"max_tokens": -5}, "max_tokens", "max_tokens must be >= 0 or None, got -5"),
    ("/v1/completions", {"logprobs": 4}, "logprobs", "logprobs: must be <= 3 (max_logprobs), got 4"),
    ("/v1/completions", {"prompt": "x" * 51}, "prompt",
     "prompt: 51 tokens, more than the limit of 50 (max_prompt_tokens)"),
    ("/v1/completions", {"prompt": list(range(60))}, "prompt",
     "prompt: 60 tokens, more than the limit of 50 (max_prompt_tokens)"),
    ("/v1/completions", {"prompt": "x" * 201}, "prompt", "prompt: more than the limit of 200 bytes (max_prompt_bytes)"),
    ("/v1/completions", {"prompt": "\U0001F600" * 51}, "prompt",
     "prompt: more than the limit of 200 bytes (max_prompt_bytes)"),  # 51 characters, 204 bytes
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt", "prompt: must not be empty"),
    ("/v1/completions", {"prompt": [300]}, "prompt", "prompt: token ids must be integers in [0, 259), got [300]"),
    ("/v1/completions", {"min_tokens": 10**6, "max_tokens": None}, "min_tokens",
     "min_tokens: must be <= max_tokens, which is 100 when unset"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature", "temperature must be >= 0 and finite, got nan"),
    ("/v1/completions", {"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("/v1/chat/completions", {"max_completion_tokens": 101}, "max_completion_tokens",
     "max_completion_tokens: must be <= 100 (max_tokens_limit), got 101"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs",
     "top_logprobs: must be <= 3 (max_logprobs), got 4"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 201}]}, "messages",
     "messages: 201 bytes of content, more than the limit of 200 bytes (max_prompt_bytes)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]}, "messages",
     "messages: 59 tokens, more than the limit of 50 (max_prompt_tokens)"),  # the rendered prompt's
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages",
     "chat_template_kwargs.messages: reserved; the server sets it"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "  "}], "add_generation_prompt": False,
                              "continue_final_message": True}, "messages",
     "messages: continue_final_message needs a final message with content"),
])
def test_limits_and_values_are_400_naming_the_field(limited, path, body, param, message):
    base = {"prompt": "Hi", "max_tokens": 4} if path == "/v1/completions" else {"messages": CHAT}
    response = httpx.post(f"{limited.http}{path}", content=json.dumps({**base, **body}),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_argument")
    assert error["message"].startswith(message)
    assert httpx.get(f"{limited.http}/health").status_code == 200


def test_a_body_over_max_request_bytes_is_413_before_it_is_parsed(limited):
    body = json.dumps({"prompt": "x" * 5000})
    response = httpx.post(f"{limited.http}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert error_of(response) == {"message": f"the request body ({len(body)} bytes) is larger than the limit of 4096 "
                                             "bytes (max_request_bytes)", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_argument"}

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(10):
            yield b" " * 1000

    response = httpx.post(f"{limited.http}/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert re.fullmatch(r"the request body \((at least )?\d+ bytes\) is larger than the limit of 4096 bytes "
                        r"\(max_request_bytes\)", error_of(response)["message"])
    assert httpx.get(f"{limited.http}/health").status_code == 200


def test_a_50_mb_prompt_is_refused_unread_and_the_router_stays_responsive(limited):
    """The fault probe's 50 MB prompt: refused from its Content-Length, before a byte of it is read."""
    host, port = limited.http.removeprefix("http://").split(":")
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 50000000\r\n\r\n" + b'{"prompt": "' + b"x" * 65536)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert time.perf_counter() - start < 2.0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["message"] == ("the request body (50000000 bytes) is larger than the limit of "
                                                    "4096 bytes (max_request_bytes)")
    assert httpx.get(f"{limited.http}/health").status_code == 200


@pytest.mark.parametrize("body, param, message", [
    (b'{"prompt": "\xff\xfe"}', None, "the body is not valid UTF-8: 'utf-8' codec can't decode byte 0xff"),
    (b'{"prompt": "a\\ud800b"}', "prompt", "prompt: not valid Unicode (a lone surrogate at character 1)"),
    (b'{"prompt": "Hi", "stop": ["\\udfff"]}', "stop[0]", "stop[0]: not valid Unicode"),
    (b'{"prompt": "Hi"', None, "JSON decode error"),
    (b'[1, 2]', None, "Input should be a valid dictionary"),
])
def test_bodies_that_are_not_valid_unicode_or_json_are_400(limited, body, param, message):
    response = httpx.post(f"{limited.http}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and message in error["message"], error


def grpc_call(endpoints, metadata=None, timeout=10, **fields):
    with grpc.insecure_channel(endpoints.grpc) as channel:
        request = generate_pb2.GenerateRequest(**fields)
        return list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout, metadata=metadata))


@pytest.mark.parametrize("fields, message", [
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(stop=["a", "b", "c", "d", "e"])},
     "sampling_params.stop: 5 stop strings, more than the limit of 4 (max_stop_strings)"),
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(stop=["123456789"])},
     "sampling_params.stop[0]: 9 bytes, more than the limit of 8 bytes"),
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(max_tokens=101)},
     "sampling_params.max_tokens: must be <= 100 (max_tokens_limit), got 101"),
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(max_tokens=-1)},
     "sampling_params.max_tokens must be >= 0 or None, got -1"),
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(logprobs=4)},
     "sampling_params.logprobs: must be <= 3 (max_logprobs), got 4"),
    ({"text": "Hi", "sampling_params": common_pb2.SamplingParams(temperature=float("nan"))},
     "sampling_params.temperature must be >= 0 and finite, got nan"),
    ({"text": "x" * 201}, "text: more than the limit of 200 bytes (max_prompt_bytes)"),
    ({"text": "x" * 51}, "text: 51 tokens, more than the limit of 50 (max_prompt_tokens)"),
    ({"text": ""}, "text: must not be empty"),
    ({"token_ids": generate_pb2.TokenIds(ids=[-1])}, "token_ids.ids: token ids must be integers in [0, 259)"),
    ({"token_ids": generate_pb2.TokenIds(ids=[1]), "add_special_tokens": True},
     "add_special_tokens: applies to text or chat input, not token_ids"),
    ({"chat": generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="x" * 40)])},
     "chat.messages: 59 tokens, more than the limit of 50 (max_prompt_tokens)"),
    ({"chat": generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="Hi")],
                                continue_final_message=True)},
     "chat.continue_final_message: cannot be combined with add_generation_prompt"),
    ({"text": "Hi", "request_id": "has space"}, "request_id: must be 1 to 128 printable ASCII characters"),
    ({}, "input: set text, token_ids or chat"),
])
def test_grpc_limits_and_values_are_invalid_argument_naming_the_proto_field(limited, fields, message):
    with pytest.raises(grpc.RpcError) as refused:
        grpc_call(limited, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(message), refused.value.details()


def test_grpc_messages_that_do_not_parse_or_are_too_big(limited):
    with grpc.insecure_channel(limited.grpc) as channel:
        raw = channel.unary_stream("/splitserve.v1.Generation/Generate")
        for data, why in ((bytes([0x12, 2, 0xFF, 0xFE]), "String field had bad UTF-8"),
                          (b"\xff\xff\xff", "Wire format was corrupt")):
            with pytest.raises(grpc.RpcError) as refused:
                list(raw(data, timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == f"request: not a valid splitserve.v1.GenerateRequest: Error parsing " \
                                              f"message with type 'splitserve.v1.GenerateRequest': {why}"
    with pytest.raises(grpc.RpcError) as refused:  # over max_request_bytes: refused by gRPC before any handler
        grpc_call(limited, text="x" * 5000)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_call(limited, text=LONG_PROMPT[:20], sampling_params=common_pb2.SamplingParams(max_tokens=2))


def test_huge_top_k_is_no_filter_rather_than_a_crash(limited):
    response = httpx.post(f"{limited.http}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": 10**12})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------- tokenizing off the event loop


# Polls /health from another process (its own GIL) until stdin closes; says "polling" once the first answer came,
# and at the end prints the answers' latencies.
HEALTH_POLLER = """
import json, sys, threading, time, httpx
latencies, done = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=30) as http:
    while not done.is_set():
        start = time.perf_counter()
        assert http.get(sys.argv[1]).status_code == 200
        latencies.append(time.perf_counter() - start)
        if len(latencies) == 1:
            print("polling", flush=True)
        time.sleep(0.01)
print(json.dumps(latencies))
"""


def test_health_answers_while_a_prompt_at_the_byte_limit_tokenizes():
    """The tiny tokenizer takes about two seconds over 1 MiB (one token per byte; half a second over 256 KiB on a
    quiet machine, too short to mean something). Meanwhile /health, asked
    by another process, must answer as usual: the prompt tokenizes on a worker thread, with the GIL released."""
    size = 1 << 20
    with RouterInThread(max_prompt_bytes=size, max_request_bytes=2 * size) as router:
        poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, f"{router.http}/health"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert poller.stdout.readline() == "polling\n"  # its first /health answered: it is up and polling
            start = time.perf_counter()
            response = httpx.post(f"{router.http}/v1/completions", json={"prompt": "a b " * (size // 4)}, timeout=120)
            tokenizing = time.perf_counter() - start
            latencies = json.loads(poller.communicate("", timeout=60)[0])
        finally:
            poller.kill()
        assert response.status_code == 400  # 1 Mi tokens: over the context, found once tokenized
        assert error_of(response)["message"].startswith(f"prompt: {size} tokens leave no room for output")
        print(f"tokenizing {size} bytes took {tokenizing:.2f} s; /health answered {len(latencies)} times, "
              f"slowest {max(latencies) * 1e3:.0f} ms")
        assert tokenizing > 0.5  # long enough for the check below to mean something
        assert max(latencies) < min(0.5, tokenizing / 3)


def test_the_gil_free_encoder_gives_the_same_ids():
    wrapped = Tokenizer.from_gguf(tiny_random_tokenizer_data())
    encode_without_holding_the_gil(wrapped)
    encode_without_holding_the_gil(wrapped)  # wrapping twice is wrapping once
    for text in ("", "Hi", "<|im_start|>user\nhé 😀<|im_end|>", LONG_PROMPT):
        for special in (True, False):
            assert wrapped.encode(text, special) == TOKENIZER.encode(text, special)
    assert wrapped.decode(TOKENIZER.encode("héllo")) == "héllo"


# ------------------------------------------------------------------------- deadline, request id, abort


def test_the_grpc_clients_deadline_bounds_the_request():
    async def scenario():
        async with running_cluster(num_prefill=0) as env:
            env.decode[0].token_delay_s = 5.0  # the pod would take minutes
            req = await env.router.make_request(SHORT_PROMPT_IDS, SamplingParams(max_tokens=3), timeout_s=0.5)
            assert req.timeout_s == 0.5
            start = time.monotonic()
            with pytest.raises(StatusError) as caught:
                [item async for item in env.router.generate(req)]
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 2.0
            assert caught.value.message.startswith(f"request {req.request_id} passed its 0.5 s deadline")
            longer = await env.router.make_request(SHORT_PROMPT_IDS, SamplingParams(), timeout_s=10**6)
            assert longer.timeout_s == env.router.config.request_timeout_s  # never longer than the router's
    run(scenario())


SHORT_PROMPT_IDS = TOKENIZER.encode("Hi")


def test_grpc_deadline_over_the_wire():
    with RouterInThread(num_prefill=0) as router:
        router.call(setattr, router.env.decode[0], "token_delay_s", 5.0)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            grpc_call(router, timeout=0.5, text="Hi")
        assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 2.0
        decode_pod = router.env.decode[0]
        router.call(eventually, lambda: len(decode_pod.cancelled) == 1)  # the pod's work was cancelled


def test_x_request_id_is_the_request_id_echoed_and_abortable_over_grpc():
    with RouterInThread() as router:
        router.call(setattr, router.env.decode[0], "token_delay_s", 0.2)
        events, ended = [], threading.Event()

        def stream():
            with httpx.stream("POST", f"{router.http}/v1/chat/completions", timeout=30,
                              headers={"X-Request-Id": "client-7:a/b"},
                              json={"messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}) as reply:
                events.append(reply.headers["x-request-id"])
                events.extend(line for line in reply.iter_lines() if line)
            ended.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        router.call(eventually, lambda: len(events) >= 3, 10.0)
        with grpc.insecure_channel(router.grpc) as channel:
            found = generate_pb2_grpc.GenerationStub(channel).Abort(common_pb2.AbortRequest(request_id="client-7:a/b"))
        assert found.found
        assert ended.wait(10)
        streamer.join()
        assert events[0] == "client-7:a/b"
        assert json.loads(events[1].removeprefix("data: "))["id"] == "chatcmpl-client-7:a/b"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "cancelled"

        plain = httpx.post(f"{router.http}/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2})
        generated = plain.headers["x-request-id"]
        assert len(generated) == 32 and plain.json()["id"] == f"cmpl-{generated}"
        in_body = httpx.post(f"{router.http}/v1/completions",
                             json={"prompt": LONG_PROMPT, "max_tokens": 2, "request_id": "from-body"})
        assert in_body.headers["x-request-id"] == "from-body" and in_body.json()["id"] == "cmpl-from-body"
        for header in ("has space", "x" * 129, "é"):
            bad = httpx.post(f"{router.http}/v1/completions", json={"prompt": "Hi"},
                             headers={"X-Request-Id": header.encode("utf-8")})
            assert bad.status_code == 400
            assert error_of(bad)["message"].startswith("X-Request-Id: must be 1 to 128 printable ASCII")
            assert "x-request-id" not in bad.headers
        clash = httpx.post(f"{router.http}/v1/completions", headers={"X-Request-Id": "one"},
                           json={"prompt": "Hi", "request_id": "two"})
        assert error_of(clash) == {"message": "request_id: 'two' differs from the X-Request-Id header 'one'",
                                   "type": "invalid_request_error", "param": "request_id", "code": "invalid_argument"}
        assert clash.headers["x-request-id"] == "one"


# ----------------------------------------------------------------------- chat options, tokenize, models


def test_chat_template_options_shape_the_prompt():
    with RouterInThread() as router:
        tokenize = lambda **body: httpx.post(f"{router.http}/tokenize", json=body).json()  # noqa: E731
        detokenize = lambda tokens: httpx.post(f"{router.http}/detokenize", json={"tokens": tokens}).json()  # noqa
        conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]
        continued = tokenize(messages=conversation, add_generation_prompt=False, continue_final_message=True)
        prompt = detokenize(continued["tokens"])["prompt"]
        assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is"
        opened = detokenize(tokenize(messages=CHAT)["tokens"])["prompt"]
        assert opened == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        closed = detokenize(tokenize(messages=CHAT, add_generation_prompt=False)["tokens"])["prompt"]
        assert closed == "<|im_start|>user\nHi<|im_end|>\n"
        with openai.OpenAI(base_url=f"{router.http}/v1", api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=3,
                                                  extra_body={"add_generation_prompt": False,
                                                              "continue_final_message": True})
            assert chat.usage.prompt_tokens == continued["count"]
            # the template ignores variables it does not use; those it uses arrive (see test_router_flow)
            chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert chat.choices[0].message.content == "".join(TOKENIZER.decode([t]) for t in SCRIPT[:2])


def test_tokenize_detokenize_version_and_models():
    with RouterInThread() as router:
        tokens = httpx.post(f"{router.http}/tokenize", json={"prompt": "Hi é", "return_token_strs": True}).json()
        assert tokens == {"count": 5, "max_model_len": 2048, "tokens": TOKENIZER.encode("Hi é"),
                          "token_strs": [TOKENIZER.id_to_token(t) for t in TOKENIZER.encode("Hi é")]}
        chat = httpx.post(f"{router.http}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
        assert chat["tokens"] == TOKENIZER.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        assert "token_strs" not in chat or chat["token_strs"] is None
        assert httpx.post(f"{router.http}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hi é"}
        for path, body, param in (("/tokenize", {"prompt": "Hi", "add_generation_prompt": True},
                                   "add_generation_prompt"),
                                  ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]},
                                   "tools[0].function"),
                                  ("/detokenize", {"tokens": [300]}, "tokens"),
                                  ("/detokenize", {"tokens": "Hi"}, "tokens"),
                                  ("/tokenize", {"prompt": "Hi", "model": "gpt-4"}, "model")):
            refused = httpx.post(f"{router.http}{path}", json=body)
            assert refused.status_code in (400, 404) and error_of(refused)["param"] == param, refused.text
        version = httpx.get(f"{router.http}/version").json()
        assert version["version"] and set(version) == {"version"}
        models = httpx.get(f"{router.http}/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [(MODEL, MODEL, 2048)]


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused():
    template = ("{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if m.name %} ({{ m.name }}){% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    tokenizer = Tokenizer.from_gguf(dataclasses.replace(tiny_random_tokenizer_data(), chat_template=template))
    router = Router(RouterConfig(model=MODEL, max_model_len=2048, decode_pods=["127.0.0.1:1"]), tokenizer=tokenizer)

    async def scenario():
        messages = [{"role": "user", "content": "Hi", "name": "ann"}]
        assert await router.apply_chat_template(messages, template_kwargs={"greeting": "Hello"}) == \
            "Hello user: Hi (ann)\nassistant:"
        assert await router.apply_chat_template(messages, add_generation_prompt=False) == "user: Hi (ann)\n"
        for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
            with pytest.raises(StatusError, match=f"^chat_template_kwargs.{reserved}: reserved"):
                await router.apply_chat_template(messages, template_kwargs={reserved: 1})
        with pytest.raises(StatusError, match="^continue_final_message: cannot be combined"):
            await router.apply_chat_template(messages, continue_final_message=True)
        continued = await router.apply_chat_template(
            [*messages, {"role": "assistant", "content": "Once upon "}], add_generation_prompt=False,
            continue_final_message=True)
        assert continued == "user: Hi (ann)\nassistant: Once upon"
    try:
        run(scenario())
    finally:
        run(router.stop())
