"""Hugging Face checkpoint directories <-> ``ModelConfig`` + state dict in our fused layout (parameter_layout.py).

- ``load_hf_checkpoint``: a ``transformers`` directory (config.json + model.safetensors, or sharded with
  model.safetensors.index.json) of an architecture the model registry serves (engine/model/architectures/: its
  ``model_type`` picks the entry, which reads the config or refuses it); they share transformers' Llama names, but
  for the parts an entry names otherwise (Gemma's four norms) or stores fused (Phi-3's q|k|v and gate|up as
  ``qkv_proj`` and ``gate_up_proj``, the entry's ``fused_checkpoint``: our own layout, taken and written whole), and
  an entry's norm offset (Gemma's 1 + w) is folded into the norm weights; a mixture of experts adds its own names of
  the router and each expert's tensors (hub names, or transformers 5.x's stacked ones).
- ``fuse_hf_state_dict``: the same mapping for tensors already in memory (a ``transformers`` model's state dict).
- ``export_hf_checkpoint``: the reverse, so that ``transformers`` can load exactly our weights as a reference
  implementation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures import registry
from splitserve.engine.model.architectures.architecture import window_keys
from splitserve.engine.weights.parameter_layout import StateDict, fuse, unfuse

# Each part of our layout (parameter_layout.py) as transformers names it (Llama, Mistral, Qwen2 and Qwen3 alike).
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
    "attn_out_norm": "model.layers.{i}.attn_out_norm.weight",  # no Llama checkpoint has these: an entry names them
    "mlp_out_norm": "model.layers.{i}.mlp_out_norm.weight",
}
# The fused parameters as Phi-3 stores them (rows q, k, v and gate, up, as ours).
HF_FUSED_NAMES = {
    "qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
}


def _offset_norms(tensors: dict[str, torch.Tensor], config: ModelConfig, sign: int) -> dict[str, torch.Tensor]:
    """``tensors`` with the architecture's norm offset added to (``sign`` 1) or taken from (-1) every norm weight, in
    float32 as transformers computes ``1.0 + weight.float()``: the folded weight is that product's factor, and
    ``w' - 1`` gives it back exactly when transformers adds 1 to it again."""
    offset = registry.for_model_config(config.architecture).norm_offset
    if not offset:
        return tensors
    return {n: t.float() + sign * offset if n.endswith("norm.weight") else t for n, t in tensors.items()}


# transformers 5.x's own names of a mixture-of-experts layer in memory (its ``state_dict``; the hub's per-expert names
# are what ``save_pretrained`` writes, the architecture's ``ExpertsFormat.hf_names``): the experts stacked [E, ...].
STACKED_EXPERTS = {
    "router": "model.layers.{i}.mlp.gate.weight",
    "gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",  # [E, 2 Ie, H]: each expert's gate rows, then up rows
    "down": "model.layers.{i}.mlp.experts.down_proj",  # [E, H, Ie]
}


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Each part of our layout as ``config``'s architecture names it in a hub checkpoint: the Llama names, but for
    the parts it stores fused (Phi-3) or names otherwise (Gemma's norms), and its experts' names."""
    entry = registry.for_model_config(config.architecture)
    return {**HF_NAMES, **(HF_FUSED_NAMES if entry.fused_checkpoint else {}), **dict(entry.hf_names),
            **({} if entry.experts is None else entry.experts.hf_names)}


def _unstack_experts(tensors: dict[str, torch.Tensor], config: ModelConfig, names: dict[str, str]) -> None:
    """Rename transformers' stacked expert tensors of ``tensors``, in place, to the hub's per-expert names."""
    for i in config.moe_layers:
        stacked = {part: name.format(i=i) for part, name in STACKED_EXPERTS.items()}
        if stacked["gate_up"] not in tensors:
            continue
        tensors[names["router"].format(i=i)] = tensors.pop(stacked["router"])
        gate_up, down = tensors.pop(stacked["gate_up"]), tensors.pop(stacked["down"])
        for e in range(config.num_experts):
            gate, up = gate_up[e].chunk(2)
            for part, tensor in (("expert_gate", gate), ("expert_up", up), ("expert_down", down[e])):
                tensors[names[part].format(i=i, e=e)] = tensor


def _read_hf_config(directory: Path) -> ModelConfig:
    hf = json.loads((directory / "config.json").read_text())
    return registry.for_hf_config(hf, str(directory)).model_config(hf, directory.name)


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


def fuse_hf_state_dict(tensors: dict[str, torch.Tensor], config: ModelConfig, source: str = "state dict",
                       dtype: str | torch.dtype = "float32") -> StateDict:
    """Our fused state dict from transformers' tensors of a registry architecture; every tensor must be used."""
    tensors = dict(tensors)
    # Old checkpoints store RoPE's inverse frequencies, which the model recomputes; tied ones may repeat the head.
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    names = hf_names(config)
    _unstack_experts(tensors, config, names)
    return fuse(_offset_norms(tensors, config, 1), names, config, source, dtype)


def load_hf_checkpoint(path: str | Path, dtype: str | torch.dtype = "float32") -> tuple[ModelConfig, StateDict]:
    """Config and fused state dict from a ``transformers`` checkpoint directory (a registry architecture)."""
    directory = Path(path)
    config = _read_hf_config(directory)
    tensors = _read_safetensors(_safetensors_files(directory))
    return config, fuse_hf_state_dict(tensors, config, str(directory), dtype)


def _hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    architecture = registry.for_model_config(config.architecture)
    if config.qkv_bias and not architecture.qkv_bias:
        raise ValueError(f"{config.name}: transformers' {architecture.hf_class} has no bias on q, k and v alone")
    return {
        **_core_hf_config(config, architecture),
        **(architecture.hf_config(config) if architecture.hf_config else {}),
        **({} if architecture.experts is None else architecture.experts.write(config)),
    }


def _core_hf_config(config: ModelConfig, architecture) -> dict[str, Any]:
    original = (config.rope_scaling or {}).get("original_max_position_embeddings")
    return {
        "architectures": [architecture.hf_class],
        "model_type": architecture.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        **({"original_max_position_embeddings": original} if original else {}),  # Phi-3 reads it outside the scaling
        "pad_token_id": None,  # Phi-3's config class would default to 32000, past a small vocabulary
        **window_keys(config),
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids or None,
        "torch_dtype": "float32",
    }


def export_hf_checkpoint(config: ModelConfig, state_dict: StateDict, path: str | Path) -> None:
    """Write ``path`` as a ``transformers`` directory (config.json + model.safetensors, unfused names)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _offset_norms(unfuse(state_dict, hf_names(config), config), config, -1)
    # Splits are views into the fused tensors; safetensors wants each tensor to own contiguous memory.
    save_file({name: t.detach().to(torch.float32).contiguous().clone() for name, t in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(_hf_config_dict(config), indent=2))
