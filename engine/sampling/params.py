"""``SamplingParams``: how one request wants its tokens chosen and when it wants to stop.

Fields and defaults follow vLLM's ``SamplingParams`` so that clients written for vLLM's APIs work unchanged.
Every field is checked in ``__post_init__``: a bad value raises ``ValueError`` whose message starts with the
field's name and says the allowed range, so the router can return it as ``INVALID_ARGUMENT`` / 400 as is.

This module imports no torch: the router builds and validates these before any engine is involved.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is decoded greedily (vLLM's threshold): dividing logits by a smaller
# number overflows or leaves a distribution indistinguishable from argmax.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # seeds are fed to 63-bit generator keys
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON schema (as JSON
    text), a regular expression, a choice of strings, a grammar (Lark or GBNF, as llguidance reads them), or any
    JSON object. ``engine/structured_output/grammar.py`` compiles it."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_output.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_output.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_output.{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be a bool, got {self.json_object!r}")
        if len(self.kinds) != 1:
            raise ValueError(f"structured_output must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {list(self.kinds) or 'none'}")

    @property
    def kinds(self) -> list[str]:
        """The constraints set (exactly one once constructed)."""
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return set_ + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self.kinds[0]


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt: the router runs each as a request of its own (``for_sample``)
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
    # top-N logprobs per prompt token from the second on (plus the prompt token's own, and its rank); None: none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token-level constraints, applied before the penalties (vLLM's order); ids are checked against the vocabulary
    # by the router, which knows it.
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled; None: any
    bad_words: list[str] = field(default_factory=list)  # text; the router turns it into bad_words_token_ids
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # never completed in the output
    structured_output: StructuredOutput | None = None  # the output must match it (guided decoding)

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
        self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}
        self.bad_words = list(self.bad_words)
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)

    def _check_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _require_number(name, getattr(self, name))
        for name in ("n", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
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
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a map of token ids to numbers, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            _require_int("logit_bias", token_id)
            _require_number("logit_bias", bias)
        if self.allowed_token_ids is not None:
            _require_int_list("allowed_token_ids", self.allowed_token_ids)
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if not isinstance(self.bad_words_token_ids, (list, tuple)):
            raise ValueError(f"bad_words_token_ids must be a list of token id lists, got {self.bad_words_token_ids!r}")
        for ids in self.bad_words_token_ids:
            _require_int_list("bad_words_token_ids", ids)
        if isinstance(self.structured_output, dict):  # from to_dict
            self.structured_output = StructuredOutput(**self.structured_output)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
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
        if self.max_tokens is not None and self.max_tokens < 0:
            # 0 scores the prompt: it is prefilled (for its prompt_logprobs) and nothing is generated.
            raise ValueError(f"max_tokens must be >= 0 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs}")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {token_id}: {bias}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got "
                             f"{self.allowed_token_ids}")
        if any(w.strip() == "" for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words, got an empty one")
        if self.structured_output is not None and (self.ignore_eos or self.min_tokens):
            # The grammar ends the output with EOS when it is complete; nothing may hold EOS back.
            raise ValueError("structured_output cannot be combined with ignore_eos or min_tokens")
        if any(not ids or min(ids) < 0 for ids in self.bad_words_token_ids):
            raise ValueError(f"bad_words_token_ids must be non-empty lists of token ids >= 0, got "
                             f"{self.bad_words_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constrains_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad words change the logits before sampling."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field (for the wire between router and pods)."""
        return dataclasses.asdict(self)

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample ``index`` of ``n``: one sample, and a seeded request's seed + index (vLLM v1's
        rule), so that seeded samples are the same as separate requests seeded seed, seed + 1, ..."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, n=1, seed=seed)

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> "SamplingParams":
        """A copy whose ``bad_words_token_ids`` also hold ``bad_words`` as ``encode`` (text -> ids, no special
        tokens) spells them: each word as it starts a text and, when that is a different token of the same length,
        after a space (vLLM's rule: a word is banned at the start and in the middle of the output)."""
        token_ids = []
        for word in self.bad_words:
            alone = encode(word.lstrip())
            if not alone:
                raise ValueError(f"bad_words must have tokens, got {word!r}")
            token_ids.append(alone)
            after_space = encode(" " + word.lstrip())
            if after_space[0] != alone[0] and len(after_space) == len(alone):
                token_ids.append(after_space)
        return dataclasses.replace(self, bad_words_token_ids=self.bad_words_token_ids + token_ids)

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


def _require_int_list(name: str, values: Any) -> None:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {values!r}")
    for value in values:
        _require_int(name, value)


def _require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
