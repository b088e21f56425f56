"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages, params)``.

It drives an ``LLMEngine`` until every request finishes. Text happens here, at the edge: prompts are
tokenized on the way in, and each request's output goes through an ``IncrementalDetokenizer``, which also
detects stop strings (the engine is then told to abort that request, and its text is cut at the stop string).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence as SequenceType

from splitserve.engine.config import DEFAULT_MODEL, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import FinishReason, PromptLogprob, Sequence
from splitserve.engine.text.detokenizer import IncrementalDetokenizer

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # Per output token: {token_id: logprob} for the top-N and the sampled token (when params.logprobs is set).
    logprobs: list[dict[int, float]] | None = None
    # Per prompt token (when params.prompt_logprobs is set), as vLLM gives them: None for the first, which has no
    # context, then each token's logprob, rank and the top-N.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_cached_tokens: int = 0
    # When it arrived, was first scheduled and got its first token (time.monotonic(), as vLLM's RequestMetrics).
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    """Offline batched generation. Engine settings can be given as keyword arguments, e.g.
    ``LLM(model="tiny-random", block_size=16, num_blocks=256, max_num_seqs=32)``; speculative decoding as vLLM
    spells it, ``speculative_config={"method": "ngram", "num_speculative_tokens": 4}`` (SpeculativeConfig's keys).
    ``quantization``: the weights' format, ``"auto"`` (the default: a GGUF file's own blocks where the native
    kernels run, else float), ``"none"`` (float), ``"gguf"`` (a GGUF file's own blocks), ``"int8"`` or ``"int4"``
    (quantized at load); ``int8_activations``: the products over quantized weights quantize their inputs to int8
    (faster, not the float32 path's bits); docs/quantization.md. ``prefill_compute_dtype``: what prompt tokens' products
    compute in, ``"auto"`` (the default: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere),
    ``"bfloat16"`` or ``"float32"`` (the bit-exact reference); engine/model/bf16_prefill.py. ``tensor_parallel_size``:
    the ranks the model is split over, processes of their own started here (engine/parallel/);
    ``pipeline_parallel_size``: the ranks its layers are split over (engine/parallel/pipeline.py); ``moe_dispatch``:
    how a mixture of experts' tokens meet their experts over those ranks (``EngineConfig.moe_dispatch``)."""

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
                 seed: int = 0, cpu_kernels: bool = True, speculative_config: dict | None = None,
                 quantization: str = EngineConfig.quantization,
                 int8_activations: bool = EngineConfig.int8_activations,
                 prefill_compute_dtype: str = EngineConfig.prefill_compute_dtype,
                 tensor_parallel_size: int = EngineConfig.tensor_parallel_size,
                 pipeline_parallel_size: int = EngineConfig.pipeline_parallel_size,
                 moe_dispatch: str = EngineConfig.moe_dispatch, **settings):
        cache = CacheConfig(**{k: settings.pop(k) for k in list(settings) if k in CacheConfig.__dataclass_fields__})
        sched = SchedulerConfig(
            **{k: settings.pop(k) for k in list(settings) if k in SchedulerConfig.__dataclass_fields__}
        )
        if settings:
            raise TypeError(f"unknown LLM settings: {sorted(settings)}")
        speculative = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
        self.engine = LLMEngine(EngineConfig(model, device, dtype, seed, cpu_kernels, cache, sched, speculative,
                                             quantization, int8_activations, prefill_compute_dtype,
                                             tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                                             moe_dispatch=moe_dispatch))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | SequenceType[Prompt],
                 params: SamplingParams | SequenceType[SamplingParams] | None = None,
                 priority: SequenceType[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (text, or token ids); one output per prompt, in order. ``priority``:
        one per prompt, as in vLLM (lower first: the order they start in when they cannot all run at once)."""
        prompts = [prompts] if _is_single_prompt(prompts) else list(prompts)
        params_list = _broadcast_params(params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        requests = [self._add(p, sp, pr) for p, sp, pr in zip(prompts, params_list, priorities)]
        by_id = {r.seq.request_id: r for r in requests}
        while self.engine.has_unfinished_requests():
            for seq in self.engine.step():
                by_id[seq.request_id].on_tokens(self.engine)
        return [r.output() for r in requests]

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | SequenceType[SamplingParams] | None = None,
             priority: SequenceType[int] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params, priority)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int) -> "_PendingRequest":
        if params.n != 1:  # RequestOutput holds one sample; the router serves n (SamplingParams.for_sample)
            raise ValueError(f"n must be 1 offline (one output per prompt), got {params.n}; pass the prompt n times "
                             "with params.for_sample(i)")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        if params.bad_words:
            params = params.with_bad_words_tokenized(lambda word: self.tokenizer.encode(word, add_special_tokens=False))
        seq = self.engine.add_request(str(next(self._ids)), ids, params, priority=priority)
        return _PendingRequest(seq, text, IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        ))


@dataclass
class _PendingRequest:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    num_detokenized: int = 0

    def on_tokens(self, engine: LLMEngine) -> None:
        """Detokenize the tokens the engine appended; a stop string ends the request, at the token that completed
        it (a step that accepted drafts may have appended more)."""
        seq = self.seq
        new_tokens = seq.output_token_ids[self.num_detokenized:]
        for token_id in new_tokens:
            self.num_detokenized += 1
            self.detokenizer.add(token_id)
            if self.detokenizer.stopped_by is not None:
                engine.abort_request(seq.request_id)
                del seq.output_token_ids[self.num_detokenized:], seq.output_logprobs[self.num_detokenized:]
                seq.finish_reason = FinishReason.STOP
                seq.stop_reason = self.detokenizer.stopped_by
                return

    def output(self) -> RequestOutput:
        seq = self.seq
        self.detokenizer.finish()  # release text held back for a stop string that never completed
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=self.detokenizer.text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=seq.output_logprobs if seq.sampling_params.logprobs is not None else None,
            prompt_logprobs=[None, *seq.prompt_logprobs] if seq.sampling_params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            metrics={name: value for name, value in (("arrival_time", seq.arrival_time),
                                                     ("first_scheduled_time", seq.first_scheduled_time),
                                                     ("first_token_time", seq.first_token_time)) if value is not None},
        )


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
