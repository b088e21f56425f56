"""Structured outputs (guided decoding): a request's ``StructuredOutput`` -> an llguidance grammar -> one matcher
per sequence, whose token mask the sampler applies at every step.

    StructuredOutput (sampling_params.py)   what the client asked: JSON schema, regex, choice, grammar, JSON object
    -> grammar_text(spec)                   llguidance's grammar for it
    -> GrammarCompiler.check(spec)          compiled once, with the tokenizer, within ``GRAMMAR_LIMITS``: the
                                            router refuses a spec that does not compile before any pod works
    -> GrammarCompiler.matcher(spec)        a fresh ``LLMatcher``: the engine keeps one per sequence
                                            (``engine/structured_output/masks.py``), fed the sequence's output tokens

Why llguidance (not xgrammar): its wheel needs nothing but itself (xgrammar pulls torch's and transformers' pins
and Triton), it compiles a grammar lazily in about a millisecond (xgrammar precomputes per-grammar masks over the
vocabulary, which costs a JSON schema tens to hundreds of ms per new schema, every request of an extraction
workload bringing its own), its work is bounded by fuel limits (a pathological regex or schema fails to compile
within a bounded time instead of running away), and it computes a batch's masks on its own threads without the
GIL. It reads JSON schemas, regular expressions, Lark and llama.cpp's GBNF grammars.

No torch here: the router imports this module to check specs.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import llguidance

from splitserve.engine.sampling.params import StructuredOutput
from splitserve.engine.text.tokenizer import Tokenizer

# Bounds on the work one grammar may take (llguidance's fuel): compiling a pathological regex or schema ends in an
# error after about 20 ms of lexer work instead of running on; one step's mask is bounded likewise.
GRAMMAR_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                      max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)
# JSON's layout: spaces and newlines between tokens as the model likes to write them, but at most 20 in a row, so
# that a small model cannot spend its max_tokens on whitespace and leave the JSON unfinished.
_JSON_OPTIONS = {"whitespace_pattern": r"[\n ]{0,20}"}


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec``; ValueError for a JSON schema that is not JSON."""
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not JSON: {error}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", list(spec.choice))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        raise ValueError(f"the grammar does not parse: {error}") from None


@dataclass
class GrammarState:
    """One sequence's matcher (``Sequence.grammar``), and how many of its output tokens it has consumed."""

    matcher: llguidance.LLMatcher
    consumed: int = 0


class GrammarCompiler:
    """Grammars for one tokenizer. Building llguidance's view of the vocabulary takes about a second for a 49k
    vocabulary, so it is built once, on first use (a pod or router that never sees a structured request never
    pays it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the model's logits may have more rows than the tokenizer has tokens
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self._vocab_size,
                                                            eos_token=self._tokenizer.eos_token_ids)
            return self._ll_tokenizer

    def check(self, spec: StructuredOutput) -> None:
        """ValueError saying why, when ``spec`` does not compile (within ``GRAMMAR_LIMITS``)."""
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_text(spec), self.ll_tokenizer, limits=_limits())
        except ValueError:
            raise
        except Exception as exc:  # llguidance's own complaints about a spec (a schema that is not an object...)
            error = str(exc) or type(exc).__name__
        if error:
            raise ValueError(f"cannot compile the {_described(spec)}: {error.strip()}")

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the start of the output; in its error state (``is_error()``) if the grammar does not
        compile, which ``check`` tells the router before any pod sees the request."""
        try:
            grammar = grammar_text(spec)
        except ValueError:
            grammar = llguidance.LLMatcher.grammar_from_lark("start: %%%")  # does not compile: the error state
        return llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_limits())


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


def _described(spec: StructuredOutput) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]
