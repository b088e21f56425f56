"""What a request gives its client, as ``Router.generate`` yields it: ``OutputDelta``s, then one ``Completion``.

``request_run.py`` makes them from D's stream; the API edges (``grpc_api.py``, ``openai/``) and ``choices.py``
read them. They live apart from the in-flight state machine so that the edges depend on the results alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.sequence import FinishReason, PromptLogprob
from splitserve.runtime.errors import StatusError


@dataclass
class OutputDelta:
    """New output since the previous delta. ``text`` may lag ``token_ids`` (a character or a possible stop
    string still incomplete); the concatenated deltas give the full text."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per token (protos/convert.py)
    # The prompt's logprobs (one per prompt token from the second on), in the first delta, when asked for.
    prompt_logprobs: list[PromptLogprob] | None = None


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
