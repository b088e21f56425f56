"""The client-facing gRPC API: ``splitserve.v1.Generation`` served over ``Router``.

``Generate``: GenerateRequest -> ``Router.make_request`` (model name, input, sampling parameters checked)
-> ``Router.generate`` -> one ``chunk`` per ``OutputDelta`` -> one ``complete`` (or, for a request that failed
after output started, one ``error``) -> status OK. A request refused before any output (``StatusError``) ends
the call with that status code and no message. Cancelling the call (client gone, deadline passed) closes the
router's stream, which cancels the pod calls.

``Abort``: ``Router.abort``; the aborted request's own stream ends with ``complete`` (finish reason ABORT).
"""

from __future__ import annotations

import math
from contextlib import aclosing

import grpc

from protos.convert import finish_reason_to_proto, sampling_params_from_proto, token_logprob_from_dict
from protos.splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from router.router import Completion, OutputDelta, Router, RouterRequest
from runtime.errors import StatusError

CHAT_ROLES = ("system", "user", "assistant")


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self._router = router

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = self._router_request(request)
            async with aclosing(self._router.generate(req)) as outputs:
                async for output in outputs:
                    yield self._response(req, output)
        except StatusError as error:  # only ever before the first output: the router's contract
            pushback = () if error.retry_after_s is None else (
                ("grpc-retry-pushback-ms", str(math.ceil(error.retry_after_s * 1000))),)
            await context.abort(error.code, error.message, trailing_metadata=pushback)

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        return common_pb2.AbortResponse(found=await self._router.abort(request.request_id))

    def _router_request(self, request: generate_pb2.GenerateRequest) -> RouterRequest:
        if request.model and request.model != self._router.model_name:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                              f"model: {request.model!r} is not served here (this router serves "
                              f"{self._router.model_name!r})")
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as exc:  # SamplingParams names the field first
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params.{exc}") from None
        return self._router.make_request(self._prompt(request), params, request.request_id or None)

    def _prompt(self, request: generate_pb2.GenerateRequest) -> str | list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "input: set text, token_ids or chat")
        if which == "text":
            return request.text
        if which == "token_ids":
            return list(request.token_ids.ids)
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "chat.messages: at least one message is required")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"chat.messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
        return self._router.apply_chat_template(messages)

    def _response(self, req: RouterRequest, output: OutputDelta | Completion) -> generate_pb2.GenerateResponse:
        if isinstance(output, OutputDelta):
            return generate_pb2.GenerateResponse(request_id=req.request_id, chunk=self._chunk(req, output))
        if output.finish_reason == "error":
            error = output.error
            return generate_pb2.GenerateResponse(request_id=req.request_id, error=generate_pb2.Error(
                code=error.code.value[0], message=error.message))
        return generate_pb2.GenerateResponse(request_id=req.request_id, complete=_complete(output))

    def _chunk(self, req: RouterRequest, delta: OutputDelta) -> generate_pb2.Chunk:
        chunk = generate_pb2.Chunk(token_ids=delta.token_ids, text=delta.text)
        if delta.logprobs is not None:
            num_top = req.params.logprobs
            chunk.logprobs.tokens.extend(token_logprob_from_dict(token_id, entry, num_top)
                                         for token_id, entry in zip(delta.token_ids, delta.logprobs))
        return chunk


def _complete(completion: Completion) -> generate_pb2.Complete:
    complete = generate_pb2.Complete(
        finish_reason=finish_reason_to_proto(completion.finish_reason),
        usage=common_pb2.Usage(prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
                               cached_tokens=completion.cached_tokens),
        timings=common_pb2.Timings(**{f"{name}_seconds": seconds for name, seconds in completion.timings.items()}),
    )
    if isinstance(completion.stop_reason, str):
        complete.stop_str = completion.stop_reason
    elif completion.stop_reason is not None:
        complete.stop_token_id = completion.stop_reason
    return complete
