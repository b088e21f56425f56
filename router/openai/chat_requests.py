"""The chat side of what the HTTP API accepts: ``/v1/chat/completions`` bodies (messages, tools, the chat
template's options) and ``/tokenize`` bodies with ``messages``, as strict pydantic models; the fields both
endpoints share, and how a body becomes ``SamplingParams``, are ``openai_requests.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from splitserve.engine.sampling.params import StructuredOutput
from splitserve.router.openai.fields import JsonObject, StrictModel, Text, unicode_everywhere
from splitserve.router.openai.requests import GenerationRequest, TokenizeCompletionRequest
from splitserve.router.openai.tool_calls import ToolCallParser, forced_output


class FunctionCallIn(StrictModel):
    name: Text
    arguments: Text  # JSON text


class ToolCallIn(StrictModel):
    """A call an earlier assistant message made, as a previous response gave it."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(StrictModel):
    name: Text = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # a forced call always follows the schema; an auto one is parsed as it comes


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class _ChatMessage(StrictModel):
    """One message of the conversation; content parts ``[{"type": "text", "text": ...}]`` are joined."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None  # null only for an assistant message that made tool calls
    name: Text | None = None  # the participant's name, given to the chat template
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    # An assistant message as a previous response gave it (OpenAI's SDK dumps these): accepted when neutral.
    function_call: Any = None
    refusal: Any = None
    annotations: Any = None
    audio: Any = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> "_ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required (null only for an assistant's tool calls)")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only an assistant message makes tool calls")
        return self

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

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _ChatTemplateOptions(StrictModel):
    """How the conversation becomes the prompt text (vLLM's fields, shared by chat and chat tokenization)."""

    messages: list[_ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # the template opens the assistant's turn
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking...)
    chat_template: Any = None  # known, not supported (UNSUPPORTED_FIELDS)
    documents: Any = None
    mm_processor_kwargs: Any = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # unset: auto with tools

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, continue_final: bool, info: ValidationInfo) -> bool:
        if continue_final and info.data.get("add_generation_prompt", True):
            raise PydanticCustomError("continue_final_message", "continue_final_message cannot be combined with "
                                      "add_generation_prompt; set add_generation_prompt to false")
        return continue_final

    @field_validator("chat_template_kwargs")
    @classmethod
    def _unicode_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        unicode_everywhere(kwargs)
        return kwargs

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice not in (None, "none", "auto") and not tools:
            named = choice if isinstance(choice, str) else choice.function.name
            raise PydanticCustomError("tool_choice", "tool_choice {choice} needs tools", {"choice": repr(named)})
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise PydanticCustomError("tool_choice", "tool_choice names {name}, which is not one of the tools",
                                      {"name": repr(choice.function.name)})
        return choice

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template reads it."""
        return [message.for_template() for message in self.messages]

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model is told about (none with ``tool_choice: "none"``), as OpenAI's dicts."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class ChatCompletionRequest(_ChatTemplateOptions, GenerationRequest):
    """``POST /v1/chat/completions``: a conversation, rendered to a prompt by the model's chat template."""

    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    # vLLM's default for chat: the template writes the special tokens it wants (BOS included) into the text.
    add_special_tokens: bool = False
    echo: bool = False  # vLLM's chat echo (the last message before the answer): refused when true
    parallel_tool_calls: bool = True  # a forced tool_choice may make several calls
    # Known, not supported (UNSUPPORTED_FIELDS).
    prompt_logprobs: Any = None
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs set to true")
        return top_logprobs

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, echo: bool) -> bool:
        if echo:
            raise PydanticCustomError("unsupported", "echo is not supported for chat; use continue_final_message")
        return echo

    def _structured_outputs_asked(self) -> Iterator[tuple[str, StructuredOutput | None]]:
        yield from super()._structured_outputs_asked()
        tools = self.offered_tools()
        yield "tool_choice", forced_output(tools, self._tool_choice_dict(), self.parallel_tool_calls) if tools else None

    def _tool_choice_dict(self) -> str | dict[str, Any]:
        choice = self.tool_choice or "auto"
        return choice if isinstance(choice, str) else choice.model_dump()

    def tool_parser(self) -> ToolCallParser | None:
        """How the answer's tool calls are found, when tools are offered."""
        tools = self.offered_tools()
        return ToolCallParser(tools, forced=self._tool_choice_dict() != "auto") if tools else None

    def _max_tokens(self) -> int | None:
        # Unset means until the context is full, as in OpenAI's chat API.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def param_name(self, field: str) -> str | None:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "prompt":  # the prompt of a chat is its rendered messages
            return "messages"
        return "top_logprobs" if field == "logprobs" else super().param_name(field)


class TokenizeChatRequest(_ChatTemplateOptions):
    """``POST /tokenize`` with ``messages`` (vLLM's shape): the prompt a chat request would send."""

    model: Text | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False
    media_io_kwargs: Any = None  # known, not supported (UNSUPPORTED_FIELDS)


def tokenize_request(body: Any) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which tokenize request ``body`` is: a chat when it has ``messages`` (as vLLM tells them apart)."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "StreamOptions", "TokenizeChatRequest",
    "TokenizeCompletionRequest", "tokenize_request",
]
