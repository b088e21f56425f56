"""llama.cpp GGUF files -> ``ModelConfig`` + state dict in our fused layout (parameter_layout.py) + tokenizer.

- ``load_gguf``: a GGUF architecture the model registry reads (engine/model/architectures/: llama, which Mistral
  files are written as too, qwen2, qwen3, phi3 with its fused ``attn_qkv`` and ``ffn_up``, qwen3moe: its stacked
  experts split per expert, still in their blocks), any quantization ``gguf`` can dequantize. llama.cpp's converter
  reorders Llama's Q and K rows for its interleaved RoPE (the entry's ``gguf_qk_permuted``); we undo that to get back
  the rotate-half layout our model and ``transformers`` use. Also returns the tokenizer the file carries
  (``GGUFTokenizerData``). With ``keep_blocks`` (``quantization="gguf"``), matrices stored as Q4_0, Q4_1 or Q8_0 stay
  in the file's blocks (``BlockQuantized``, engine/weights/quantized_weights.py) instead of being widened. Reading
  only that tokenizer, without torch or the weights, is ``splitserve.engine.text.tokenizer_files``'s.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures import registry
from splitserve.engine.model.architectures.architecture import Architecture
from splitserve.engine.text.tokenizer import GGUFTokenizerData
from splitserve.engine.text.tokenizer_files import gguf_field, gguf_tokenizer_data
from splitserve.engine.weights.parameter_layout import StateDict, fuse
from splitserve.engine.weights.quantized_weights import GGUF_TYPES, BlockQuantized

# Each part of our layout (parameter_layout.py) as llama.cpp names it.
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "input_norm": "blk.{i}.attn_norm.weight",
    "q.weight": "blk.{i}.attn_q.weight",
    "k.weight": "blk.{i}.attn_k.weight",
    "v.weight": "blk.{i}.attn_v.weight",
    "q.bias": "blk.{i}.attn_q.bias",
    "k.bias": "blk.{i}.attn_k.bias",
    "v.bias": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
    "o": "blk.{i}.attn_output.weight",
    "post_attn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    # A mixture of experts (qwen3moe): the router, and each expert's matrix of the stacked [E, rows, cols] tensors,
    # which the loader names by their expert ("blk.{i}.ffn_gate_exps.weight.{e}", ``_read_experts``).
    "router": "blk.{i}.ffn_gate_inp.weight",
    "expert_gate": "blk.{i}.ffn_gate_exps.weight.{e}",
    "expert_up": "blk.{i}.ffn_up_exps.weight.{e}",
    "expert_down": "blk.{i}.ffn_down_exps.weight.{e}",
}
# The fused parameters as llama.cpp's phi3 stores them (rows q, k, v and gate, up, as ours).
GGUF_FUSED_NAMES = {"qkv.weight": "blk.{i}.attn_qkv.weight", "gate_up": "blk.{i}.ffn_up.weight"}


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    """GGUF's rope.scaling.* keys, in the dict form of HF configs."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": gguf_field(reader, f"{arch}.rope.scaling.factor", 1.0)}
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _gguf_config(
    reader: gguf.GGUFReader, architecture: Architecture, tensors: dict[str, torch.Tensor], tok: GGUFTokenizerData,
    name: str
) -> ModelConfig:
    """The Llama core's shape from ``{arch}.*`` keys; the registry entry adds its features."""
    arch = architecture.gguf_name
    hidden, heads = gguf_field(reader, f"{arch}.embedding_length"), gguf_field(reader, f"{arch}.attention.head_count")
    head_dim = gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)
    rotary_dim = gguf_field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{name}: partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    config = architecture.resolve(ModelConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],  # {arch}.vocab_size is optional; the embedding is not
        hidden_size=hidden,
        intermediate_size=gguf_field(reader, f"{arch}.feed_forward_length"),
        num_layers=gguf_field(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=gguf_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=gguf_field(reader, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=gguf_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,  # llama.cpp drops the head when it is the embedding
        bos_token_id=tok.bos_token_id,
        eos_token_ids=list(tok.eos_token_ids),
        name=name,
    ))
    if architecture.experts is None:
        return config
    return replace(config, **_gguf_experts(reader, arch, tensors, config.num_layers))


def _entry_reading(reader: gguf.GGUFReader, architecture: Architecture, config: ModelConfig,
                   path: str | Path) -> ModelConfig:
    """``config`` as the entry reads what a GGUF file says of the keys it reads from a config.json: its refusals, and
    a sliding window (llama.cpp's phi3 writes Phi-3-mini-4k's 2047) against the context, which its ``configure`` turns
    into the layers' windows."""
    asked = {"model_type": architecture.model_type,
             "sliding_window": gguf_field(reader, f"{architecture.gguf_name}.attention.sliding_window"),
             "max_position_embeddings": config.max_position_embeddings}
    problem = next((p for p in (check(asked) for check in architecture.refuse) if p), None)
    if problem:
        raise ValueError(f"{path}: {architecture.gguf_name} with {problem} is not supported (docs/models.md)")
    return architecture.configure(asked, config) if architecture.configure else config


def _read(tensor: gguf.ReaderTensor, keep_blocks: bool) -> torch.Tensor | BlockQuantized:
    """A GGUF tensor as float32 in PyTorch's [rows, cols] order (GGUF lists dims innermost first), or, with
    ``keep_blocks``, in its own blocks where it is a matrix in a format the kernels run."""
    format = GGUF_TYPES.get(int(tensor.tensor_type))
    if keep_blocks and format is not None and len(tensor.shape) == 2:
        return BlockQuantized.from_gguf(np.array(tensor.data), format)
    return _dequantized(tensor)


def _read_experts(tensor: gguf.ReaderTensor, keep_blocks: bool) -> list[torch.Tensor | BlockQuantized]:
    """A stacked experts tensor ([E, rows, cols] in PyTorch's order) as one matrix per expert, each kept in the
    file's blocks as ``_read`` keeps a matrix (the blocks run along a row, so an expert's rows are whole)."""
    format = GGUF_TYPES.get(int(tensor.tensor_type))
    if keep_blocks and format is not None:
        return [BlockQuantized.from_gguf(expert, format) for expert in np.array(tensor.data)]
    return list(_dequantized(tensor).unbind(0))


def _gguf_experts(reader: gguf.GGUFReader, arch: str, tensors: dict, num_layers: int) -> dict[str, Any]:
    """A mixture of experts' ``ModelConfig`` fields from ``{arch}.expert_*`` keys; its routed layers are those with
    a router (``ffn_gate_inp``). The top-k weights are renormalized unless ``expert_weights_norm`` says otherwise
    (llama.cpp's qwen3moe always renormalizes, as the released Qwen3-MoE configs do)."""
    width = gguf_field(reader, f"{arch}.expert_feed_forward_length")  # (Mixtral's: its feed_forward_length)
    return dict(num_experts=gguf_field(reader, f"{arch}.expert_count"),
                num_experts_per_tok=gguf_field(reader, f"{arch}.expert_used_count"),
                moe_intermediate_size=width or gguf_field(reader, f"{arch}.feed_forward_length"),
                norm_topk_prob=bool(gguf_field(reader, f"{arch}.expert_weights_norm", True)),
                moe_layers=[i for i in range(num_layers) if GGUF_NAMES["router"].format(i=i) in tensors])


def _dequantized(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's [rows, cols] order (GGUF lists dims innermost first)."""
    # A plain in-memory copy: slicing the file's memmap row group by row group is twice as slow.
    values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
    shape = [int(d) for d in reversed(tensor.shape)]
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def _unpermute_rope_rows(weight: torch.Tensor | BlockQuantized, num_heads: int) -> torch.Tensor | BlockQuantized:
    """Undo llama.cpp's Q/K row order (within each head: pairs interleaved) back to HF's rotate-half order.

    The converter maps each head's rows [first half | second half] to [h0, s0, h1, s1, ...] (reshape to
    [heads, 2, D/2], swap the last two axes). Reading it back as [heads, D/2, 2] and swapping inverts it.
    """
    if isinstance(weight, BlockQuantized):  # whole rows move: a row's blocks, scales and minimums with it
        return weight.map_rows(lambda t: _unpermute_rope_rows(t, num_heads))
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _unpermute_llama_qk(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    for i in range(config.num_layers):
        for part, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
            for kind in ("weight", "bias"):
                name = GGUF_NAMES[f"{part}.{kind}"].format(i=i)
                if name in tensors:
                    tensors[name] = _unpermute_rope_rows(tensors[name], heads)


def gguf_architecture(reader: gguf.GGUFReader, source: str) -> Architecture:
    """The registry's entry for the file: its ``general.architecture``, and whether it has experts (llama.cpp writes
    Mixtral as ``llama`` with ``llama.expert_count``)."""
    name = gguf_field(reader, "general.architecture")
    return registry.for_gguf(name, source, gguf_field(reader, f"{name}.expert_count") is not None)


def load_gguf(
    path: str | Path, dtype: str | torch.dtype = "float32", keep_blocks: bool = False
) -> tuple[ModelConfig, StateDict, GGUFTokenizerData]:
    """Config, fused state dict and tokenizer vocabulary from a llama.cpp GGUF file (a registry architecture);
    ``keep_blocks``: its Q4_0 / Q4_1 / Q8_0 matrices as ``BlockQuantized``, the rest widened to ``dtype``."""
    reader = gguf.GGUFReader(str(path))
    architecture = gguf_architecture(reader, str(path))
    tensors = {}
    for t in reader.tensors:
        if len(t.shape) == 3:  # a mixture of experts' stacked experts: one matrix per expert
            tensors.update((f"{t.name}.{e}", m) for e, m in enumerate(_read_experts(t, keep_blocks)))
        else:
            tensors[t.name] = _read(t, keep_blocks)
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: per-dimension RoPE factors (rope_freqs, Llama 3.1 scaling) are not supported")
    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"{path}: longrope factors (rope_factors_long, Phi-3 128k) from a GGUF file are not "
                         "supported: load its HF directory instead")
    if "token_embd.weight" not in tensors:
        raise KeyError(f"{path} lacks tensor 'token_embd.weight'")
    tokenizer_data = gguf_tokenizer_data(reader)
    config = _gguf_config(reader, architecture, tensors, tokenizer_data, Path(path).stem)
    config = _entry_reading(reader, architecture, config, path)
    if architecture.gguf_qk_permuted:
        _unpermute_llama_qk(tensors, config)
    names = {**GGUF_NAMES, **GGUF_FUSED_NAMES} if architecture.fused_checkpoint else GGUF_NAMES
    return config, fuse(tensors, names, config, str(path), dtype), tokenizer_data
