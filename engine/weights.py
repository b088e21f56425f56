"""Weight files -> ``ModelConfig`` + state dict in our fused layout, and back to a Hugging Face directory.

Our ``LlamaForCausalLM`` (engine/model.py) fuses Q, K and V into one ``qkv_proj`` (rows: q, then k, then v) and
gate and up into one ``gate_up_proj`` (rows: gate, then up), so each layer does two matmuls where the checkpoint
has five. Every loader produces exactly these names:

    embed_tokens.weight                      [V, H]
    layers.{i}.input_norm.weight             [H]
    layers.{i}.attn.qkv_proj.weight          [(Hq + 2 Hkv) D, H]    (+ .bias when config.qkv_bias)
    layers.{i}.attn.o_proj.weight            [H, Hq D]
    layers.{i}.post_attn_norm.weight         [H]
    layers.{i}.mlp.gate_up_proj.weight       [2 I, H]
    layers.{i}.mlp.down_proj.weight          [H, I]
    norm.weight                              [H]
    lm_head.weight                           [V, H]                  (absent when tie_word_embeddings)

Sources:

- ``load_hf_checkpoint``: a ``transformers`` directory (config.json + model.safetensors, or sharded with
  model.safetensors.index.json), Llama / Qwen2 names.
- ``load_gguf``: a llama.cpp GGUF file (llama or qwen2 architecture), any quantization ``gguf`` can dequantize.
  llama.cpp's converter reorders Llama's Q and K rows for its interleaved RoPE; we undo that to get back the
  rotate-half layout our model and ``transformers`` use. Also returns the tokenizer the file carries.
- ``export_hf_checkpoint``: the reverse of ``load_hf_checkpoint``, so ``transformers`` can load exactly our
  weights as a reference implementation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.tokenizer import GGUFTokenizerData

StateDict = dict[str, torch.Tensor]

_HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GGUF_ARCHITECTURES = ("llama", "qwen2")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


def _fused_layer(take: Callable[[str], torch.Tensor], src: dict[str, str], i: int, config: ModelConfig) -> StateDict:
    """One decoder layer in our layout; ``src`` names the source tensors (``{i}`` stands for the layer)."""
    name = {key: pattern.format(i=i) for key, pattern in src.items()}
    prefix = f"layers.{i}."
    layer = {
        prefix + "input_norm.weight": take(name["input_norm"]),
        prefix + "attn.qkv_proj.weight": torch.cat([take(name[p] + ".weight") for p in ("q", "k", "v")]),
        prefix + "attn.o_proj.weight": take(name["o"]),
        prefix + "post_attn_norm.weight": take(name["post_attn_norm"]),
        prefix + "mlp.gate_up_proj.weight": torch.cat([take(name["gate"]), take(name["up"])]),
        prefix + "mlp.down_proj.weight": take(name["down"]),
    }
    if config.qkv_bias:
        layer[prefix + "attn.qkv_proj.bias"] = torch.cat([take(name[p] + ".bias") for p in ("q", "k", "v")])
    return layer


def _fuse(take: Callable[[str], torch.Tensor], src: dict[str, str], config: ModelConfig) -> StateDict:
    """The whole model in our layout, from source names: ``embed``, ``norm``, ``lm_head`` and the layer keys."""
    state = {"embed_tokens.weight": take(src["embed"])}
    for i in range(config.num_layers):
        state.update(_fused_layer(take, src, i, config))
    state["norm.weight"] = take(src["norm"])
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = take(src["lm_head"])
    return state


def _taker(tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    """Pops tensors by name, so that whatever is left at the end was not used."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"{source} lacks tensor {name!r}")
        return tensors.pop(name).to(dtype)

    return take


def _check_all_used(tensors: dict[str, torch.Tensor], source: str) -> None:
    if tensors:
        raise ValueError(f"{source} has tensors this loader does not map: {sorted(tensors)[:8]}")


# ---- Hugging Face directories -------------------------------------------------------------------------------

_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj",
    "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def _read_hf_config(directory: Path) -> ModelConfig:
    hf = json.loads((directory / "config.json").read_text())
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(f"{directory}: unsupported architecture {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}")
    return ModelConfig.from_hf_config(hf, name=directory.name)


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    return [single]


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_hf_checkpoint(path: str | Path, dtype: str | torch.dtype = "float32") -> tuple[ModelConfig, StateDict]:
    """Config and fused state dict from a ``transformers`` Llama/Qwen2 checkpoint directory."""
    directory = Path(path)
    config = _read_hf_config(directory)
    tensors = _read_safetensors(_safetensors_files(directory))
    # Old checkpoints store RoPE's inverse frequencies, which the model recomputes; tied ones may repeat the head.
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    state = _fuse(_taker(tensors, str(directory), _torch_dtype(dtype)), _HF_NAMES, config)
    _check_all_used(tensors, str(directory))
    return config, state


def _hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    # Our only biased variant (q, k, v biased; o not) is Qwen2's; Llama's attention_bias also biases o_proj.
    model_type = "qwen2" if config.qkv_bias else "llama"
    return {
        "architectures": [_HF_MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids or None,
        "torch_dtype": "float32",
    }


def _unfused_layer(state: StateDict, i: int, config: ModelConfig) -> StateDict:
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {
        hf + "input_layernorm.weight": state[ours + "input_norm.weight"],
        hf + "self_attn.o_proj.weight": state[ours + "attn.o_proj.weight"],
        hf + "post_attention_layernorm.weight": state[ours + "post_attn_norm.weight"],
        hf + "mlp.down_proj.weight": state[ours + "mlp.down_proj.weight"],
    }
    gate, up = state[ours + "mlp.gate_up_proj.weight"].split(config.intermediate_size)
    out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
    for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
        q, k, v = state[f"{ours}attn.qkv_proj.{kind}"].split([q_rows, kv_rows, kv_rows])
        for proj, tensor in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
            out[f"{hf}self_attn.{proj}.{kind}"] = tensor
    return out


def export_hf_checkpoint(config: ModelConfig, state_dict: StateDict, path: str | Path) -> None:
    """Write ``path`` as a ``transformers`` directory (config.json + model.safetensors, unfused names)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": state_dict["embed_tokens.weight"],
        "model.norm.weight": state_dict["norm.weight"],
    }
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = state_dict["lm_head.weight"]
    for i in range(config.num_layers):
        tensors.update(_unfused_layer(state_dict, i, config))
    # Splits are views into the fused tensors; safetensors wants each tensor to own contiguous memory.
    save_file({name: t.detach().to(torch.float32).contiguous().clone() for name, t in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(_hf_config_dict(config), indent=2))


# ---- GGUF files -----------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "input_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q",
    "k": "blk.{i}.attn_k",
    "v": "blk.{i}.attn_v",
    "o": "blk.{i}.attn_output.weight",
    "post_attn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """GGUF's rope.scaling.* keys, in the dict form of HF configs."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": _field(reader, f"{arch}.rope.scaling.factor", 1.0)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _gguf_config(
    reader: gguf.GGUFReader, arch: str, tensors: dict[str, torch.Tensor], tok: GGUFTokenizerData, name: str
) -> ModelConfig:
    hidden, heads = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden // heads)
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{name}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    return ModelConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],  # {arch}.vocab_size is optional; the embedding is not
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,  # llama.cpp drops the head when it is the embedding
        qkv_bias=arch == "qwen2",
        bos_token_id=tok.bos_token_id,
        eos_token_ids=list(tok.eos_token_ids),
        name=name,
    )


def _gguf_tokenizer_data(reader: gguf.GGUFReader) -> GGUFTokenizerData:
    eos_ids = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return GGUFTokenizerData(
        model=_field(reader, "tokenizer.ggml.model", "none"),
        pre=_field(reader, "tokenizer.ggml.pre", "default"),
        tokens=_field(reader, "tokenizer.ggml.tokens", []),
        token_types=_field(reader, "tokenizer.ggml.token_type", []),
        merges=_field(reader, "tokenizer.ggml.merges", []),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos_ids if i is not None)),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizerData:
    """Only the tokenizer a GGUF file carries, without reading its weights (what the router needs)."""
    return _gguf_tokenizer_data(gguf.GGUFReader(str(path)))


def _dequantized(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's [rows, cols] order (GGUF lists dims innermost first)."""
    # A plain in-memory copy: slicing the file's memmap row group by row group is twice as slow.
    values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
    shape = [int(d) for d in reversed(tensor.shape)]
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (within each head: pairs interleaved) back to HF's rotate-half order.

    The converter maps each head's rows [first half | second half] to [h0, s0, h1, s1, ...] (reshape to
    [heads, 2, D/2], swap the last two axes). Reading it back as [heads, D/2, 2] and swapping inverts it.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _unpermute_llama_qk(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    for i in range(config.num_layers):
        for proj, heads in (("attn_q", config.num_heads), ("attn_k", config.num_kv_heads)):
            for kind in ("weight", "bias"):
                name = f"blk.{i}.{proj}.{kind}"
                if name in tensors:
                    tensors[name] = _unpermute_rope_rows(tensors[name], heads)


def load_gguf(
    path: str | Path, dtype: str | torch.dtype = "float32"
) -> tuple[ModelConfig, StateDict, GGUFTokenizerData]:
    """Config, fused state dict and tokenizer vocabulary from a llama.cpp GGUF file (llama or qwen2)."""
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {list(_GGUF_ARCHITECTURES)}")
    tensors = {t.name: _dequantized(t) for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: per-dimension RoPE factors (rope_freqs, Llama 3.1 scaling) are not supported")
    if "token_embd.weight" not in tensors:
        raise KeyError(f"{path} lacks tensor 'token_embd.weight'")
    tokenizer_data = _gguf_tokenizer_data(reader)
    config = _gguf_config(reader, arch, tensors, tokenizer_data, Path(path).stem)
    if arch == "llama":  # qwen2 files are converted without the permutation
        _unpermute_llama_qk(tensors, config)
    state = _fuse(_taker(tensors, str(path), _torch_dtype(dtype)), _GGUF_NAMES, config)
    _check_all_used(tensors, str(path))
    return config, state, tokenizer_data
