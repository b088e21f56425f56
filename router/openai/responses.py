"""What the HTTP API answers: OpenAI's response and stream-chunk objects, and the rest of the API's JSON shapes
(models, tokenize / detokenize as vLLM shapes them, version, errors).

Plain data: ``openai_format.py`` fills them from the router's outputs. Choices carry vLLM's ``stop_reason`` (the
stop string or token id that ended the request).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the decode pod's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Known once the request finished; a chunk's usage before that (continuous_usage_stats) leaves it out.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy per-token logprobs: parallel lists, one entry per token of the output (with echo, of the prompt
    first: its first token's entries are null, it has no context)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the top alternatives and the sampled (or prompt) token
    text_offset: list[int]  # where each token starts in the text, in characters


class PromptTokenLogprob(BaseModel):
    """One token of a ``prompt_logprobs`` entry, as vLLM shapes it."""

    logprob: float
    rank: int  # 1: the most probable token at this position
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token, null for the first, then {token id: ...} of the prompt's token and the top-N.
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls only
    tool_calls: list[ToolCallOut] | None = None


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
    # Only what is new: {"role": ...} first, then {"content": ...} or {"tool_calls": [...]}, {} at the end.
    delta: dict[str, Any]
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
    root: str  # the model the served name stands for, as in vLLM
    max_model_len: int  # context length in tokens, prompt and output together


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's own text, when return_token_strs


class TokenizerInfoResponse(BaseModel):
    """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does (evaluation harnesses then
    tokenize through ``/tokenize`` and ``/detokenize``)."""

    eos_token: str | None
    bos_token: str | None
    pad_token: str | None = None  # the served models have none
    model_max_length: int
    chat_template: str | None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
