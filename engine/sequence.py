"""A request inside the engine: its tokens, how many of them have KV in the cache, its blocks and its state.

Progress is tracked in tokens (as in vLLM v1): ``num_computed_tokens`` catches up with ``num_tokens``.
A sequence whose computed tokens reach the end of its known tokens samples the next token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.speculative.state import DraftState
    from splitserve.engine.structured_output.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class PromptLogprob:
    """The model's logprob of one prompt token given the tokens before it (vLLM's ``prompt_logprobs`` entry), from
    the raw distribution, as output logprobs are."""

    token_id: int  # the prompt's token at this position
    logprob: float
    rank: int  # its rank in the distribution at this position: 1 is the most probable token
    top: dict[int, float]  # the SamplingParams.prompt_logprobs most probable tokens -> logprob, most probable first


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are OpenAI's ``finish_reason`` and the ``finished_reason`` metric label
    (``protos/convert.py`` maps them to the wire's enum)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's context is full)
    ABORT = "abort"  # aborted by the client, a disconnect or an error
    ERROR = "error"  # failed after it started (a step that raised, a pod that went away)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    # Logprobs per output token: ({token_id: logprob} of the top-N plus the sampled token), or None.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: one entry per prompt token from the second on (the first has no context),
    # filled as the prompt's chunks are computed.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    # The blocks of the windowed layers' own pools (a model that mixes them with full-attention ones: kv_cache.py)
    window_block_table: list[int] = field(default_factory=list)
    # A scaled pool's block that holds the float16 keys of the block it is filling (engine/kv_formats/open_keys.py),
    # in the pool of block_table and in the window pool's; -1: none.
    open_block: int = -1
    window_open_block: int = -1
    # Its KV leaves for another pod as it is computed (a prefill pod's request): its prefix-cache hits then hold
    # every block they cover, those that left this pod's sliding windows too, since the receiver may keep more of the
    # prompt than this pod's windows do (engine/block_manager.py).
    exported: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # TPOT target of this request on a decode pod that lends its steps to prefills (engine/prefill_budget.py);
    # 0: the pod's default. last_token_time: time.monotonic() when its latest token here came out; tpot_anchor:
    # when its first token here came out (sampled, or brought by a prefilled request) and its output count then.
    tpot_target_s: float = 0.0
    last_token_time: float | None = None
    tpot_anchor: tuple[float, int] | None = None
    # vLLM's request priority: lower runs first (the waiting queue's order) and is preempted last; 0 by default.
    priority: int = 0
    # Speculative decoding (engine/speculative/proposer.py): tokens proposed for the next step, and the request's
    # proposer state (engine/speculative/state.py).
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: DraftState | None = None
    # Structured output (engine/structured_output/masks.py): the request's grammar matcher, made on its first guided
    # step.
    grammar: GrammarState | None = None
    # With SamplingParams.n > 1: the first tokens of samples 1..n-1 (token id, logprobs), drawn with the prompt's
    # first (seeds seed + i) from the same logits; a decode pod forks the sequence for each (engine/llm_engine.py).
    sample_first_tokens: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole prompt + output list (a decode step needs one)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some of the prompt's are still to compute."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def mark_token_time(self, now: float) -> None:
        """A token of this sequence came out here at ``now`` (its output so far includes it)."""
        self.last_token_time = now
        if self.tpot_anchor is None:
            self.tpot_anchor = (now, self.num_output_tokens)

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
