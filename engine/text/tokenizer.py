"""Text <-> token ids: the ``Tokenizer``. (Output text streams through detokenizer.py.)

``Tokenizer`` wraps a Hugging Face ``tokenizers.Tokenizer`` and adds what serving needs around it: BOS
handling, EOS ids, and chat templates rendered with jinja2 in a sandbox (as ``transformers`` does). It is built
either from a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``) or from the vocabulary a
GGUF file carries (``GGUFTokenizerData``, read by ``splitserve.engine.weights.gguf_file``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are plain added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split patterns of the byte-level BPE families, keyed by llama.cpp's ``tokenizer.ggml.pre``. Each must split
# text exactly as the original tokenizer did while its merges were learned, or ids drift from the reference.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PATTERNS = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
_GPT2_PRE = ("default", "gpt2")
_DIGITS_FIRST_PRE = ("smollm", "starcoder", "refact")


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE vocabulary, by llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST_PRE:
        # StarCoder's tokenizer (SmolLM inherits it) isolates every digit before the GPT-2 split: llama.cpp
        # writes this as the extra pattern "\p{N}" ahead of GPT-2's. Without it, whitespace before a digit
        # splits differently ("  1" is "ĠĠ" "1" here, "Ġ" "Ġ" "1" with GPT-2's pattern alone).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre not in _SPLIT_PATTERNS:
        supported = sorted([*_GPT2_PRE, *_DIGITS_FIRST_PRE, *_SPLIT_PATTERNS])
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {supported}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass
class GGUFTokenizerData:
    """A byte-level BPE vocabulary as a GGUF file stores it (``tokenizer.ggml.*`` and ``tokenizer.chat_template``)."""

    model: str  # tokenizer.ggml.model; only "gpt2" (byte-level BPE) is supported
    pre: str  # tokenizer.ggml.pre: which split pattern the merges were learned with
    tokens: list[str]  # spelled in GPT-2's byte-to-unicode alphabet
    token_types: list[int]
    merges: list[str]  # "left right", best first
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # tokenizer.ggml.eos_token_id, then eot/eom if present
    add_bos_token: bool = False
    chat_template: str | None = None


def _build_byte_level_bpe(data: GGUFTokenizerData) -> BackendTokenizer:
    if data.model != "gpt2":
        raise ValueError(f"unsupported tokenizer.ggml.model {data.model!r}; only 'gpt2' (byte-level BPE) is supported")
    vocab = {token: token_id for token_id, token in enumerate(data.tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in data.merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(data.pre)
    backend.decoder = decoders.ByteLevel()
    # CONTROL tokens must match whole in the text ("<|im_start|>" is one id) and are skipped by
    # skip_special_tokens; USER_DEFINED tokens match whole but are ordinary text.
    typed = list(zip(data.tokens, data.token_types))
    control = [AddedToken(t, special=True, normalized=False) for t, k in typed if k == _TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(t, special=False, normalized=False) for t, k in typed if k == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return backend


def _special_token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """Newer ``transformers`` save the template as chat_template.jinja; older ones inside tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _raise_template_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _chat_template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment ``transformers`` renders chat templates in, so templates written for it behave the same."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    # jinja2's own tojson HTML-escapes; templates expect plain JSON (tool schemas in prompts).
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.x templates date the prompt
    return env


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, data: GGUFTokenizerData) -> "Tokenizer":
        return cls(
            _build_byte_level_bpe(data),
            bos_token_id=data.bos_token_id,
            eos_token_ids=list(data.eos_token_ids),
            add_bos_token=data.add_bos_token,
            chat_template=data.chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From ``tokenizer.json``, ``tokenizer_config.json`` and, when present, ``generation_config.json``."""
        directory = Path(path)
        if not (directory / "tokenizer.json").exists():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        bos_text = _special_token_text(config.get("bos_token"))
        eos_text = _special_token_text(config.get("eos_token"))
        # generation_config.json may name more stop ids (Llama 3: <|eot_id|> and <|end_of_text|>).
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        eos_ids = [] if eos_text is None else [backend.token_to_id(eos_text)]
        eos_ids += [generation_eos] if isinstance(generation_eos, int) else generation_eos or []
        return cls(
            backend,
            bos_token_id=None if bos_text is None else backend.token_to_id(bos_text),
            eos_token_ids=list(dict.fromkeys(token_id for token_id in eos_ids if token_id is not None)),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=_read_chat_template(directory, config),
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def backend_json(self) -> str:
        """The HF ``tokenizers`` definition as JSON (what llguidance builds its view of the vocabulary from)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # A tokenizer.json post-processor may already add BOS (Llama 2/3); never add it twice.
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) to the prompt text the model was trained on."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _chat_template_environment().from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **extra,
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""
