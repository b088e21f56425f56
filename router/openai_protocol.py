"""The OpenAI wire format of the router's HTTP API: request bodies in, responses and stream chunks out.

A request's path through this module:

    JSON body -> CompletionRequest / ChatCompletionRequest   (pydantic: shapes and types, strictly)
              -> .sampling_params()                          (SamplingParams: values and ranges)
    router outputs (OutputDelta..., Completion)
              -> TextCompletionFormatter / ChatCompletionFormatter
              -> CompletionResponse / ChatCompletionResponse, or their stream chunks

Types are strict, as in OpenAI's API: ``"0.5"`` is not a number and ``1.0`` is not an integer. Fields this
server does not know are ignored, because OpenAI clients and the SDKs wrapping them send extras of their own;
fields it knows but cannot honour (``echo``, ``logit_bias``, ``tools``...) are rejected when set, rather than
silently changing the answer. Value ranges are checked once, by ``SamplingParams``, whose error names the
field; ``sampling_params()`` re-raises it as ``InvalidParameter`` naming the field as the client spelled it.

Besides OpenAI's fields, both endpoints take vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``), and choices carry vLLM's ``stop_reason`` (the stop string or token id).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import SamplingParams
from router.router import Completion, OutputDelta

# OpenAI's legacy completions API allows at most 5 alternatives per token; chat allows 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20

# Request fields passed to SamplingParams under the same name, when the client set them.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output",
)


class InvalidParameter(ValueError):
    """A request field has a value this server refuses; ``param`` names the field as the client spelled it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def _unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", "{field} is not supported: {why}", {"field": field, "why": why})


# ---------------------------------------------------------------------------------------------- requests


class _StrictModel(BaseModel):
    """Strict types; unknown fields ignored (see above)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictModel):
    include_usage: bool = False


class _GenerationRequest(_StrictModel):
    """The fields both endpoints share: everything that becomes a ``SamplingParams``, plus streaming."""

    model: str | None = None  # optional, as in vLLM; when given it must name the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted for compatibility; the router does not track end users
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _wrap_single_stop(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options", "stream_options is only allowed when stream is true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _reject_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise _unsupported("logit_bias", "the sampler has no per-token biases")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; raises ``InvalidParameter`` for a value out of range."""
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(**fields, max_tokens=self._max_tokens(), logprobs=self._num_logprobs())
        except ValueError as error:
            # SamplingParams' messages start with the field's name ("temperature must be >= 0, ...").
            sampling_field = str(error).split(" ", 1)[0]
            raise InvalidParameter(self._param_name(sampling_field), str(error)) from error

    def _param_name(self, sampling_field: str) -> str | None:
        return sampling_field if sampling_field in type(self).model_fields else None

    @abstractmethod
    def _max_tokens(self) -> int | None: ...

    @abstractmethod
    def _num_logprobs(self) -> int | None: ...


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint; null: until the context is full
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        """Accept a string, a list of token ids, or a batch of exactly one of those."""
        if isinstance(prompt, str) or _is_int_list(prompt):
            return prompt
        is_batch = isinstance(prompt, list) and all(isinstance(item, str) or _is_int_list(item) for item in prompt)
        if is_batch and len(prompt) > 1:
            raise PydanticCustomError("batched_prompt", "batched prompts are not supported; send one per request")
        if is_batch and len(prompt) == 1:
            return prompt[0]
        raise PydanticCustomError("prompt_type", "prompt must be a string or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _reject_echo(cls, echo: bool) -> bool:
        if echo:
            raise _unsupported("echo", "the prompt is not returned with the completion")
        return echo

    @field_validator("suffix")
    @classmethod
    def _reject_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise _unsupported("suffix", "the served models do not fill in the middle")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _reject_best_of(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of != 1:
            raise _unsupported("best_of", "only one sample per prompt is generated")
        return best_of

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(_StrictModel):
    """One message of the conversation; content parts ``[{"type": "text", "text": ...}]`` are joined."""

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        if not all(_is_text_part(part) for part in content):
            raise PydanticCustomError(
                "content_part", 'content parts must be {"type": "text", "text": "..."}; only text is supported')
        # Joined by newlines, as vLLM renders multi-part text content.
        return "\n".join(part["text"] for part in content)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: a conversation, rendered to a prompt by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs set to true")
        return top_logprobs

    @field_validator("tools")
    @classmethod
    def _reject_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools:
            raise _unsupported("tools", "the router does not parse tool calls")
        return tools

    @field_validator("response_format")
    @classmethod
    def _reject_structured_output(cls, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
        if response_format is not None and response_format.get("type") != "text":
            raise _unsupported("response_format", 'only {"type": "text"} is served (no guided decoding)')
        return response_format

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template reads it."""
        return [{"role": message.role, "content": message.content} for message in self.messages]

    def _max_tokens(self) -> int | None:
        # Unset means until the context is full, as in OpenAI's chat API.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _param_name(self, sampling_field: str) -> str | None:
        if sampling_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if sampling_field == "logprobs" else super()._param_name(sampling_field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(item) for item in value)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


# --------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the decode pod's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy per-token logprobs: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the top alternatives and the sampled token
    text_offset: list[int]  # where each token starts in the output text, in characters


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also each stream chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text in UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # only what is new: {"role": ...} first, then {"content": ...}, {} at the end
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -------------------------------------------------------------------------- router outputs -> responses

TokenText = Callable[[int], str]  # a token id's own text, for logprobs


class _Formatter:
    """Shapes one request's router outputs; the stream and the whole response are built from the same deltas."""

    id_prefix = ""

    def __init__(self, request_id: str, model: str, token_text: TokenText, num_logprobs: int | None):
        self.response_id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.num_logprobs = num_logprobs  # None: the client asked for no logprobs

    def opening_chunks(self) -> list[BaseModel]:
        return []

    @staticmethod
    def usage(completion: Completion) -> Usage:
        return Usage(
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            total_tokens=completion.prompt_tokens + completion.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=completion.cached_tokens),
        )

    def _wants_chunk(self, delta: OutputDelta) -> bool:
        # Tokens whose text is held back (a partial character, a possible stop string) still owe their logprobs.
        return bool(delta.text) or (self.num_logprobs is not None and bool(delta.token_ids))

    def _token_logprobs(self, delta: OutputDelta) -> list[tuple[int, dict[int, float]]] | None:
        """(sampled token id, {candidate id: logprob}) per token, or None when no logprobs were asked for.

        The router's dict lists the top alternatives in rank order, then the sampled token when it is not
        among them (``wire_params.token_logprob_to_dict``)."""
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        return list(zip(delta.token_ids, delta.logprobs))


class TextCompletionFormatter(_Formatter):
    """``/v1/completions`` responses and chunks (object ``text_completion``), with legacy logprobs."""

    id_prefix = "cmpl-"

    def __init__(self, request_id: str, model: str, token_text: TokenText, num_logprobs: int | None):
        super().__init__(request_id, model, token_text, num_logprobs)
        self._text_offset = 0  # characters of token text reported so far, across chunks

    def delta_chunk(self, delta: OutputDelta) -> CompletionResponse | None:
        if not self._wants_chunk(delta):
            return None
        return self._response(CompletionChoice(text=delta.text, logprobs=self._logprobs(delta)))

    def finish_chunk(self, completion: Completion) -> CompletionResponse:
        return self._response(CompletionChoice(
            text="", finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))

    def usage_chunk(self, completion: Completion) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[],
                                  usage=self.usage(completion))

    def response(self, deltas: list[OutputDelta], completion: Completion) -> CompletionResponse:
        whole = _joined(deltas)
        choice = CompletionChoice(text=whole.text, logprobs=self._logprobs(whole),
                                  finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
        return self._response(choice, self.usage(completion))

    def _response(self, choice: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=[choice], usage=usage)

    def _logprobs(self, delta: OutputDelta) -> CompletionLogprobs | None:
        per_token = self._token_logprobs(delta)
        if per_token is None:
            return None
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, candidates in per_token:
            text = self.token_text(token_id)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(candidates[token_id])
            # This format wants exactly what the router's dict holds: the alternatives and the sampled token.
            logprobs.top_logprobs.append({self.token_text(other): value for other, value in candidates.items()})
            logprobs.text_offset.append(self._text_offset)
            self._text_offset += len(text)
        return logprobs


class ChatCompletionFormatter(_Formatter):
    """``/v1/chat/completions`` responses and chunks (``chat.completion`` / ``chat.completion.chunk``)."""

    id_prefix = "chatcmpl-"

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(ChatChunkChoice(delta={"role": "assistant", "content": ""}))]

    def delta_chunk(self, delta: OutputDelta) -> ChatCompletionChunk | None:
        if not self._wants_chunk(delta):
            return None
        return self._chunk(ChatChunkChoice(delta={"content": delta.text}, logprobs=self._logprobs(delta)))

    def finish_chunk(self, completion: Completion) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(
            delta={}, finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))

    def usage_chunk(self, completion: Completion) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage(completion))

    def response(self, deltas: list[OutputDelta], completion: Completion) -> ChatCompletionResponse:
        whole = _joined(deltas)
        choice = ChatChoice(message=AssistantMessage(content=whole.text), logprobs=self._logprobs(whole),
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=[choice], usage=self.usage(completion))

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, delta: OutputDelta) -> ChatLogprobs | None:
        per_token = self._token_logprobs(delta)
        if per_token is None:
            return None
        return ChatLogprobs(content=[self._token_logprob(token_id, candidates) for token_id, candidates in per_token])

    def _token_logprob(self, token_id: int, candidates: dict[int, float]) -> TokenLogprob:
        text = self.token_text(token_id)
        alternatives = list(candidates.items())[: self.num_logprobs]
        return TokenLogprob(token=text, logprob=candidates[token_id], bytes=list(text.encode("utf-8")),
                            top_logprobs=[self._top_logprob(other, value) for other, value in alternatives])

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _joined(deltas: list[OutputDelta]) -> OutputDelta:
    """All of a request's deltas as one, for a response that is not streamed."""
    has_logprobs = any(delta.logprobs is not None for delta in deltas)
    return OutputDelta(
        token_ids=[token_id for delta in deltas for token_id in delta.token_ids],
        text="".join(delta.text for delta in deltas),
        logprobs=[entry for delta in deltas for entry in delta.logprobs or []] if has_logprobs else None,
    )
