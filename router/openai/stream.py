"""The OpenAI API's streamed answers: the ``text/event-stream`` response (``ServerSentEvents``) and its body
(``sse_events``: opening chunks, a chunk per delta, each choice's finish, the usage chunk, ``[DONE]``), and what
ends a choice as an error rather than an answer (``raise_unless_finished``), which the whole answers share.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from splitserve.router.openai.errors import APIError, error_response
from splitserve.router.openai.format import ChatCompletionFormatter, TextCompletionFormatter, joined_usage
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.runtime.errors import StatusError

logger = logging.getLogger(__name__)

Formatter = TextCompletionFormatter | ChatCompletionFormatter
_DONE_EVENT = "data: [DONE]\n\n"


def raise_unless_finished(completion: Completion, response_id: str) -> None:
    """"stop" and "length" are answers; "abort" and "error", which OpenAI's API has no words for, are errors."""
    if completion.finish_reason == "abort":
        raise APIError(grpc.StatusCode.CANCELLED, f"request {response_id} was aborted before it finished")
    if completion.finish_reason == "error":
        raise completion.error or APIError(grpc.StatusCode.INTERNAL, f"request {response_id} failed on the pods")


class ServerSentEvents(StreamingResponse):
    """A ``text/event-stream`` response that closes its event generator however the response ends (finished,
    client gone, server stopping). That closes the router's generator, which cancels the pods' work."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        # Neither caches nor proxies (nginx) may hold events back: each must reach the client when produced.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


async def sse_events(first: tuple[int, OutputDelta | Completion], merged: AsyncGenerator, formatters: list[Formatter],
                     prompt_of: list[int], include_usage: bool) -> AsyncGenerator[str, None]:
    """The SSE body: opening chunks, one chunk per delta, each choice's finish chunk, the usage chunk, then [DONE];
    an error on the way becomes an ``{"error": ...}`` event before [DONE]."""
    async with aclosing(merged):
        try:
            for formatter in formatters:
                for chunk in formatter.opening_chunks():
                    yield _event(chunk)
            completions: list[tuple[int, Completion]] = []  # (choice index, its completion), as they end
            item: tuple[int, OutputDelta | Completion] | None = first
            while item is not None:
                index, output = item
                formatter = formatters[index]
                if isinstance(output, OutputDelta):
                    chunk = formatter.delta_chunk(output)
                    if chunk is not None:
                        yield _event(chunk)
                else:
                    raise_unless_finished(output, formatter.response_id)
                    for chunk in formatter.finish_chunks(output):
                        yield _event(chunk)
                    completions.append((index, output))
                item = await anext(merged, None)
            if include_usage:
                completions.sort(key=lambda pair: pair[0])
                usage = joined_usage([completion for _, completion in completions], prompt_of)
                yield _event(formatters[0].usage_chunk(usage))
        except Exception as error:  # the status line is gone: the error can only be an event now
            if not isinstance(error, StatusError):
                logger.exception("stream of %s failed", formatters[0].response_id)
            yield _event(error_response(error))
    yield _DONE_EVENT


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"
