"""``SamplingParams``: how one request wants its tokens chosen and when it wants to stop.

Fields and defaults follow vLLM's ``SamplingParams`` so that clients written for vLLM's APIs work unchanged.
Every field is checked in ``__post_init__``: a bad value raises ``ValueError`` whose message starts with the
field's name and says the allowed range, so the router can return it as ``INVALID_ARGUMENT`` / 400 as is.

This module imports no torch: the router builds and validates these before any engine is involved.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is decoded greedily (vLLM's threshold): dividing logits by a smaller
# number overflows or leaves a distribution indistinguishable from argmax.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # seeds are fed to 63-bit generator keys


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; only 1 is supported
    temperature: float = 1.0  # 0 (or < 1e-5) is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single str is accepted and wrapped
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many tokens are out
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (plus the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        self._check_ranges()
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.repetition_penalty = float(self.repetition_penalty)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

    def _check_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _require_number(name, getattr(self, name))
        for name in ("n", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)

    def _check_ranges(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (several samples per prompt are not supported), got {self.n}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty, got an empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field (for the wire between router and pods)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "SamplingParams":
        """Inverse of ``to_dict``; missing fields take their defaults, unknown ones are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**fields)


def _require_int(name: str, value: Any) -> None:
    # bool is a subclass of int in Python; True as a token count or seed is a client bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
