"""The client-facing gRPC API: ``splitserve.v1.Generation`` served over ``Router``.

``Generate``: GenerateRequest -> checks here (a message that does not parse, the model name, the input, the
sampling parameters) -> ``Router.make_request`` (the server's limits, tokenized off the event loop; the call's
deadline, when the client set one, becomes the request's) -> ``Router.generate`` -> one ``chunk`` per
``OutputDelta`` (the first with the prompt's logprobs, when asked) -> one ``complete`` (or, for a request that
failed after output started, one ``error``) -> status OK. A request refused before any output (``StatusError``)
ends the call with that status code and no message; an INVALID_ARGUMENT names the field as the proto spells it
(``sampling_params.stop[3]: ...``). Cancelling the call (client gone, deadline passed) closes the router's stream,
which cancels the pod calls.

``Abort``: ``Router.abort``; the aborted request's own stream ends with ``complete`` (finish reason ABORT). It
takes any request id, the X-Request-Id of an HTTP request included.

``add_generation_service(servicer, server)`` registers the service with parsers that turn a message that does not
parse (bad UTF-8 in a string, a corrupt wire format) into INVALID_ARGUMENT rather than gRPC's UNKNOWN;
``APIKeyInterceptor`` refuses ``Generation`` calls without a valid ``authorization: Bearer <key>`` metadata entry
(UNAUTHENTICATED) when the router has API keys; health and reflection stay open.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from splitserve.protos.convert import (
    finish_reason_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
    token_logprob_from_dict,
)
from splitserve.router.api_keys import APIKeys
from splitserve.router.choices import MAX_CHOICES, make_choices, merged_outputs, too_many_choices
from splitserve.router.intake import RouterRequest, ServiceLevel
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.router import Router
from splitserve.runtime.errors import StatusError
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

CHAT_ROLES = ("system", "user", "assistant")
GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Fields the router names in its errors that live inside GenerateRequest.sampling_params.
_SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
# The router's names for the chat's fields, as GenerateRequest spells them.
_CHAT_FIELDS = {"messages": "chat.messages", "chat_template_kwargs": "chat.chat_template_kwargs",
                "continue_final_message": "chat.continue_final_message"}


TARGET_FIELDS = ("slo_ttft_seconds", "slo_tpot_seconds")  # GenerateRequest's own latency targets


class MalformedRequest:
    """What a request message that does not parse becomes, so that the servicer can answer INVALID_ARGUMENT."""

    def __init__(self, why: str):
        self.why = why


def add_generation_service(servicer: "GenerationServicer", server: grpc.aio.Server) -> None:
    """``Generation`` on ``server``, like the generated ``add_GenerationServicer_to_server`` but with lenient
    parsers (see the module docstring)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(generate_pb2.GenerateRequest),
            response_serializer=generate_pb2.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=_lenient(common_pb2.AbortRequest),
            response_serializer=common_pb2.AbortResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))


def _lenient(message_class: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    def parse(data: bytes) -> Message | MalformedRequest:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return MalformedRequest(f"not a valid {message_class.DESCRIPTOR.full_name}: {exc}")
    return parse


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self._router = router

    async def Generate(self, request: generate_pb2.GenerateRequest | MalformedRequest,
                       context: grpc.aio.ServicerContext):
        try:
            choices = await self._router_requests(request, context)
            if len(choices) == 1:
                async with aclosing(self._router.generate(choices[0])) as outputs:
                    async for output in outputs:
                        yield self._response(choices[0], output)
                return
            request_id = choices[0].request_id.rpartition("-")[0]  # the samples' ids are <id>-<index>
            async with aclosing(merged_outputs([self._router.generate(choice) for choice in choices])) as merged:
                async for index, output in merged:
                    yield self._response(choices[index], output, index, request_id)
        except StatusError as error:  # before the first output (n > 1: before a sample's first output)
            pushback = () if error.retry_after_s is None else (
                ("grpc-retry-pushback-ms", str(math.ceil(error.retry_after_s * 1000))),)
            await context.abort(error.code, error.message, trailing_metadata=pushback)

    async def Abort(self, request: common_pb2.AbortRequest | MalformedRequest, context: grpc.aio.ServicerContext):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.why}")
        return common_pb2.AbortResponse(found=await self._router.abort(request.request_id))

    async def _router_requests(self, request: generate_pb2.GenerateRequest | MalformedRequest,
                               context: grpc.aio.ServicerContext) -> list[RouterRequest]:
        if isinstance(request, MalformedRequest):
            raise _invalid(f"request: {request.why}")
        if request.model and request.model != self._router.model_name:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                              f"model: {request.model!r} is not served here (this router serves "
                              f"{self._router.model_name!r})")
        try:
            params = sampling_params_from_proto(request.sampling_params)
        except ValueError as exc:  # SamplingParams names the field first
            raise _invalid(f"sampling_params.{exc}") from None
        if params.n > MAX_CHOICES:
            raise _invalid(f"sampling_params.n: {too_many_choices(1, params.n)}")
        which = request.WhichOneof("input")
        service = ServiceLevel.checked(*(getattr(request, name) if request.HasField(name) else None
                                         for name in TARGET_FIELDS), request.priority,
                                       names=(*TARGET_FIELDS, "priority"))
        try:
            prompt = await self._prompt(request)
            # The client's deadline (None without one) bounds the request, as its own timeout would.
            return await make_choices(self._router, [prompt], params, request.request_id or None,
                                      self._add_special_tokens(request), timeout_s=context.time_remaining(),
                                      service=service)
        except StatusError as error:
            raise _named_as_in_the_proto(error, which) from None

    @staticmethod
    def _add_special_tokens(request: generate_pb2.GenerateRequest) -> bool:
        which = request.WhichOneof("input")
        if not request.HasField("add_special_tokens"):
            return which == "text"  # as the HTTP API: yes for text, no for a chat (its template writes them)
        if which == "token_ids":
            raise _invalid("add_special_tokens: applies to text or chat input, not token_ids")
        return request.add_special_tokens

    async def _prompt(self, request: generate_pb2.GenerateRequest) -> str | list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise _invalid("input: set text, token_ids or chat")
        if which == "text":
            return request.text
        if which == "token_ids":
            return list(request.token_ids.ids)
        chat = request.chat
        if not chat.messages:
            raise _invalid("chat.messages: at least one message is required")
        messages = []
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise _invalid(f"chat.messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
            messages.append({"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})})
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return await self._router.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=chat.continue_final_message,
            template_kwargs=_whole_numbers_as_ints(json_format.MessageToDict(chat.chat_template_kwargs)))

    def _response(self, req: RouterRequest, output: OutputDelta | Completion, index: int = 0,
                  request_id: str | None = None) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=request_id or req.request_id, index=index)
        if isinstance(output, OutputDelta):
            response.chunk.CopyFrom(self._chunk(req, output))
        elif output.finish_reason == "error":
            response.error.CopyFrom(generate_pb2.Error(code=output.error.code.value[0], message=output.error.message))
        else:
            response.complete.CopyFrom(_complete(output))
        return response

    def _chunk(self, req: RouterRequest, delta: OutputDelta) -> generate_pb2.Chunk:
        chunk = generate_pb2.Chunk(token_ids=delta.token_ids, text=delta.text)
        if delta.logprobs is not None:
            num_top = req.params.logprobs
            chunk.logprobs.tokens.extend(token_logprob_from_dict(token_id, entry, num_top)
                                         for token_id, entry in zip(delta.token_ids, delta.logprobs))
        if delta.prompt_logprobs is not None:
            chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(delta.prompt_logprobs))
        return chunk


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses ``Generation`` calls whose ``authorization`` metadata holds no valid API key (UNAUTHENTICATED);
    other services (health, reflection) pass."""

    def __init__(self, keys: APIKeys):
        self._keys = keys

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{GENERATION_SERVICE}/"):
            return handler
        metadata = {key: value for key, value in details.invocation_metadata or ()}
        problem = self._keys.problem(metadata.get("authorization"))
        return handler if problem is None else _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        yield  # never reached: makes this a server-streaming handler

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


def _named_as_in_the_proto(error: StatusError, which_input: str | None) -> StatusError:
    """The router names fields as SamplingParams and the HTTP API do ("stop[3]: ..."); the proto nests them
    ("sampling_params.stop[3]: ...")."""
    named = re.match(r"([A-Za-z_]+)([\[.:])", error.message)
    if error.code != grpc.StatusCode.INVALID_ARGUMENT or named is None:
        return error
    field = named[1]
    if field in _SAMPLING_FIELDS:
        renamed = f"sampling_params.{field}"
    elif field == "prompt":
        renamed = {"text": "text", "token_ids": "token_ids.ids", "chat": "chat.messages"}.get(which_input, field)
    else:
        renamed = _CHAT_FIELDS.get(field, field)
    return StatusError(error.code, renamed + error.message[len(field):])


def _whole_numbers_as_ints(value: Any) -> Any:
    """A protobuf Struct holds every number as a double: 3 arrives as 3.0. Templates expect 3."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_numbers_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_numbers_as_ints(item) for key, item in value.items()}
    return value


def _invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


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
