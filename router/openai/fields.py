"""Which fields an HTTP request body may carry, and how strictly: the base of every model in ``openai_requests``.

``StrictModel`` refuses what this server would otherwise silently ignore:

- an unknown field: pydantic's ``extra="forbid"``, a 400 naming it;
- a known field this server does not honour yet (``UNSUPPORTED_FIELDS``: ``suffix``, chat's ``prompt_logprobs``...) at
  any value but its neutral one (``null``, ``false``, ``[]``, or what asks for
  nothing), a 400 naming it and saying why;
- a loose type: ``strict=True``, as in OpenAI's API (``"0.5"`` is not a number, ``1.0`` is not an integer);
- a string that is not valid Unicode (``Text``; ``unicode_everywhere`` for free-form JSON): JSON's ``"\\ud800"``
  parses to a lone surrogate, which no tokenizer or protobuf takes.

``InvalidParameter`` is a value out of range, raised by a model's ``sampling_params()`` naming the field as the
client spelled it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# Known fields this server does not honour yet: {field: (the values that ask for nothing, why it is refused)}.
_NO_TOOLS = "the legacy function-calling fields are not supported; use tools and tool_choice"
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "samples are ranked by /v1/completions only"),
    "suffix": ((None, ""), "the served models do not fill in the middle"),
    "prompt_logprobs": ((None,), "prompt logprobs are returned by /v1/completions"),
    "guided_decoding_backend": ((None,), "the grammar engine is the server's choice (llguidance)"),
    "guided_whitespace_pattern": ((None,), "JSON output takes any whitespace between tokens"),
    "structural_tag": ((None,), "structural tags are not supported"),
    "functions": ((None, []), _NO_TOOLS),
    "function_call": ((None, "none", "auto"), _NO_TOOLS),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated: a prompt over the limit is refused"),
    "logits_processors": ((None, []), "custom logits processors are not run"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1.0), "beam search is not supported"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always decoded with the tokenizer's spacing"),
    "return_tokens_as_token_ids": ((None, False), "logprob tokens are always text"),
    "return_token_ids": ((None, False), "token ids are returned by the gRPC API, not this one"),
    "cache_salt": ((None,), "the prefix cache has no salts yet"),
    "kv_transfer_params": ((None,), "KV transfer is the router's to arrange"),
    "vllm_xargs": ((None,), "no extension arguments are taken"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "chat_template": ((None,), "a request may not bring its own chat template; use chat_template_kwargs"),
    "documents": ((None, []), "the chat template gets no documents"),
    "mm_processor_kwargs": ((None, {}), "the served models take text only"),
    "media_io_kwargs": ((None, {}), "the served models take text only"),
    "reasoning_effort": ((None,), "the served models have no reasoning modes"),
    "include_reasoning": ((None, True), "the served models have no reasoning parser"),
    "modalities": ((None, ["text"]), "the served models produce text only"),
    "audio": ((None,), "the served models produce text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "the server does not search the web"),
    "store": ((None, False), "outputs are not stored"),
    "metadata": ((None, {}), "outputs are not stored, so they carry no metadata"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    # Fields of a message, when a client sends back an assistant message as a previous response gave it.
    "refusal": ((None,), "assistant refusals are not modelled"),
    "annotations": ((None, []), "message annotations are not modelled"),
}


class InvalidParameter(ValueError):
    """A request field has a value this server refuses; ``param`` names the field as the client spelled it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("unicode", "not valid Unicode (a lone surrogate at character {at})",
                                  {"at": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]


def _unicode_json(value: Any) -> Any:
    unicode_everywhere(value)
    return value


def unicode_everywhere(value: Any) -> None:
    """Every string in ``value`` (keys too) valid Unicode, for free-form JSON (``chat_template_kwargs``)."""
    if isinstance(value, str):
        valid_unicode(value)
    elif isinstance(value, list):
        for item in value:
            unicode_everywhere(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            unicode_everywhere(key)
            unicode_everywhere(item)


# A JSON object of the client's (a JSON schema), every string in it valid Unicode.
JsonObject = Annotated[dict[str, Any], AfterValidator(_unicode_json)]


class StrictModel(BaseModel):
    """Strict types; unknown fields refused; known-but-unsupported fields refused unless neutral (or honoured by this
    model: ``honoured_fields``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    honoured_fields: ClassVar[frozenset[str]] = frozenset()  # of UNSUPPORTED_FIELDS, those this endpoint implements

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in UNSUPPORTED_FIELDS and info.field_name not in cls.honoured_fields:
            neutral, why = UNSUPPORTED_FIELDS[info.field_name]
            if not any(_same(value, v) for v in neutral):
                raise PydanticCustomError("unsupported", "{field} is not supported: {why}",
                                          {"field": info.field_name, "why": why})
        return value


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same number, but true is not 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral
