"""``RequestIntake``: a client's request -> a checked ``RouterRequest`` of token ids; the text edge of the router.

The HTTP and gRPC layers depend on this file (through ``Router``, which hands them its ``RequestIntake``'s
methods):

1. cheap checks first, before any work they bound: the request id (``check_request_id``), the sampling
   parameters within the server's limits (stop strings, stop token ids, logprobs and prompt logprobs, max_tokens,
   bad words, token ids of logit_bias and allowed_token_ids), a text's size in UTF-8 bytes (``max_prompt_bytes``);
   a structured output's grammar compiled (``engine/structured_output/grammar.py``), on a worker thread;
2. then the work: a chat rendered by the model's template (``apply_chat_template``), a prompt tokenized
   (``tokenize``), both on worker threads: a prompt at the byte limit takes about a second to tokenize, and the
   event loop serves every other request (and /health) meanwhile;
3. last, the limits that need token ids: the prompt's length (``max_prompt_tokens``, room left in the context),
   every id in the vocabulary, and ``max_tokens`` (unset: the room left, at most ``max_tokens_limit``).

``make_request`` runs all three and returns the ``RouterRequest`` that ``Router.generate`` serves. Every refusal is
``StatusError(INVALID_ARGUMENT)`` naming the field at fault. The tokenizer is the model's own (its name resolved by
``splitserve.engine.text.tokenizer_files``, without torch or the weights): the router holds text only at this edge, and
in the detokenizer of each request's run (``request_run.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.structured_output.grammar import GrammarCompiler
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.router.config import RouterConfig
from splitserve.runtime.errors import StatusError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Request ids travel in headers, logs and metadata: short and printable, no spaces.
MAX_REQUEST_ID_LENGTH = 128
# Bad words per request: each is tokenized twice and checked against the output at every step.
MAX_BAD_WORDS = 64
# Variables the router gives every chat template itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass
class SampleGroup:
    """The n samples of one prompt (``n`` > 1): the first sample's placement prefills the prompt once on a prefill pod
    for all of them (every sample's first token drawn from the same logits) and pushes its KV once, to one decode pod,
    where each sample's Decode call claims it (``placement.py``). The others wait for that (``shared``) and go on
    their own when there is none (the prompt prefilled on a decode pod, or the first sample failed)."""

    request_ids: list[str]  # the samples' requests, the first one's id naming the pushed KV
    params: SamplingParams  # the first sample's, with n: what the prefill pod samples with
    shared: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def kv_request_id(self) -> str:
        return self.request_ids[0]

    def share(self, outcome: Any) -> None:
        """What the others start from (None: each on its own); once, later calls are ignored."""
        if not self.shared.done():
            self.shared.set_result(outcome)


@dataclass(frozen=True)
class ServiceLevel:
    """What a request asks of the schedulers (docs/api.md, "Latency targets and priority"): its own TTFT and TPOT
    targets in seconds (None: the router's ``--slo-*-s``), which the hybrid placement schedules for and the router's
    goodput counts against; and its priority (vLLM's: lower first), which orders each pod's queue and its
    preemptions."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    priority: int = 0

    @classmethod
    def checked(cls, ttft_s: float | None, tpot_s: float | None, priority: int,
                names: tuple[str, str, str]) -> ServiceLevel:
        """The service level as a client sent it: each target None or a finite number of seconds > 0, the priority
        an int32; else ``StatusError(INVALID_ARGUMENT)`` naming the field as the client spelled it (``names``)."""
        for value, name in zip((ttft_s, tpot_s), names):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise invalid(f"{name}: must be a number of seconds > 0, got {value!r}")
        if not -2**31 <= priority < 2**31:  # it travels to the pods as an int32
            raise invalid(f"{names[2]}: must be an integer in [-2^31, 2^31), got {priority}")
        return cls(ttft_s, tpot_s, priority)


DEFAULT_SERVICE = ServiceLevel()  # the router's --slo-*-s, priority 0


@dataclass
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    timeout_s: float | None = None  # arrival to last token; None: the router's request_timeout_s
    # The request's own latency targets (docs/api.md, "Latency targets and priority"); None: the router's --slo-*-s.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    priority: int = 0  # vLLM's: lower first, on every pod it runs on
    samples: SampleGroup | None = None  # the n > 1 samples of its prompt, it among them

    @property
    def leads_samples(self) -> bool:
        """The first of its prompt's samples: its prefill is for all of them."""
        return self.samples is not None and self.samples.kv_request_id == self.request_id

    @property
    def may_split_prefill(self) -> bool:
        """Its prompt may prefill across two pods (a prefix on P, the rest on D): not when it generates nothing
        (scoring: P alone), owes prompt logprobs (one pod computes them all) or shares one prefill with other
        samples."""
        return self.samples is None and self.params.prompt_logprobs is None and self.params.max_tokens != 0


class RequestIntake:
    """Tokenizes and checks requests against the ``RouterConfig``'s limits, off the event loop."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self._text_workers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.grammars = GrammarCompiler(tokenizer)  # checks structured outputs; built on first use
        encode_without_holding_the_gil(self.tokenizer)

    def close(self) -> None:
        self._text_workers.shutdown(wait=False, cancel_futures=True)

    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """``text``'s token ids, once it passed the byte limit; ``field`` names it in errors."""
        self._check_text(text, field)
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int], field: str = "tokens") -> str:
        """The text of ``token_ids`` (special tokens included), which must be ids of the vocabulary."""
        if len(token_ids) > self.config.max_model_len:
            raise invalid(f"{field}: {len(token_ids)} tokens, more than the model's context of "
                          f"{self.config.max_model_len}")
        self._check_token_ids(token_ids, field)
        return await self._off_loop(self.tokenizer.decode, token_ids, False)

    async def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                                  continue_final_message: bool = False,
                                  template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation rendered by the model's chat template. ``continue_final_message``: the prompt ends
        inside the last message (as transformers does it), so that the model continues it instead of answering."""
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(set(template_kwargs) & _RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise invalid(f"chat_template_kwargs.{reserved[0]}: reserved; the server sets it")
        if continue_final_message and add_generation_prompt:
            raise invalid("continue_final_message: cannot be combined with add_generation_prompt; set "
                          "add_generation_prompt to false to continue the final message")
        size = sum(_utf8_length(str(m.get("content", "")), f"messages[{i}].content") for i, m in enumerate(messages))
        if size > self.config.max_prompt_bytes:
            raise invalid(f"messages: {size} bytes of content, more than the limit of "
                          f"{self.config.max_prompt_bytes} bytes (max_prompt_bytes)")
        return await self._off_loop(self._render_chat, messages, add_generation_prompt, continue_final_message,
                                    template_kwargs)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
                     template_kwargs: dict[str, Any]) -> str:
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        **template_kwargs)
        except Exception as exc:  # no template, jinja2 errors, raise_exception() in a template: bad messages
            raise invalid(f"messages: {exc}") from exc
        if not continue_final_message:
            return prompt
        final = str(messages[-1].get("content", "")).strip() if messages else ""
        at = prompt.rfind(final) if final else -1
        if at < 0:
            raise invalid("messages: continue_final_message needs a final message with content that the chat "
                          "template renders as is")
        return prompt[:at + len(final)]

    async def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                           add_special_tokens: bool = True, timeout_s: float | None = None,
                           service: ServiceLevel = DEFAULT_SERVICE) -> RouterRequest:
        """A validated request; unset ``max_tokens`` becomes the room left in the context (at most
        ``max_tokens_limit``). ``timeout_s``: the client's own deadline, when it has one (the request's deadline
        is the shorter of it and ``request_timeout_s``); ``service``: its own latency targets and priority, checked
        by the API that read them (``ServiceLevel.checked``). Raises ``StatusError(INVALID_ARGUMENT)`` naming what is
        wrong."""
        arrival = time.monotonic()  # tokenizing is part of what the client waits for
        if request_id is not None:
            check_request_id(request_id, "request_id")
        params = self._checked_params(params)
        if params.structured_output is not None:
            await self._off_loop(self._check_structured_output, params)
        if params.bad_words:
            try:
                params = await self._off_loop(params.with_bad_words_tokenized, self._encode_word)
            except ValueError as error:
                raise invalid(f"bad_words: {error}") from None
        if isinstance(prompt, str):
            token_ids = await self.tokenize(prompt, add_special_tokens)
        else:
            token_ids = list(prompt)
        self._check_prompt(token_ids)
        params = self._with_max_tokens(params, len(token_ids))
        timeout = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        return RouterRequest(request_id or uuid.uuid4().hex, token_ids, params,
                             prompt_text=prompt if isinstance(prompt, str) else None, arrival_time=arrival,
                             timeout_s=timeout, slo_ttft_s=service.ttft_s, slo_tpot_s=service.tpot_s,
                             priority=service.priority)

    def _checked_params(self, params: SamplingParams) -> SamplingParams:
        """The request's parameters within the server's limits (``SamplingParams`` checked the rest)."""
        config = self.config
        if len(params.stop) > config.max_stop_strings:
            raise invalid(f"stop: {len(params.stop)} stop strings, more than the limit of {config.max_stop_strings} "
                          f"(max_stop_strings)")
        for i, stop in enumerate(params.stop):
            if _utf8_length(stop, f"stop[{i}]") > config.max_stop_string_bytes:
                raise invalid(f"stop[{i}]: {len(stop.encode())} bytes, more than the limit of "
                              f"{config.max_stop_string_bytes} bytes per stop string (max_stop_string_bytes)")
        if len(params.stop_token_ids) > config.max_stop_token_ids:
            raise invalid(f"stop_token_ids: {len(params.stop_token_ids)} ids, more than the limit of "
                          f"{config.max_stop_token_ids} (max_stop_token_ids)")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        self._check_token_ids(list(params.logit_bias), "logit_bias")
        self._check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        for word in params.bad_words_token_ids:  # the gRPC API may send them tokenized
            self._check_token_ids(word, "bad_words_token_ids")
        if len(params.bad_words) + len(params.bad_words_token_ids) > MAX_BAD_WORDS:
            raise invalid(f"bad_words: more than the limit of {MAX_BAD_WORDS} words")
        for i, word in enumerate(params.bad_words):
            if _utf8_length(word, f"bad_words[{i}]") > config.max_stop_string_bytes:
                raise invalid(f"bad_words[{i}]: {len(word.encode())} bytes, more than the limit of "
                              f"{config.max_stop_string_bytes} bytes per word (max_stop_string_bytes)")
        if params.logprobs is not None and params.logprobs > config.max_logprobs:
            raise invalid(f"logprobs: must be <= {config.max_logprobs} (max_logprobs), got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > config.max_logprobs:
            raise invalid(f"prompt_logprobs: must be <= {config.max_logprobs} (max_logprobs), got "
                          f"{params.prompt_logprobs}")
        if params.max_tokens is not None and params.max_tokens > config.output_token_limit:
            raise invalid(f"max_tokens: must be <= {config.output_token_limit} (max_tokens_limit), got "
                          f"{params.max_tokens}")
        if params.top_k > self.tokenizer.vocab_size:  # the same as no top-k filter; keeps the wire's int32
            params = dataclasses.replace(params, top_k=0)
        return params

    def _check_structured_output(self, params: SamplingParams) -> None:
        """The grammar compiles (within llguidance's fuel limits: a pathological regex fails fast), before any pod
        works on the request."""
        try:
            self.grammars.check(params.structured_output)
        except ValueError as error:
            raise invalid(f"structured_output: {error}") from None

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def _with_max_tokens(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        room = self.config.max_model_len - prompt_tokens
        if params.max_tokens is None:
            max_tokens = min(room, self.config.output_token_limit)
            if params.min_tokens > max_tokens:
                raise invalid(f"min_tokens: must be <= max_tokens, which is {max_tokens} when unset (the room "
                              f"left in the context, at most max_tokens_limit), got {params.min_tokens}")
            return dataclasses.replace(params, max_tokens=max_tokens)
        if params.max_tokens > room:
            raise invalid(f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {params.max_tokens} "
                          f"exceed the model's context of {self.config.max_model_len} tokens")
        return params

    def _check_text(self, text: str, field: str) -> None:
        # A str has at most as many characters as UTF-8 bytes: a text far over the limit is refused unencoded.
        limit = self.config.max_prompt_bytes
        if len(text) > limit or _utf8_length(text, field) > limit:
            raise invalid(f"{field}: more than the limit of {limit} bytes (max_prompt_bytes)")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise invalid("prompt: must not be empty")
        limit = self.config.prompt_token_limit
        if len(token_ids) > limit:  # before looking at each id: a long list is refused at the cost of len()
            if limit == self.config.max_model_len - 1:
                raise invalid(f"prompt: {len(token_ids)} tokens leave no room for output in the model's context "
                              f"of {self.config.max_model_len} tokens")
            raise invalid(f"prompt: {len(token_ids)} tokens, more than the limit of {limit} (max_prompt_tokens)")
        self._check_token_ids(token_ids, "prompt")

    def _check_token_ids(self, token_ids: list[int], field: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        outside = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if outside:
            raise invalid(f"{field}: token ids must be integers in [0, {vocab_size}), got {outside[:5]}")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text_workers, fn, *args)


def invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_request_id(request_id: str, field: str) -> None:
    """Raises INVALID_ARGUMENT naming ``field`` unless ``request_id`` is 1 to 128 printable ASCII characters
    without spaces."""
    if not (0 < len(request_id) <= MAX_REQUEST_ID_LENGTH and all("!" <= c <= "~" for c in request_id)):
        raise invalid(f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII characters without "
                      f"spaces, got {request_id[:MAX_REQUEST_ID_LENGTH + 1]!r}")


def _utf8_length(text: str, field: str) -> int:
    """``text``'s length in UTF-8; INVALID_ARGUMENT naming ``field`` for a lone surrogate (JSON's "\\ud800" parses
    to one, and no tokenizer or protobuf takes it)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise invalid(f"{field}: not valid Unicode (a lone surrogate at character {exc.start})") from None


def encode_without_holding_the_gil(tokenizer: Tokenizer) -> None:
    """Make ``tokenizer.encode`` let other threads run while it tokenizes.

    HF ``tokenizers``' single ``encode`` holds the GIL for the whole Rust call (1 MiB of text: ~1 s during which
    no other thread, the event loop included, runs); ``encode_batch`` releases it and gives the same ids. The
    engine's ``Tokenizer`` keeps its backend private, so the router swaps it here, once, for a wrapper that
    tokenizes one text as a batch of one. To be replaced by a GIL-free ``Tokenizer.encode`` in
    ``engine/text/tokenizer.py`` (its owner's file), after which this function goes."""
    backend = getattr(tokenizer, "_backend", None)
    if backend is None or isinstance(backend, _BatchOfOneEncoder):
        if backend is None:
            log.warning("the tokenizer has no backend to wrap: long prompts will hold the GIL while they tokenize")
        return
    tokenizer._backend = _BatchOfOneEncoder(backend)


class _BatchOfOneEncoder:
    """A ``tokenizers.Tokenizer`` whose ``encode`` runs as ``encode_batch([text])`` (see above)."""

    def __init__(self, backend: Any):
        self._backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)
