"""What the HTTP API accepts: the request bodies of ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``
and ``/detokenize``, as strict pydantic models, and how a body becomes ``SamplingParams``.

    JSON body -> CompletionRequest / ChatCompletionRequest / Tokenize... / DetokenizeRequest   shapes and types
              -> .sampling_params()                                                          values and ranges

No field is silently ignored. Each field a body may carry is one of:

- honoured: OpenAI's fields this server implements (``logit_bias``, ``response_format``, ``n``, ``echo``...,
  ``max_tokens: 0`` with ``echo`` to score a prompt), vLLM's ``prompt_logprobs`` on completions, and
  vLLM's extras (structured outputs: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  ``structured_outputs``; ``top_k``,
  ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
  ``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``, ``add_special_tokens``, ``request_id``; for
  chat ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``;
  ``stream_options.continuous_usage_stats``);
- known but not supported yet (``openai_fields.UNSUPPORTED_FIELDS``: ``suffix``, chat's ``prompt_logprobs``...):
  accepted only at its neutral value (``null``, ``false``, ``[]``, or what asks for nothing: chat's ``best_of: 1``,
  ``response_format: {"type": "text"}``), refused with 400 naming it
  otherwise;
- ignored on purpose, and documented as such: ``user`` and ``safety_identifier`` (end-user ids for OpenAI's abuse
  monitoring; this server keeps no per-user state);
- anything else: unknown, refused with 400 naming it.

Types are strict, as in OpenAI's API: ``"0.5"`` is not a number and ``1.0`` is not an integer, and strings must be
valid Unicode (JSON's ``"\\ud800"`` is not). Value ranges are checked once, by ``SamplingParams``, whose error names
the field; ``sampling_params()`` re-raises it as ``InvalidParameter`` naming the field as the client spelled it.
The server's own limits (prompt size, stop strings, ``max_tokens``, logprobs) are the router's to check.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import SamplingParams, StructuredOutput
from router.openai_fields import InvalidParameter, JsonObject, StrictModel, Text, unicode_everywhere, valid_unicode
from router.tool_calls import ToolCallParser, forced_output

# Request fields passed to SamplingParams under the same name, when the client set them.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
)

class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's: usage (so far) in every chunk, not only in the last one. Needs include_usage.
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _needs_usage(cls, continuous: bool, info: ValidationInfo) -> bool:
        if continuous and not info.data.get("include_usage"):
            raise PydanticCustomError("stream_options", "continuous_usage_stats needs include_usage set to true")
        return continuous


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: Text
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")  # null: any JSON value
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise PydanticCustomError("json_schema", 'json_schema is required with (and only with) type "json_schema"')
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            return StructuredOutput(json=_schema_text(self.json_schema.schema_ or {}))
        return None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` object: exactly one of its constraints."""

    json_: JsonObject | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None

    def structured_output(self) -> StructuredOutput:
        asked = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None}
        set_ = [name for name, value in asked.items() if value is not None]
        if len(set_) != 1:
            raise InvalidParameter("structured_outputs", f"structured_outputs: set exactly one of "
                                   f"{', '.join(asked)}; got {', '.join(set_) or 'none'}")
        if self.json_ is not None:
            return StructuredOutput(json=_schema_text(self.json_))
        if self.choice is not None:
            return _choice("structured_outputs.choice", self.choice)
        return StructuredOutput(**{set_[0]: asked[set_[0]]})


class _GenerationRequest(StrictModel):
    """The fields both generation endpoints share: everything that becomes a ``SamplingParams``, streaming,
    the request id, and the known-but-unsupported fields of both."""

    model: Text | None = None  # optional, as in vLLM; when given it must name the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and ignored on purpose: this server keeps no per-user state
    safety_identifier: str | None = None  # OpenAI's successor of `user`; the same
    request_id: Text | None = None  # vLLM's: the request's id, as the X-Request-Id header gives it
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a JSON key, a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    # Structured outputs: at most one of these (structured_output()).
    response_format: ResponseFormat | None = None  # OpenAI's
    guided_json: JsonObject | Text | None = None  # vLLM's: a JSON schema
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None  # Lark or GBNF
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer object
    # Known, not supported yet: refused unless neutral (UNSUPPORTED_FIELDS).
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    priority: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

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

    @property
    def samples_per_prompt(self) -> int:
        """Samples generated per prompt: ``n``, or more when the ``n`` most likely are kept (``best_of``)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; raises ``InvalidParameter`` for a value out of range."""
        fields = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias is not None:
            fields["logit_bias"] = _token_id_keys(self.logit_bias)
        constrained = self._structured_output()
        if constrained is not None:
            fields["structured_output"] = constrained[1]
        try:
            params = SamplingParams(**fields, max_tokens=self._max_tokens(), logprobs=self._num_logprobs(),
                                    prompt_logprobs=self._num_prompt_logprobs())
        except ValueError as error:
            # SamplingParams' messages start with the field's name ("temperature must be >= 0, ...").
            sampling_field, _, rest = str(error).partition(" ")
            param = self.param_name(sampling_field)
            raise InvalidParameter(param, f"{param or sampling_field} {rest}") from error
        if params.max_tokens == 0 and not self._scores():
            param = self.param_name("max_tokens")
            raise InvalidParameter(param, f"{param} must be >= 1 (0, which generates nothing, is for scoring a "
                                          f"prompt: /v1/completions with echo)")
        return params

    def param_name(self, field: str) -> str | None:
        """The body's name for a field the router or ``SamplingParams`` names (``prompt``, ``max_tokens``...)."""
        if field == "structured_output":
            constrained = self._structured_output()
            return None if constrained is None else constrained[0]
        return field if field in type(self).model_fields else None

    def _structured_output(self) -> tuple[str, StructuredOutput] | None:
        """(the field that asked, what it asked) for the one structured-output field set; InvalidParameter for two."""
        asked = [(name, spec) for name, spec in self._structured_outputs_asked() if spec is not None]
        if len(asked) > 1:
            raise InvalidParameter(asked[1][0], f"{asked[1][0]}: only one structured output per request; "
                                                f"{asked[0][0]} is set too")
        return asked[0] if asked else None

    def _structured_outputs_asked(self) -> Iterator[tuple[str, StructuredOutput | None]]:
        yield "response_format", self.response_format.structured_output() if self.response_format else None
        if self.guided_json is not None:
            yield "guided_json", StructuredOutput(json=_schema_text(self.guided_json))
        if self.guided_regex is not None:
            yield "guided_regex", StructuredOutput(regex=self.guided_regex)
        if self.guided_choice is not None:
            yield "guided_choice", _choice("guided_choice", self.guided_choice)
        if self.guided_grammar is not None:
            yield "guided_grammar", StructuredOutput(grammar=self.guided_grammar)
        if self.structured_outputs is not None:
            yield "structured_outputs", self.structured_outputs.structured_output()

    @abstractmethod
    def _max_tokens(self) -> int | None: ...

    def _num_prompt_logprobs(self) -> int | None:
        return None

    def _scores(self) -> bool:
        """Whether ``max_tokens: 0`` (nothing generated, the prompt scored) may be asked for."""
        return False

    @abstractmethod
    def _num_logprobs(self) -> int | None: ...


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: a prompt, as text or token ids, or a list of prompts (one choice each, n each)."""

    honoured_fields = frozenset({"prompt_logprobs", "best_of"})

    prompt: str | list[int] | list[str | list[int]]  # text checked for valid Unicode by _prompts
    max_tokens: int | None = 16  # OpenAI's default for this endpoint; null: until the context is full; 0 with echo
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False  # the prompt's text before each choice's output (with logprobs: its tokens' logprobs too)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and the top-N, in the choice
    best_of: int | None = Field(None, ge=1)  # samples per prompt, of which the n most likely are returned
    add_special_tokens: bool = True  # vLLM's: BOS and the like, as the tokenizer adds them
    suffix: Any = None  # known, not supported (UNSUPPORTED_FIELDS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        """A string, a list of token ids, or a list of those; a list of one is that one."""
        if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_int_list(prompt[0])):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return valid_unicode(prompt)
        if _is_int_list(prompt):
            return prompt
        if isinstance(prompt, list) and all(isinstance(item, str) or _is_int_list(item) for item in prompt):
            return [valid_unicode(item) if isinstance(item, str) else item for item in prompt]
        raise PydanticCustomError("prompt_type", "prompt must be a string, a list of token ids, or a list of those")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order (one for a single prompt)."""
        single = isinstance(self.prompt, str) or _is_int_list(self.prompt)
        return [self.prompt] if single else list(self.prompt)

    @property
    def samples_per_prompt(self) -> int:
        return self.best_of or self.n

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        if self.best_of is not None and self.best_of < params.n:
            raise InvalidParameter("best_of", f"best_of must be >= n ({params.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > params.n and self.stream:
            raise InvalidParameter("best_of", "best_of: the samples are ranked once they are all done, so they "
                                              "cannot be streamed; set stream to false")
        return params

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _num_prompt_logprobs(self) -> int | None:
        """The top-N the pods compute per prompt token: for vLLM's ``prompt_logprobs``, and for the prompt's entries
        of ``logprobs`` when echoing (OpenAI's legacy scoring), the larger of the two."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked, default=None)

    def _scores(self) -> bool:
        return self.echo


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


class ChatCompletionRequest(_ChatTemplateOptions, _GenerationRequest):
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


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateOptions):
    """``POST /tokenize`` with ``messages`` (vLLM's shape): the prompt a chat request would send."""

    model: Text | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False
    media_io_kwargs: Any = None  # known, not supported (UNSUPPORTED_FIELDS)


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: Text | None = None
    tokens: list[int]


def tokenize_request(body: Any) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which tokenize request ``body`` is: a chat when it has ``messages`` (as vLLM tells them apart)."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def _schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema as JSON text (vLLM takes it as an object or as a string of JSON)."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def _choice(param: str, choices: list[str]) -> StructuredOutput:
    if not choices:
        raise InvalidParameter(param, f"{param}: must list at least one choice")
    return StructuredOutput(choice=tuple(choices))


def _token_id_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"50256": -100}``: JSON keys are strings, each must spell a token id."""
    biases = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        biases[int(key)] = bias
    return biases


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(item) for item in value)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "DetokenizeRequest", "StreamOptions", "TokenizeChatRequest",
    "TokenizeCompletionRequest", "tokenize_request",
]
