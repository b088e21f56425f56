"""``Router``: one request's way from the client API to the pods and back, as token ids inside and text at the edge.

The HTTP and gRPC layers call ``make_request`` (validate, tokenize) and then iterate ``generate(request)``:

1. admission: a request is refused at once with RESOURCE_EXHAUSTED and a retry-after hint (HTTP 429) when the
   router already has ``max_pending_requests`` waiting for their first token, or when the pod it would prefill on
   has more queued prompt tokens than it prefills in ``max_queue_time_s`` (its own measured rate): shed now,
   rather than answer after the client gave up;
2. placing: the registry's routable pods (serving, not draining) go to the routing policy, which returns a
   ``RoutePlan``: a decode pod D, and a prefill pod P unless the prompt is short or mostly cached on D
   (conditional disaggregation);
3. first token: disaggregated, ``P.Prefill(decode_address=D)`` prefills, pushes the KV to D and returns the
   first token; then ``D.Decode(first_token)`` is opened. Prefilling on D, ``D.Decode`` without a first token
   prefills there and its first chunk holds the first token. A failure before the first token (a pod gone, full
   or draining, P's push to D failing, corrupt or late) is retried on other pods, ``max_retries`` times; when
   every prefill pod failed, the retry prefills on the decode pod;
4. streaming: each chunk's tokens go through the request's ``IncrementalDetokenizer`` and out as an
   ``OutputDelta``; the first one's moment is the TTFT. A stop string ends the request here: the router stops
   reading and cancels D's stream, which makes D abort the request and free its blocks. If D goes away
   mid-stream, the request migrates: another decode pod prefills the prompt and the tokens already sent
   (``resume_token_ids``) and goes on from there, ``max_migrations`` times; the client sees every token once;
5. the end: exactly one ``Completion`` (finish reason, usage, where the time went), always the last item.

While a request runs, the router counts it on its pods (``PodInfo.active_requests``, ``queued_prompt_tokens``,
``blocks_since_report``), so that placement sees its own newest requests before the pods' next load reports do.

Errors: before any output, ``generate`` raises ``StatusError`` (no pod: UNAVAILABLE; pods full or queues too
long: RESOURCE_EXHAUSTED; timeout: DEADLINE_EXCEEDED; ...). A pod's own CANCELLED (it was shutting down) is
UNAVAILABLE here: only the client's own cancellation is CANCELLED. After output started, a failure that migration
cannot mend ends the stream with ``Completion(finish_reason="error", error=...)`` and a log line.
``abort(request_id)`` and a client that stops iterating (generator closed, task cancelled) cancel the pod
calls; an aborted request still ends with ``Completion(finish_reason="abort")``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, TypeVar

import grpc

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from protos.convert import finish_reason_from_proto, sampling_params_to_proto, token_logprob_to_dict
from protos.splitserve.v1 import decode_pb2, prefill_pb2
from router.config import RouterConfig
from router.pod_client import PodClient, PodClientPool
from router.pod_monitor import PodMonitor
from router.policies import LocalPrefill, RoutePlan, RoutingPolicy, blocks_for, make_policy
from router.registry import PodInfo, PodRegistry, RedisRegistry, StaticRegistry
from runtime.errors import StatusError, from_rpc_error
from runtime.metrics import RouterMetrics
from runtime.registry import RegistryKind

log = logging.getLogger(__name__)
T = TypeVar("T")

# Before the first token, worth another pair of pods: the pod is gone, full or draining, or P could not hand the
# KV to D (refused, corrupt, or past the transfer's own deadline while the request still has time).
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS,
                   grpc.StatusCode.DEADLINE_EXCEEDED)
# After output started, a stream that broke this way moves to another decode pod.
MIGRATABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@dataclass
class RouterRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    timeout_s: float | None = None  # arrival to last token; None: the router's request_timeout_s


@dataclass
class OutputDelta:
    """New output since the previous delta. ``text`` may lag ``token_ids`` (a character or a possible stop
    string still incomplete); the concatenated deltas give the full text."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per token (protos/convert.py)


@dataclass
class Completion:
    """The request ended; the last item of ``generate``."""

    finish_reason: FinishReason
    stop_reason: int | str | None  # the stop token id or stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float]  # seconds: queue, prefill, kv_transfer, ttft, e2e
    error: StatusError | None = None  # what went wrong, when finish_reason is "error"


@dataclass
class _PodHold:
    """One request counted on one pod (``PodInfo``'s router-side load) until released."""

    pod: PodInfo
    prompt_tokens: int  # counted in pod.queued_prompt_tokens until the first token (or the end)
    released: bool = False

    def prompt_done(self) -> None:
        self.pod.queued_prompt_tokens -= self.prompt_tokens
        self.prompt_tokens = 0

    def release(self) -> None:
        if not self.released:
            self.prompt_done()
            self.pod.active_requests -= 1
            self.released = True


@dataclass
class _RequestRun:
    """One request in flight: its pod calls (to cancel), its text state, and its progress (for the metrics)."""

    request: RouterRequest
    detokenizer: IncrementalDetokenizer
    calls: list[Any] = field(default_factory=list)  # grpc.aio calls started for it
    holds: list[_PodHold] = field(default_factory=list)  # where it is counted
    aborted: bool = False
    finish_reason: FinishReason | None = None  # set once its Completion is made
    kv_sent_to: list[PodInfo] = field(default_factory=list)  # decode pods a prefill pod was asked to push its KV to
    output_token_ids: list[int] = field(default_factory=list)  # every token the client has been sent
    first_token_at: float | None = None
    last_token_at: float | None = None
    cached_tokens: int = 0
    # What the pod that prefilled reported, in seconds: queue, prefill and (disaggregated) kv_transfer.
    # Missing when that report never came (a stop string ended a request prefilled on D before D's summary).
    pod_timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def track(self, call: Any) -> Any:
        self.calls.append(call)
        return call

    def cancel_calls(self) -> None:
        for call in self.calls:
            call.cancel()  # a no-op for calls already done

    def hold(self, pod: PodInfo, prompt_tokens: int = 0, kv_tokens: int = 0) -> _PodHold:
        """Count this request on ``pod`` (until ``release_holds``): one more request in flight there, with
        ``prompt_tokens`` to prefill and the KV of ``kv_tokens`` about to take its blocks."""
        pod.active_requests += 1
        pod.queued_prompt_tokens += prompt_tokens
        pod.blocks_since_report += blocks_for(kv_tokens, pod) if kv_tokens else 0
        hold = _PodHold(pod, prompt_tokens)
        self.holds.append(hold)
        return hold

    def release_holds(self) -> None:
        for hold in self.holds:
            hold.release()
        self.holds.clear()


@dataclass
class _DecodeStream:
    """D's Decode call, with the messages already taken from it (or made from P's first token)."""

    call: Any
    pod: PodInfo
    hold: _PodHold  # the request counted on D while the stream lasts
    prefetched: list[decode_pb2.DecodeResponse]

    @property
    def pod_address(self) -> str:
        return self.pod.address


class Router:
    """Validates, tokenizes and places requests on prefill/decode pods; streams their output back as text."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 registry: PodRegistry | None = None, metrics: RouterMetrics | None = None,
                 policy: RoutingPolicy | None = None):
        self.config = config
        self.model_name = config.model
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config.model)
        self.metrics = metrics if metrics is not None else RouterMetrics(config.model)
        self.pod_clients = PodClientPool(config.tls)
        self.registry = registry if registry is not None else self._build_registry()
        self.policy = policy if policy is not None else make_policy(config.policy, LocalPrefill(
            config.conditional_prefill_threshold, config.conditional_cached_fraction, config.conditional_prefill_queue_s))
        self._runs: dict[str, _RequestRun] = {}
        self._num_pending = 0  # requests admitted that have no first token yet
        self._background: set[asyncio.Task] = set()  # Aborts sent to pods for requests already ended
        self._text_workers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        _encode_without_holding_the_gil(self.tokenizer)

    async def start(self) -> None:
        await self.registry.start()

    async def stop(self) -> None:
        for request_id in list(self._runs):  # requests still running end as aborted
            await self.abort(request_id)
        await self.registry.stop()
        await self.pod_clients.close()
        self._text_workers.shutdown(wait=False, cancel_futures=True)

    def ready(self) -> bool:
        """Whether a request could be placed now: some decode-capable pod serves and is not draining."""
        return bool(self.registry.decode_pods())

    def pods(self) -> list[dict[str, Any]]:
        """The pods as the router sees them now (``GET /pods``): role, whether it routes to them, their load."""
        now = time.monotonic()
        return [{"address": pod.address, "role": str(pod.role), "healthy": pod.healthy, "serving": pod.serving,
                 "seconds_since_report": round(now - pod.load_at, 3) if pod.load_at else None,
                 "load": dataclasses.asdict(pod.load), "cached_blocks": len(pod.block_hashes),
                 "router_requests": pod.active_requests, "router_queued_prompt_tokens": pod.queued_prompt_tokens}
                for pod in sorted(self.registry.pods.values(), key=lambda pod: (pod.role, pod.address))]

    def _build_registry(self) -> PodRegistry:
        config = self.config
        watch = dict(monitor_factory=self._monitor, on_change=self._pod_changed, on_leave=self._pod_left)
        if config.registry is RegistryKind.REDIS:
            return RedisRegistry(config.redis_url, config.pod_ttl_s, **watch)
        return StaticRegistry(config.prefill_pods, config.decode_pods, config.mixed_pods, **watch)

    def _monitor(self, pod: PodInfo) -> PodMonitor:
        return PodMonitor(pod, self.pod_clients.get(pod.address, pod.role), self.registry.on_change)

    def _pod_changed(self, pod: PodInfo) -> None:
        labels = (self.metrics.role, self.model_name, pod.address, str(pod.role))
        metrics, load = self.metrics, pod.load
        metrics.pod_healthy.labels(*labels).set(1 if pod.healthy else 0)
        metrics.pod_running.labels(*labels).set(load.num_running)
        metrics.pod_waiting.labels(*labels).set(load.num_waiting)
        metrics.pod_queued_prefill_tokens.labels(*labels).set(load.queued_prefill_tokens)
        if load.total_kv_blocks:
            metrics.pod_kv_cache_usage.labels(*labels).set(1 - load.free_kv_blocks / load.total_kv_blocks)

    def _pod_left(self, pod: PodInfo) -> None:
        self.metrics.forget_pod(pod.address, str(pod.role))

    # -- the edge: text in ------------------------------------------------------------------------------------
    # Cheap checks come first (sizes, counts), then the work they bound (rendering, tokenizing), which runs on
    # worker threads: a prompt at the byte limit takes about a second to tokenize, and the event loop serves
    # every other request (and /health) meanwhile.

    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """``text``'s token ids, once it passed the byte limit; ``field`` names it in errors."""
        self._check_text(text, field)
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int], field: str = "tokens") -> str:
        """The text of ``token_ids`` (special tokens included), which must be ids of the vocabulary."""
        if len(token_ids) > self.config.max_model_len:
            raise _invalid(f"{field}: {len(token_ids)} tokens, more than the model's context of "
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
            raise _invalid(f"chat_template_kwargs.{reserved[0]}: reserved; the server sets it")
        if continue_final_message and add_generation_prompt:
            raise _invalid("continue_final_message: cannot be combined with add_generation_prompt; set "
                           "add_generation_prompt to false to continue the final message")
        size = sum(_utf8_length(str(m.get("content", "")), f"messages[{i}].content") for i, m in enumerate(messages))
        if size > self.config.max_prompt_bytes:
            raise _invalid(f"messages: {size} bytes of content, more than the limit of "
                           f"{self.config.max_prompt_bytes} bytes (max_prompt_bytes)")
        return await self._off_loop(self._render_chat, messages, add_generation_prompt, continue_final_message,
                                    template_kwargs)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
                     template_kwargs: dict[str, Any]) -> str:
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        **template_kwargs)
        except Exception as exc:  # no template, jinja2 errors, raise_exception() in a template: bad messages
            raise _invalid(f"messages: {exc}") from exc
        if not continue_final_message:
            return prompt
        final = str(messages[-1].get("content", "")).strip() if messages else ""
        at = prompt.rfind(final) if final else -1
        if at < 0:
            raise _invalid("messages: continue_final_message needs a final message with content that the chat "
                           "template renders as is")
        return prompt[:at + len(final)]

    async def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                           add_special_tokens: bool = True, timeout_s: float | None = None) -> RouterRequest:
        """A validated request; unset ``max_tokens`` becomes the room left in the context (at most
        ``max_tokens_limit``). ``timeout_s``: the client's own deadline, when it has one (the request's deadline
        is the shorter of it and ``request_timeout_s``). Raises ``StatusError(INVALID_ARGUMENT)`` naming what is
        wrong."""
        arrival = time.monotonic()  # tokenizing is part of what the client waits for
        if request_id is not None:
            check_request_id(request_id, "request_id")
        params = self._checked_params(params)
        if isinstance(prompt, str):
            token_ids = await self.tokenize(prompt, add_special_tokens)
        else:
            token_ids = list(prompt)
        self._check_prompt(token_ids)
        params = self._with_max_tokens(params, len(token_ids))
        timeout = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        return RouterRequest(request_id or uuid.uuid4().hex, token_ids, params,
                             prompt_text=prompt if isinstance(prompt, str) else None, arrival_time=arrival,
                             timeout_s=timeout)

    def _checked_params(self, params: SamplingParams) -> SamplingParams:
        """The request's parameters within the server's limits (``SamplingParams`` checked the rest)."""
        config = self.config
        if len(params.stop) > config.max_stop_strings:
            raise _invalid(f"stop: {len(params.stop)} stop strings, more than the limit of {config.max_stop_strings} "
                           f"(max_stop_strings)")
        for i, stop in enumerate(params.stop):
            if _utf8_length(stop, f"stop[{i}]") > config.max_stop_string_bytes:
                raise _invalid(f"stop[{i}]: {len(stop.encode())} bytes, more than the limit of "
                               f"{config.max_stop_string_bytes} bytes per stop string (max_stop_string_bytes)")
        if len(params.stop_token_ids) > config.max_stop_token_ids:
            raise _invalid(f"stop_token_ids: {len(params.stop_token_ids)} ids, more than the limit of "
                           f"{config.max_stop_token_ids} (max_stop_token_ids)")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logprobs is not None and params.logprobs > config.max_logprobs:
            raise _invalid(f"logprobs: must be <= {config.max_logprobs} (max_logprobs), got {params.logprobs}")
        if params.max_tokens is not None and params.max_tokens > config.output_token_limit:
            raise _invalid(f"max_tokens: must be <= {config.output_token_limit} (max_tokens_limit), got "
                           f"{params.max_tokens}")
        if params.top_k > self.tokenizer.vocab_size:  # the same as no top-k filter; keeps the wire's int32
            params = dataclasses.replace(params, top_k=0)
        return params

    def _with_max_tokens(self, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
        room = self.config.max_model_len - prompt_tokens
        if params.max_tokens is None:
            max_tokens = min(room, self.config.output_token_limit)
            if params.min_tokens > max_tokens:
                raise _invalid(f"min_tokens: must be <= max_tokens, which is {max_tokens} when unset (the room "
                               f"left in the context, at most max_tokens_limit), got {params.min_tokens}")
            return dataclasses.replace(params, max_tokens=max_tokens)
        if params.max_tokens > room:
            raise _invalid(f"max_tokens: the prompt's {prompt_tokens} tokens + max_tokens {params.max_tokens} "
                           f"exceed the model's context of {self.config.max_model_len} tokens")
        return params

    def _check_text(self, text: str, field: str) -> None:
        # A str has at most as many characters as UTF-8 bytes: a text far over the limit is refused unencoded.
        limit = self.config.max_prompt_bytes
        if len(text) > limit or _utf8_length(text, field) > limit:
            raise _invalid(f"{field}: more than the limit of {limit} bytes (max_prompt_bytes)")

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise _invalid("prompt: must not be empty")
        limit = self.config.prompt_token_limit
        if len(token_ids) > limit:  # before looking at each id: a long list is refused at the cost of len()
            if limit == self.config.max_model_len - 1:
                raise _invalid(f"prompt: {len(token_ids)} tokens leave no room for output in the model's context "
                               f"of {self.config.max_model_len} tokens")
            raise _invalid(f"prompt: {len(token_ids)} tokens, more than the limit of {limit} (max_prompt_tokens)")
        self._check_token_ids(token_ids, "prompt")

    def _check_token_ids(self, token_ids: list[int], field: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        outside = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if outside:
            raise _invalid(f"{field}: token ids must be integers in [0, {vocab_size}), got {outside[:5]}")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._text_workers, fn, *args)

    # -- the request's path -----------------------------------------------------------------------------------

    async def generate(self, req: RouterRequest) -> AsyncIterator[OutputDelta | Completion]:
        if req.request_id in self._runs:
            raise _invalid(f"request_id: {req.request_id!r} is already in flight")
        params = req.params
        run = _RequestRun(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                                      params.stop, params.include_stop_str_in_output))
        self._runs[req.request_id] = run
        self._num_pending += 1
        self.metrics.num_requests_running.inc()
        try:
            async with aclosing(self._serve(run)) as outputs:
                async for output in outputs:
                    yield output
        except StatusError as error:  # refused before any output
            self.metrics.count(self.metrics.rejected, error.code.name)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if run.finish_reason is None:
                log.info("request %s: the client went away; cancelling its pod calls", req.request_id)
                self.metrics.finished(FinishReason.ABORT)
            raise
        finally:
            run.cancel_calls()
            if run.finish_reason in (None, FinishReason.ABORT):
                self._drop_pushed_kv(run)
            run.release_holds()
            if run.first_token_at is None:
                self._num_pending -= 1
            self.metrics.num_requests_running.dec()
            del self._runs[req.request_id]

    async def abort(self, request_id: str) -> bool:
        """Ends a request in flight with finish_reason "abort"; False if there is none with this id."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        run.aborted = True
        run.cancel_calls()  # the pods abort the request and free its blocks
        return True

    def _drop_pushed_kv(self, run: _RequestRun) -> None:
        """A request that ended early (the client went away, or aborted) may have left its KV on a decode pod: P
        pushed it, but the Decode call that claims it was never opened, or cancelled before D saw it. Cancelling P's
        call cannot take it back once D acknowledged it, and D would keep its blocks until the lease expires
        (kv_lease_s). So D is asked to drop it now (its Abort releases a lease; an unknown id is a no-op), in the
        background: the request's caller is not kept waiting."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a generator closed outside the event loop (garbage collected): the leases will do
            return
        for pod in run.kv_sent_to:
            task = loop.create_task(self._abort_on_pod(self.pod_clients.get(pod.address, pod.role),
                                                       run.request.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    async def _abort_on_pod(client: PodClient, request_id: str) -> None:
        try:
            await client.abort(request_id)
        except grpc.aio.AioRpcError as error:  # the pod is gone or busy: its lease frees the blocks anyway
            log.debug("request %s: Abort on the decode pod failed: %s", request_id, error.code().name)

    async def _serve(self, run: _RequestRun) -> AsyncIterator[OutputDelta | Completion]:
        self._admit(run)
        try:
            stream = await self._start_with_retries(run)
        except StatusError:
            if not run.aborted:
                raise
            yield self._complete(run, FinishReason.ABORT, None)
            return
        migrations_left = self.config.max_migrations
        while True:
            try:
                async for output in self._stream(run, stream):
                    yield output
                return
            except StatusError as error:
                stream.call.cancel()
                stream.hold.release()
                if run.aborted:
                    yield self._complete(run, FinishReason.ABORT, None)
                    return
                if error.code in MIGRATABLE_CODES and migrations_left > 0:
                    try:
                        stream = await self._migrate(run, stream.pod_address, error)
                        migrations_left -= 1
                        continue
                    except StatusError as failed:
                        error = failed
                log.error("request %s failed after %d output tokens: %s", run.request.request_id,
                          run.num_output_tokens, error.message)
                yield self._complete(run, FinishReason.ERROR, None, error)
                return

    # -- step 1: admission ------------------------------------------------------------------------------------

    def _admit(self, run: _RequestRun) -> None:
        """Shed load before any work: RESOURCE_EXHAUSTED (HTTP 429) with a hint of when to retry."""
        limit = self.config.max_pending_requests
        if limit and self._num_pending > limit:  # this request is counted already
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self._num_pending - 1} requests are already waiting for their first token (the "
                              f"router's max_pending_requests is {limit}); retry later",
                              retry_after_s=self._queue_wait_estimate())

    def _queue_wait_estimate(self) -> float:
        """Seconds until the least-queued prefilling pod would start a new prompt, from its measured rate."""
        pods = self.registry.prefill_pods() or self.registry.decode_pods()
        waits = [pod.prefill_wait_s for pod in pods]
        return min((w for w in waits if w is not None), default=1.0)

    def _check_queue_time(self, run: _RequestRun, plan: RoutePlan) -> None:
        limit = self.config.max_queue_time_s
        pod = plan.prefill or plan.decode
        wait = pod.prefill_wait_s
        if limit and wait is not None and wait > limit:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the least loaded pod would start this prompt in about {wait:.1f} s ({pod.queued_tokens} "
                              f"prompt tokens queued at {pod.load.prefill_tokens_per_second:.0f} tokens/s), past the "
                              f"router's max_queue_time_s ({limit:g} s); retry later", retry_after_s=wait - limit)

    # -- steps 2 and 3: placing the request and getting its first token ---------------------------------------

    async def _start_with_retries(self, run: _RequestRun) -> _DecodeStream:
        retries_left = self.config.max_retries
        avoid: set[str] = set()  # pods of failed attempts: the next attempt prefers others
        while True:
            plan = self._plan(run.request, avoid)
            self._check_queue_time(run, plan)
            try:
                return await self._start(run, plan)
            except StatusError as error:
                if error.code not in RETRYABLE_CODES or retries_left == 0 or run.aborted or self._out_of_time(run):
                    raise
                log.warning("request %s: %s; retrying on other pods", run.request.request_id, error.message)
                self.metrics.count(self.metrics.retries, error.code.name)
                retries_left -= 1
                avoid |= {pod.address for pod in (plan.prefill, plan.decode) if pod is not None}

    def _plan(self, req: RouterRequest, avoid: set[str]) -> RoutePlan:
        # Prefill pods that failed this request are left out, even if none remain: then D prefills the prompt.
        prefill = [pod for pod in self.registry.prefill_pods() if pod.address not in avoid]
        decode = _prefer_others(self.registry.decode_pods(), avoid)
        plan = self.policy.choose_pair(req, prefill, decode)
        log.debug("request %s: prefill %s, decode %s (%s)", req.request_id,
                  plan.prefill.address if plan.prefill else "-", plan.decode.address, plan.reason)
        return plan

    async def _start(self, run: _RequestRun, plan: RoutePlan) -> _DecodeStream:
        if run.aborted:
            raise StatusError(grpc.StatusCode.CANCELLED, "aborted")
        metrics = self.metrics
        metrics.count(metrics.routing_decisions, "prefill_on_decode" if plan.prefill is None else "disaggregated")
        for pod in (plan.prefill, plan.decode):
            if pod is not None:
                metrics.count(metrics.pod_requests, pod.address, str(pod.role))
        if plan.prefill is None:
            return await self._start_on_decode_pod(run, plan.decode)
        return await self._start_disaggregated(run, plan)

    async def _start_disaggregated(self, run: _RequestRun, plan: RoutePlan) -> _DecodeStream:
        num_prompt = len(run.request.prompt_token_ids)
        decode_hold = run.hold(plan.decode, kv_tokens=num_prompt)  # the KV lands there during the prefill
        run.kv_sent_to.append(plan.decode)
        prefill_hold = run.hold(plan.prefill, prompt_tokens=num_prompt)
        try:
            first = await self._prefill(run, plan)
        except BaseException:
            decode_hold.release()
            raise
        finally:
            prefill_hold.release()
        # The KV now waits on D under a lease: claim it at once. D's stream starts after the first token.
        decode_request = self._decode_request(run.request)
        decode_request.first_token_id = first.first_token_id
        first_chunk = decode_pb2.DecodeChunk(token_ids=[first.first_token_id])
        if first.HasField("first_token_logprob"):
            decode_request.first_token_logprob.CopyFrom(first.first_token_logprob)
            first_chunk.logprobs.tokens.append(first.first_token_logprob)
        decode_pod = self.pod_clients.get(plan.decode.address, plan.decode.role)
        decode_call = run.track(decode_pod.decode(decode_request, self._time_left(run.request)))
        return _DecodeStream(decode_call, plan.decode, decode_hold, [decode_pb2.DecodeResponse(chunk=first_chunk)])

    async def _prefill(self, run: _RequestRun, plan: RoutePlan) -> prefill_pb2.PrefillResponse:
        """P prefills the prompt and pushes its KV to D; P's report is the request's queue/prefill/transfer time."""
        req = run.request
        prefill_pod = self.pod_clients.get(plan.prefill.address, plan.prefill.role)
        call = run.track(prefill_pod.prefill(prefill_pb2.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            sampling_params=sampling_params_to_proto(req.params), decode_address=plan.decode.address,
            kv_codec=self.config.kv_codec, kv_lease_seconds=self.config.kv_lease_s,
        ), self._time_left(req)))
        first = await self._await_pod(run, call, plan.prefill.address)
        run.cached_tokens = first.num_cached_tokens
        run.pod_timings.update(queue=first.queue_seconds, prefill=first.prefill_seconds,
                               kv_transfer=first.kv_transfer.exposed_transfer_seconds)
        return first

    async def _start_on_decode_pod(self, run: _RequestRun, pod: PodInfo,
                                   resume_token_ids: list[int] = ()) -> _DecodeStream:
        """D prefills the prompt (and, for a migrated request, the tokens already sent) and streams the rest."""
        req = run.request
        hold = run.hold(pod, prompt_tokens=len(req.prompt_token_ids) + len(resume_token_ids),
                        kv_tokens=len(req.prompt_token_ids) + len(resume_token_ids))
        request = self._decode_request(req)
        request.resume_token_ids.extend(resume_token_ids)
        client = self.pod_clients.get(pod.address, pod.role)
        stream = _DecodeStream(run.track(client.decode(request, self._time_left(req))), pod, hold, [])
        # Its first message carries the next token: until it arrives, a failure may still be retried.
        try:
            stream.prefetched.append(await self._read(run, stream))
        except BaseException:
            hold.release()
            raise
        hold.prompt_done()
        return stream

    def _decode_request(self, req: RouterRequest) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                        sampling_params=sampling_params_to_proto(req.params))

    async def _migrate(self, run: _RequestRun, failed_address: str, error: StatusError) -> _DecodeStream:
        """Continue a request whose decode pod went away on another one, from the tokens the client has."""
        others = [pod for pod in self.registry.decode_pods() if pod.address != failed_address]
        if not others:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{error.message}; no other decode pod to continue the "
                              f"request on after {run.num_output_tokens} tokens")
        pod = self.policy.choose_decode(run.request.prompt_token_ids + run.output_token_ids, others)
        log.warning("request %s: %s after %d output tokens; migrating it to decode pod %s", run.request.request_id,
                    error.message, run.num_output_tokens, pod.address)
        self.metrics.migrations.inc()
        self.metrics.count(self.metrics.pod_requests, pod.address, str(pod.role))
        return await self._start_on_decode_pod(run, pod, list(run.output_token_ids))

    # -- pod calls --------------------------------------------------------------------------------------------

    async def _await_pod(self, run: _RequestRun, call: Any, pod_address: str) -> Any:
        """The call's result; its failure as a StatusError, and abort() (which cancels it) as CANCELLED."""
        try:
            return await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if run.aborted and current is not None and not current.cancelling():
                raise StatusError(grpc.StatusCode.CANCELLED, "aborted") from None
            raise  # the client went away: let the cancellation through
        except grpc.aio.AioRpcError as error:
            raise self._pod_error(run, error, pod_address) from None

    async def _read(self, run: _RequestRun, stream: _DecodeStream) -> decode_pb2.DecodeResponse:
        message = await self._await_pod(run, stream.call.read(), stream.pod_address)
        if message is grpc.aio.EOF:
            raise StatusError(grpc.StatusCode.INTERNAL,
                              f"pod {stream.pod_address}: the Decode stream ended without a complete message")
        return message

    def _pod_error(self, run: _RequestRun, error: grpc.aio.AioRpcError, pod_address: str) -> StatusError:
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._out_of_time(run):
            return StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"request {run.request.request_id} passed its {self._timeout_s(run.request):g} s "
                               f"deadline (waiting on pod {pod_address})")
        if code == grpc.StatusCode.CANCELLED:
            # Not ours (ours surfaces as asyncio.CancelledError): the pod cancelled it, shutting down.
            return StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"pod {pod_address} cancelled the request ({error.details() or 'shutting down'})")
        return from_rpc_error(error, pod_address)

    def _time_left(self, req: RouterRequest) -> float:
        left = req.arrival_time + self._timeout_s(req) - time.monotonic()
        if left <= 0:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {req.request_id} passed its {self._timeout_s(req):g} s deadline")
        return left

    def _out_of_time(self, run: _RequestRun) -> bool:
        return time.monotonic() >= run.request.arrival_time + self._timeout_s(run.request)

    def _timeout_s(self, req: RouterRequest) -> float:
        return self.config.request_timeout_s if req.timeout_s is None else req.timeout_s

    # -- steps 4 and 5: tokens to text, and the end -----------------------------------------------------------

    async def _stream(self, run: _RequestRun, stream: _DecodeStream) -> AsyncIterator[OutputDelta | Completion]:
        """D's messages as deltas, then the Completion; raises StatusError if the stream breaks."""
        while True:
            message = stream.prefetched.pop(0) if stream.prefetched else await self._read(run, stream)
            if message.HasField("complete"):
                tail = run.detokenizer.finish()  # text held back for a stop string that never came
                if tail:
                    yield OutputDelta([], tail)
                yield self._complete_from_pod(run, message.complete, stream.pod_address)
                return
            delta = self._take_chunk(run, message.chunk)
            if delta.token_ids or delta.text:
                yield delta
            if run.detokenizer.stopped_by is not None:
                stream.call.cancel()  # D aborts the request and frees its blocks
                yield self._complete(run, FinishReason.STOP, run.detokenizer.stopped_by)
                return

    def _take_chunk(self, run: _RequestRun, chunk: decode_pb2.DecodeChunk) -> OutputDelta:
        """The chunk's tokens as text, up to and including the token that completes a stop string."""
        token_ids, text = [], []
        for token_id in chunk.token_ids:
            token_ids.append(token_id)
            text.append(run.detokenizer.add(token_id))
            if run.detokenizer.stopped_by is not None:
                break  # D's tokens past the stop string are not the client's
        logprobs = None
        if run.request.params.logprobs is not None:
            logprobs = [token_logprob_to_dict(entry) for entry in chunk.logprobs.tokens[:len(token_ids)]]
        self._count_tokens(run, token_ids)
        return OutputDelta(token_ids, "".join(text), logprobs)

    def _count_tokens(self, run: _RequestRun, token_ids: list[int]) -> None:
        if not token_ids:
            return
        now = time.monotonic()
        if run.first_token_at is None:
            run.first_token_at = now
            self._num_pending -= 1
            self._observe_first_token(run)
        else:
            # One observation per chunk: a chunk is one decode step's output on D.
            self.metrics.inter_token_latency.observe(now - run.last_token_at)
        run.last_token_at = now
        run.output_token_ids.extend(token_ids)
        self.metrics.generation_tokens.inc(len(token_ids))

    def _observe_first_token(self, run: _RequestRun) -> None:
        self.metrics.time_to_first_token.observe(run.first_token_at - run.request.arrival_time)
        self.metrics.prompt_tokens.inc(len(run.request.prompt_token_ids))

    def _complete_from_pod(self, run: _RequestRun, complete: decode_pb2.DecodeComplete,
                           pod_address: str) -> Completion:
        if not run.pod_timings:  # no prefill pod reported: D prefilled, and its summary is the report
            run.cached_tokens = complete.usage.cached_tokens
            run.pod_timings.update(queue=complete.queue_seconds, prefill=complete.prefill_seconds)
        stop_reason = complete.stop_token_id if complete.HasField("stop_token_id") else None
        finish_reason = finish_reason_from_proto(complete.finish_reason)
        error = None
        if finish_reason is FinishReason.ERROR:
            error = StatusError(grpc.StatusCode.INTERNAL, f"pod {pod_address} ended the request with an error")
            log.error("request %s: %s", run.request.request_id, error.message)
        return self._complete(run, finish_reason, stop_reason, error)

    def _complete(self, run: _RequestRun, finish_reason: FinishReason, stop_reason: int | str | None,
                  error: StatusError | None = None) -> Completion:
        e2e = time.monotonic() - run.request.arrival_time
        ttft = run.first_token_at - run.request.arrival_time if run.first_token_at is not None else 0.0
        run.finish_reason = finish_reason
        self._observe_completion(run, finish_reason, e2e, ttft)
        return Completion(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=len(run.request.prompt_token_ids),
            completion_tokens=run.num_output_tokens,
            cached_tokens=run.cached_tokens,
            timings={"queue": 0.0, "prefill": 0.0, "kv_transfer": 0.0, **run.pod_timings, "ttft": ttft, "e2e": e2e},
            error=error,
        )

    def _observe_completion(self, run: _RequestRun, finish_reason: FinishReason, e2e: float, ttft: float) -> None:
        metrics = self.metrics
        metrics.finished(finish_reason)
        metrics.e2e_request_latency.observe(e2e)
        reported = {"queue": metrics.request_queue_time, "prefill": metrics.request_prefill_time,
                    "kv_transfer": metrics.kv_transfer_time}
        for name, seconds in run.pod_timings.items():
            reported[name].observe(seconds)
        tpot = (e2e - ttft) / (run.num_output_tokens - 1) if run.num_output_tokens > 1 else 0.0
        if run.num_output_tokens > 1:
            metrics.time_per_output_token.observe(tpot)
        answered = finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and run.first_token_at is not None
        if answered and ttft <= self.config.slo_ttft_s and tpot <= self.config.slo_tpot_s:
            metrics.requests_within_slo.inc()


def _prefer_others(pods: list[PodInfo], avoid: set[str]) -> list[PodInfo]:
    """Pods not in ``avoid`` (those that just failed this request), or all of them when no other is left."""
    return [pod for pod in pods if pod.address not in avoid] or pods


def _invalid(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


# Request ids travel in headers, logs and metadata: short and printable, no spaces.
MAX_REQUEST_ID_LENGTH = 128
# Variables the router gives every chat template itself; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def check_request_id(request_id: str, field: str) -> None:
    """Raises INVALID_ARGUMENT naming ``field`` unless ``request_id`` is 1 to 128 printable ASCII characters
    without spaces."""
    if not (0 < len(request_id) <= MAX_REQUEST_ID_LENGTH and all("!" <= c <= "~" for c in request_id)):
        raise _invalid(f"{field}: must be 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII characters without "
                       f"spaces, got {request_id[:MAX_REQUEST_ID_LENGTH + 1]!r}")


def _utf8_length(text: str, field: str) -> int:
    """``text``'s length in UTF-8; INVALID_ARGUMENT naming ``field`` for a lone surrogate (JSON's "\\ud800" parses
    to one, and no tokenizer or protobuf takes it)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise _invalid(f"{field}: not valid Unicode (a lone surrogate at character {exc.start})") from None


def _encode_without_holding_the_gil(tokenizer: Tokenizer) -> None:
    """Make ``tokenizer.encode`` let other threads run while it tokenizes.

    HF ``tokenizers``' single ``encode`` holds the GIL for the whole Rust call (1 MiB of text: ~1 s during which
    no other thread, the event loop included, runs); ``encode_batch`` releases it and gives the same ids. The
    engine's ``Tokenizer`` keeps its backend private, so the router swaps it here, once, for a wrapper that
    tokenizes one text as a batch of one. To be replaced by a GIL-free ``Tokenizer.encode`` in
    ``engine/tokenizer.py`` (its owner's file), after which this function goes."""
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


def _load_tokenizer(model: str) -> Tokenizer:
    # engine.model_files pulls in torch and the weight loaders; only a router that was not handed a tokenizer pays.
    from engine.model_files import load_tokenizer

    return load_tokenizer(model)
