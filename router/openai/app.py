"""The router's OpenAI-compatible HTTP API: ``create_app(router)`` builds the FastAPI application.

A request's path:

    middleware (openai_middleware.py, outermost first): CORS (when cors_allowed_origins) -> API key (when
      api_keys; 401) -> body size (max_request_bytes; 413, before the body is parsed) -> X-Request-Id on every answer
    POST /v1/completions | /v1/chat/completions
      -> CompletionRequest / ChatCompletionRequest (openai_requests.py)  shape and types     -> 400, param named
         (chat's models: openai_chat_requests.py)
      -> the request id: X-Request-Id header or request_id field         validated           -> 400
      -> .sampling_params()                                               values and ranges   -> 400, param named
      -> chat only: router.apply_chat_template(messages, options)         the prompt text     -> StatusError
      -> router.make_request(prompt, params, id) per choice               limits, tokenized   -> StatusError
         (a choice per prompt and sample: prompts x n, each its own request, ``<id>-<index>`` when several)
      -> router.generate(request): OutputDelta..., then one Completion     routed to the pods  -> StatusError
         (several choices: side by side, their outputs merged as they come, each tagged with its index)
      -> stream: the first item is awaited before any byte is sent, so an error that comes before it
                 (429 full, 503 no pod, 504 deadline) is still an HTTP status; then one SSE event per
                 delta, a finish chunk, a usage chunk if stream_options.include_usage, and [DONE].
                 An error after that is an ``{"error": ...}`` event, then [DONE].
         or not: the deltas are joined into one response.

A client that hangs up stops its request: the generator of ``router.generate`` is closed (``aclose``), which
is how the router learns to cancel the pods' work. Streams notice through Starlette's disconnect listener;
a non-streamed request races the generation against the connection's ``http.disconnect`` message.

Every error is OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}`` (openai_errors.py), with
the HTTP status that ``StatusError.http_status`` gives its gRPC code; ``code`` is the gRPC code's name, lower case,
so that HTTP and gRPC clients read the same reason. Also served: ``GET /v1/models`` (with ``max_model_len``),
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes), ``GET /version``,
``GET /health`` (200 when a decode-capable pod is known, else 503), ``GET /pods`` (every pod the router knows:
role, whether it routes to it, its last load report) and ``GET /metrics`` (Prometheus). With API keys configured,
every path but ``auth_exempt_paths`` (``/health`` and ``/metrics`` by default) needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator
from contextlib import aclosing, contextmanager, suppress
from importlib import metadata
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware

from splitserve.router.api_keys import APIKeys
from splitserve.router.choices import MAX_CHOICES, make_choices, merged_outputs, too_many_choices
from splitserve.router.intake import RouterRequest, ServiceLevel, check_request_id
from splitserve.router.openai.chat_requests import ChatCompletionRequest, TokenizeChatRequest, tokenize_request
from splitserve.router.openai.errors import APIError, add_error_handlers, field_named_in, json_response, renamed
from splitserve.router.openai.format import ChatCompletionFormatter, TextCompletionFormatter, joined_responses
from splitserve.router.openai.middleware import (
    REQUEST_ID_HEADER,
    APIKeyAuth,
    BodySizeLimit,
    RequestIdHeader,
    UnexpectedErrorsAsJSON,
)
from splitserve.router.openai.requests import CompletionRequest, DetokenizeRequest, TokenizeCompletionRequest
from splitserve.router.openai.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from splitserve.router.openai.stream import Formatter, ServerSentEvents, raise_unless_finished, sse_events
from splitserve.router.openai.tool_calls import messages_for_template, template_knows_tools
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.router import Router
from splitserve.runtime.errors import StatusError

logger = logging.getLogger(__name__)

T = TypeVar("T")
RouterOutputs = AsyncGenerator[OutputDelta | Completion, None]
GenerationRequest = CompletionRequest | ChatCompletionRequest



def create_app(router: Router) -> FastAPI:
    """The HTTP API in front of ``router`` (its ``config`` sets the limits, API keys and CORS); serve it with
    uvicorn."""
    config = router.config
    app = FastAPI(title="splitserve router", summary="OpenAI-compatible API of a disaggregated LLM server",
                  version=package_version())
    api = OpenAIRoutes(router)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", api.tokenizer_info, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/pods", api.pods, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    add_error_handlers(app)
    # Added innermost first: a request meets CORS, the API key check, the body limit, then the request id.
    app.add_middleware(UnexpectedErrorsAsJSON)
    app.add_middleware(RequestIdHeader)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    if config.api_keys:
        app.add_middleware(APIKeyAuth, keys=APIKeys(config.api_keys), exempt_paths=config.auth_exempt_paths)
    if config.cors_allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_allowed_origins,
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
                           expose_headers=[REQUEST_ID_HEADER])
    return app


def package_version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


class OpenAIRoutes:
    """The endpoints, bound to one router."""

    def __init__(self, router: Router):
        self.router = router
        self.model_card = ModelCard(id=router.model_name, root=router.model_name, created=int(time.time()),
                                    max_model_len=router.config.max_model_len)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        return await self._generate(request, body, body.prompts, TextCompletionFormatter)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        return await self._generate(request, body, None, ChatCompletionFormatter)

    async def tokenize(self, request: Request) -> TokenizeResponse:
        data = await _json_body(request)
        body = _validated(tokenize_request(data), data)  # a prompt or a chat, told apart as vLLM does
        self._check_model(body.model)
        with _params_named_by(body):
            prompt = body.prompt if isinstance(body, TokenizeCompletionRequest) else await self._render_chat(body)
            tokens = await self.router.tokenize(prompt, body.add_special_tokens)
        token_strs = [self.router.tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.router.config.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        with _params_named_by(body):
            return DetokenizeResponse(prompt=await self.router.detokenize(body.tokens))

    async def tokenizer_info(self) -> TokenizerInfoResponse:
        tokenizer = self.router.tokenizer
        text = lambda token_id: None if token_id is None else tokenizer.id_to_token(token_id)  # noqa: E731
        return TokenizerInfoResponse(eos_token=text(next(iter(tokenizer.eos_token_ids), None)),
                                     bos_token=text(tokenizer.bos_token_id),
                                     model_max_length=self.router.config.max_model_len,
                                     chat_template=tokenizer.chat_template)

    async def version(self) -> VersionResponse:
        return VersionResponse(version=package_version())

    async def models(self) -> ModelList:
        return ModelList(data=[self.model_card])

    async def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self.model_card

    async def health(self) -> JSONResponse:
        if self.router.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no decode-capable pod is known"}, status_code=503)

    async def pods(self) -> JSONResponse:
        return JSONResponse({"pods": self.router.pods()})

    async def metrics(self) -> Response:
        exposition, content_type = self.router.metrics.exposition()
        return Response(exposition, media_type=content_type)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.router.model_name:
            raise APIError(grpc.StatusCode.NOT_FOUND,
                           f"the model {model!r} does not exist; this server serves {self.router.model_name!r}",
                           param="model")

    async def _render_chat(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        tools, messages = body.offered_tools(), body.chat_messages()
        template_kwargs = body.chat_template_kwargs
        if tools or any(message["role"] == "tool" or "tool_calls" in message for message in messages):
            knows_tools = template_knows_tools(self.router.tokenizer.chat_template)
            messages = messages_for_template(messages, tools, knows_tools)
            if tools and knows_tools:
                template_kwargs = {**(template_kwargs or {}), "tools": tools}
        return await self.router.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, template_kwargs=template_kwargs)

    async def _generate(self, request: Request, body: GenerationRequest, prompts: list[str | list[int]] | None,
                        formatter_class: type[Formatter]) -> Response:
        request_id = _request_id(request, body.request_id)
        with _params_named_by(body):
            params = body.sampling_params()  # the cheap checks before the chat template and the tokenizer
            num_prompts = 1 if prompts is None else len(prompts)
            samples = body.samples_per_prompt  # n, or best_of
            if num_prompts * samples > MAX_CHOICES:
                param = "prompt" if num_prompts > 1 else "n" if samples == params.n else "best_of"
                raise APIError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{param}: {too_many_choices(num_prompts, samples)}", param=param)
            if prompts is None:
                prompts = [await self._render_chat(body)]
            # best_of ranks its samples by their tokens' logprobs: the pods return them whether asked for or not.
            generated = params if samples == params.n else dataclasses.replace(
                params, n=samples, logprobs=params.logprobs or 0)
            service = ServiceLevel.checked(body.slo_ttft_s, body.slo_tpot_s, body.priority or 0,
                                           names=("slo_ttft_s", "slo_tpot_s", "priority"))
            router_requests = await make_choices(self.router, prompts, generated, request_id, body.add_special_tokens,
                                                 service=service)
        response_id = router_requests[0].request_id if len(router_requests) == 1 else request_id
        request.state.request_id = response_id  # the X-Request-Id of the answer
        prompt_of = [index // samples for index in range(len(router_requests))]  # each choice's prompt
        formatters = [formatter_class(response_id, self.router.model_name, self._token_text, params.logprobs,
                                      len(choice.prompt_token_ids), body.continuous_usage, index=index,
                                      **self._choice_options(body, choice))
                      for index, choice in enumerate(router_requests)]
        outputs = [self.router.generate(choice) for choice in router_requests]
        if body.stream:
            merged = merged_outputs(outputs)
            first = await _first_output(request, merged)
            return ServerSentEvents(sse_events(first, merged, formatters, prompt_of, body.include_usage))
        results = await _until_disconnected(request, _collect_all(outputs))
        for formatter, (_, completion) in zip(formatters, results):
            raise_unless_finished(completion, formatter.response_id)
        kept = _most_likely(results, samples, params.n)
        for index, kept_index in enumerate(kept):
            formatters[kept_index].index = index
        responses = [formatters[i].response(*results[i]) for i in kept]
        # The usage counts every sample generated, kept or not (as OpenAI bills best_of).
        return json_response(joined_responses(responses, [completion for _, completion in results], prompt_of))

    def _choice_options(self, body: GenerationRequest, choice: RouterRequest) -> dict[str, Any]:
        """A chat's tool call parser; a completion's prompt logprobs, and its echo: its prompt's text, as given or
        decoded from the ids, and its ids (for the prompt's logprobs)."""
        if isinstance(body, ChatCompletionRequest):
            return {"tool_parser": body.tool_parser()}
        if not body.echo:
            return {"prompt_logprobs": body.prompt_logprobs}
        echo = choice.prompt_text
        if echo is None:
            echo = self.router.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)
        return {"prompt_logprobs": body.prompt_logprobs, "echo": echo, "prompt_token_ids": choice.prompt_token_ids}

    def _token_text(self, token_id: int) -> str:
        # A token's own text, special tokens included: logprobs describe every token the model produced.
        return self.router.tokenizer.decode([token_id], skip_special_tokens=False)


def _request_id(request: Request, in_body: str | None) -> str | None:
    """The client's id for the request: the X-Request-Id header or vLLM's ``request_id`` field (None: the router
    makes one). Both given must agree."""
    header = request.headers.get(REQUEST_ID_HEADER)
    if header is not None:
        try:
            check_request_id(header, REQUEST_ID_HEADER)
        except StatusError as error:
            raise APIError(error.code, error.message) from None
        if in_body is not None and in_body != header:
            raise APIError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"request_id: {in_body!r} differs from the {REQUEST_ID_HEADER} header {header!r}",
                           param="request_id")
    return header if header is not None else in_body


@contextmanager
def _params_named_by(body: BaseModel) -> Iterator[None]:
    """Within it, a router error naming a field (``"prompt: ..."``) names it as ``body`` spells it (a chat's
    prompt is its ``messages``, its ``logprobs`` are ``top_logprobs``...)."""
    try:
        yield
    except APIError:
        raise
    except StatusError as error:
        param = field_named_in(error, body)
        if param is None:
            raise
        raise APIError(error.code, renamed(error.message, param), param) from None


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as error:  # not JSON, or not UTF-8
        raise APIError(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not valid JSON: {error}") from None


def _validated(model: type[T], data: Any) -> T:
    """``model`` from a request's JSON body; errors as FastAPI's own body validation reports them."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None


# ------------------------------------------------------------------------------------------- generation


async def _first_output(request: Request, outputs: AsyncGenerator[T, None]) -> T:
    """The first output, awaited before the response starts, so that an early error is still an HTTP status."""
    try:
        return await _until_disconnected(request, anext(outputs))
    except BaseException:
        await outputs.aclose()
        raise


async def _collect(outputs: RouterOutputs) -> tuple[list[OutputDelta], Completion]:
    async with aclosing(outputs):
        *deltas, completion = [output async for output in outputs]
    return deltas, completion


async def _collect_all(outputs: list[RouterOutputs]) -> list[tuple[list[OutputDelta], Completion]]:
    """Every choice's outputs, collected side by side; one failing (or the client leaving) stops them all."""
    tasks = [asyncio.ensure_future(_collect(choice)) for choice in outputs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client hangs up first: then ``work`` is cancelled (which closes the router's
    generator inside it) and the request ends as CANCELLED."""
    work_task = asyncio.ensure_future(work)
    hangup_task = asyncio.ensure_future(_hangup(request))
    try:
        await asyncio.wait((work_task, hangup_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with suppress(asyncio.CancelledError):
                await work_task  # let the router's generator finish its cleanup before we go on
    if work_task.cancelled():
        raise APIError(grpc.StatusCode.CANCELLED, "the client closed the connection")
    return work_task.result()


async def _hangup(request: Request) -> None:
    """Returns when the client closes the connection. The body is read by now, so the next message the
    server has for us is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _most_likely(results: list[tuple[list[OutputDelta], Completion]], samples: int, n: int) -> list[int]:
    """The indices of the choices to answer with: all of them, or with best_of (``samples`` > ``n``), each prompt's
    ``n`` samples whose tokens are the most likely together (cumulative logprob), the most likely first."""
    if samples == n:
        return list(range(len(results)))
    kept = []
    for first in range(0, len(results), samples):
        ranked = sorted(range(first, first + samples), key=lambda i: -_cumulative_logprob(results[i][0]))
        kept.extend(ranked[:n])
    return kept


def _cumulative_logprob(deltas: list[OutputDelta]) -> float:
    return sum(entry[token_id] for delta in deltas for token_id, entry in zip(delta.token_ids, delta.logprobs or []))
