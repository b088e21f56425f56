"""What the HTTP API accepts: the request bodies of ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``
and ``/detokenize``, as strict pydantic models, and how a body becomes ``SamplingParams``. The fields every
generation shares, completions and tokenize/detokenize are here; chat's messages, tools and template options are
``openai_chat_requests.py``'s.

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

from splitserve.engine.sampling.params import SamplingParams, StructuredOutput
from splitserve.router.openai.fields import InvalidParameter, JsonObject, StrictModel, Text, valid_unicode

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


class GenerationRequest(StrictModel):
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
    # splitserve's: this request's own latency targets in seconds (docs/api.md, "Latency targets and priority")
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int | None = None  # vLLM's: lower first, null as 0 (docs/api.md, "Latency targets and priority")
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


class CompletionRequest(GenerationRequest):
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


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: Text | None = None
    tokens: list[int]


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
