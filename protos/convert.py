"""The engine's Python objects <-> the ``splitserve.v1`` messages: sampling parameters, logprobs, finish reasons.

The router translates a request's ``SamplingParams`` to the proto once (``sampling_params_to_proto``) and
sends the same message to the prefill and the decode pod; each pod turns it back with
``sampling_params_from_proto``, which validates it (a bad value raises ``ValueError`` naming the field). Both
directions live here so that a field added to one cannot be forgotten in the other.

Logprobs travel as ``TokenLogprob`` messages and reach the HTTP layer as one ``{token_id: logprob}`` dict
per output token: the ``top_logprobs`` alternatives in rank order, then the sampled token when it is not
among them (the order vLLM's OpenAI server shows). Prompt logprobs travel in the same messages, each with its
token's rank, and reach the router as the engine's ``PromptLogprob``s.
"""

from __future__ import annotations

from splitserve.engine.sampling.params import SamplingParams, StructuredOutput
from splitserve.engine.sequence import FinishReason, PromptLogprob
from splitserve.engine.step_time import StepTimeModel
from splitserve.v1 import common_pb2


def step_time_to_proto(model: StepTimeModel) -> common_pb2.StepTimeModel:
    return common_pb2.StepTimeModel(
        base_seconds=model.base, per_decode_row_seconds=model.per_decode_row,
        per_prefill_token_seconds=model.per_prefill_token, per_context_token_seconds=model.per_context_token,
        prefill_pass_seconds=model.prefill_pass, num_samples=model.num_samples)


def step_time_from_proto(message: common_pb2.StepTimeModel) -> StepTimeModel:
    return StepTimeModel(message.base_seconds, message.per_decode_row_seconds, message.per_prefill_token_seconds,
                         message.per_context_token_seconds, message.prefill_pass_seconds,
                         num_samples=message.num_samples)


# Optional proto fields that, unset, take SamplingParams' own default.
_OPTIONAL_FIELDS = ("temperature", "top_p", "repetition_penalty", "seed", "logprobs", "skip_special_tokens",
                    "prompt_logprobs")


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=params.logit_bias,
        allowed_token_ids=params.allowed_token_ids or [],
        bad_words=params.bad_words,
        bad_words_token_ids=[common_pb2.BadWord(token_ids=ids) for ids in params.bad_words_token_ids],
        n=params.n,
    )
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    # None means "unset" for these, which proto3 spells as an absent optional field.
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(message, name, getattr(params, name))
    return message


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's ``SamplingParams``; unset optional fields take vLLM's defaults. Raises ``ValueError``."""
    optional = {name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)}
    return SamplingParams(
        top_k=message.top_k,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        min_tokens=message.min_tokens,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        include_stop_str_in_output=message.include_stop_str_in_output,
        logit_bias=dict(message.logit_bias),
        allowed_token_ids=list(message.allowed_token_ids) or None,
        bad_words=list(message.bad_words),
        bad_words_token_ids=[list(word.token_ids) for word in message.bad_words_token_ids],
        structured_output=(structured_output_from_proto(message.structured_output)
                           if message.HasField("structured_output") else None),
        n=message.n or 1,
        # Unset max_tokens is "until the context is full", not SamplingParams' default of 16.
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        **optional,
    )

def structured_output_to_proto(spec: StructuredOutput) -> common_pb2.StructuredOutput:
    if spec.choice is not None:
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=spec.choice))
    return common_pb2.StructuredOutput(**{spec.kind: getattr(spec, spec.kind)})


def structured_output_from_proto(message: common_pb2.StructuredOutput) -> StructuredOutput:
    """Raises ValueError for a message that sets no constraint."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_output must set one of json, regex, choice, grammar, json_object")
    if kind == "choice":
        return StructuredOutput(choice=tuple(message.choice.choices))
    return StructuredOutput(**{kind: getattr(message, kind)})


_FINISH_REASON_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_REASON_FROM_PROTO = {proto: reason for reason, proto in _FINISH_REASON_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | str) -> int:
    return _FINISH_REASON_TO_PROTO[FinishReason(reason)]


def finish_reason_from_proto(value: int) -> FinishReason:
    """Unknown or unset values (a newer or broken peer) read as ERROR: the request did not finish cleanly."""
    return _FINISH_REASON_FROM_PROTO.get(value, FinishReason.ERROR)


def token_logprob_to_dict(message: common_pb2.TokenLogprob) -> dict[int, float]:
    """``{token_id: logprob}``: the top alternatives, most likely first, then the sampled token if missing."""
    ranked = {top.token_id: top.logprob for top in message.top_logprobs}
    ranked.setdefault(message.token_id, message.logprob)
    return ranked


def token_logprob_from_dict(token_id: int, logprobs: dict[int, float], num_top: int) -> common_pb2.TokenLogprob:
    """Inverse of ``token_logprob_to_dict`` for a request that asked for ``num_top`` alternatives."""
    tops = list(logprobs.items())[:num_top]
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprobs[token_id],
        top_logprobs=[common_pb2.TopLogprob(token_id=top_id, logprob=value) for top_id, value in tops],
    )


def prompt_logprobs_to_proto(entries: list[PromptLogprob]) -> common_pb2.Logprobs:
    """A prompt's logprobs (one entry per prompt token from the second on), each with its rank."""
    return common_pb2.Logprobs(tokens=[common_pb2.TokenLogprob(
        token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
        top_logprobs=[common_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in entry.top.items()],
    ) for entry in entries])


def prompt_logprobs_from_proto(message: common_pb2.Logprobs) -> list[PromptLogprob]:
    return [PromptLogprob(entry.token_id, entry.logprob, entry.rank,
                          {top.token_id: top.logprob for top in entry.top_logprobs}) for entry in message.tokens]
