"""One streaming request to a running router, timed at the client: ``HttpCompletions`` (OpenAI ``/v1/completions``
over SSE, with httpx) and ``GrpcGenerate`` (``splitserve.v1.Generation/Generate``, grpc.aio).

Both have the same shape, so the load generator does not care which it drives:

    payload = client.prepare(spec, prompt)    before the run: the request body, built once
    await client.send(record, payload, clock)  during it: fills the ``RequestRecord`` (send time, the arrival of
                                               every output-bearing chunk, the last byte, usage, or the failure)

The output length is forced (``max_tokens`` with ``ignore_eos``) and the usage the server reports is kept, so that
the run can check it got what it asked for. An output-bearing chunk is one with text (HTTP; a token whose text is
held back, a partial character, arrives in a later chunk, as a vLLM client sees it) or with token ids (gRPC: every
decode step). A request whose whole output has no text (HTTP) takes its first-token time from its finish chunk.

Failures are recorded by kind, never dropped: ``http_<status>_<code>`` for a refused request (``http_429_
resource_exhausted``), ``grpc_<CODE>`` for a gRPC status, ``stream_error_<code>`` for an error after output
started, ``finish_<reason>`` for a stream that ended aborted or failed, ``timeout`` for the client's own deadline,
and the exception's class name for anything else (``ConnectError``). A request cancelled because the run's time
limit ended is ``unfinished``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import grpc
import httpx

from splitserve.measure.serve_metrics import RequestRecord
from splitserve.measure.workload import RequestSpec
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

Clock = Callable[[], float]  # seconds since the run started
Prompt = list[int] | str


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str = ""):
        super().__init__(message or kind)
        self.kind = kind


class _StreamingClient:
    """What both protocols share: the deadline, and turning an outcome into the record's status."""

    def __init__(self, model: str | None, temperature: float, timeout_s: float):
        self.model = model
        self.temperature = temperature
        self.timeout_s = timeout_s

    async def send(self, record: RequestRecord, payload, clock: Clock) -> None:
        record.sent_s = clock()
        record.status = "sent"
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._stream(record, payload, clock)
            record.status = "ok"
        except asyncio.CancelledError:
            record.status = "unfinished"  # the run's time limit ended it
            raise
        except TimeoutError:
            _fail(record, "timeout", f"no answer within {self.timeout_s:g} s")
        except RequestFailed as failure:
            _fail(record, failure.kind, str(failure))
        except Exception as error:  # connection refused or reset, bad JSON...: named by its class
            _fail(record, type(error).__name__, str(error))
        finally:
            if record.end_s is None and record.status in ("ok", "failed"):
                record.end_s = clock()

    async def _stream(self, record: RequestRecord, payload, clock: Clock) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    record.status = "failed"
    record.error = kind
    record.error_message = message[:500]


class HttpCompletions(_StreamingClient):
    """``POST {base_url}/v1/completions`` with ``stream`` and ``stream_options.include_usage``."""

    def __init__(self, base_url: str, model: str | None = None, temperature: float = 0.0, timeout_s: float = 600.0):
        super().__init__(model, temperature, timeout_s)
        self.url = base_url.rstrip("/") + "/v1/completions"
        # No pool limit: concurrency is the load generator's to decide, not the connection pool's.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0))

    def prepare(self, spec: RequestSpec, prompt: Prompt) -> bytes:
        body = {"prompt": prompt, "max_tokens": spec.output_len, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.model:
            body["model"] = self.model
        return json.dumps(body).encode()

    async def _stream(self, record: RequestRecord, payload: bytes, clock: Clock) -> None:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        async with self.client.stream("POST", self.url, content=payload, headers=headers) as response:
            if response.status_code != 200:
                raise RequestFailed(*_http_error(response.status_code, await response.aread()))
            finish_reason, finished_at = None, None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # the blank line between events, or an SSE comment
                now = clock()
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    raise RequestFailed(f"stream_error_{error.get('code') or error.get('type')}",
                                        error.get("message", ""))
                if event.get("usage"):
                    record.prompt_tokens = event["usage"]["prompt_tokens"]
                    record.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        record.chunk_s.append(now)
                    if choice.get("finish_reason"):
                        finish_reason, finished_at = choice["finish_reason"], now
            record.end_s = clock()
        if finish_reason not in ("length", "stop"):
            raise RequestFailed(f"finish_{finish_reason}", "the stream ended without finishing the request")
        if not record.chunk_s and record.output_tokens:
            record.chunk_s.append(finished_at)

    async def close(self) -> None:
        await self.client.aclose()


def _http_error(status: int, body: bytes) -> tuple[str, str]:
    try:
        error = json.loads(body)["error"]
        return f"http_{status}_{error.get('code') or error.get('type')}", error.get("message", "")
    except (ValueError, KeyError, TypeError):
        return f"http_{status}", body[:200].decode(errors="replace")


class GrpcGenerate(_StreamingClient):
    """``splitserve.v1.Generation/Generate`` with ``token_ids`` (or ``text``) input, over one channel."""

    def __init__(self, address: str, model: str | None = None, temperature: float = 0.0, timeout_s: float = 600.0):
        super().__init__(model, temperature, timeout_s)
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                   ("grpc.max_send_message_length", 64 << 20)])
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def prepare(self, spec: RequestSpec, prompt: Prompt) -> generate_pb2.GenerateRequest:
        params = common_pb2.SamplingParams(temperature=self.temperature, max_tokens=spec.output_len, ignore_eos=True)
        request = generate_pb2.GenerateRequest(sampling_params=params, model=self.model or "")
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request

    async def _stream(self, record: RequestRecord, payload: generate_pb2.GenerateRequest, clock: Clock) -> None:
        call = self.stub.Generate(payload)
        complete = None
        try:
            async for response in call:
                now = clock()
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    if response.chunk.token_ids:
                        record.chunk_s.append(now)
                elif kind == "complete":
                    complete = response.complete
                else:
                    raise RequestFailed(f"stream_error_{_code_name(response.error.code)}", response.error.message)
        except grpc.aio.AioRpcError as error:
            raise RequestFailed(f"grpc_{error.code().name}", error.details() or "") from None
        except BaseException:
            call.cancel()
            raise
        record.end_s = clock()
        if complete is None:
            raise RequestFailed("grpc_no_complete", "the stream ended without a complete message")
        record.prompt_tokens = complete.usage.prompt_tokens
        record.output_tokens = complete.usage.completion_tokens
        if complete.finish_reason not in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
            reason = common_pb2.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_").lower()
            raise RequestFailed(f"finish_{reason}", "the request ended without finishing")

    async def close(self) -> None:
        await self.channel.close()


def _code_name(number: int) -> str:
    return next((code.name for code in grpc.StatusCode if code.value[0] == number), str(number))
