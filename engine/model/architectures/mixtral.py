"""Mixtral (8x7B, 8x22B): Mistral's attention and, in every layer, a router over ``num_local_experts`` SwiGLU experts
of width ``intermediate_size`` (``w1`` gate, ``w3`` up, ``w2`` down), each token taking the top
``num_experts_per_tok`` (2) of the softmax renormalized over them: the softmax of the chosen logits. No dense layer.
A sliding window the context exceeds windows every layer, as Mistral's. The hub's checkpoints name the MoE block
``block_sparse_moe``, which transformers' ``save_pretrained`` writes too; its stacked in-memory form (``mlp.gate``,
``mlp.experts.gate_up_proj``) is read as well (hf_checkpoint.py).

As Qwen3-MoE's, its layers compose in PyTorch around the native products and attention (``fused_layers_refusal``).

llama.cpp writes Mixtral as a ``llama`` file with ``llama.expert_count`` (Q and K rows interleaved as Llama's), each
layer's experts stacked (``ffn_gate_exps``...) and their width as ``feed_forward_length``; read as Qwen3-MoE's files
are (engine/weights/gguf_file.py). Its sliding window is not in the file (llama.cpp's llama has none). The older
converters' one tensor per expert (``ffn_gate.{e}``) is not read."""

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.architecture import Architecture, configure_sliding_windows
from splitserve.engine.model.architectures.experts import ExpertsFormat, HFConfig


def _read(hf: HFConfig) -> dict:
    return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                moe_layers=list(range(hf["num_hidden_layers"])))


def _write(config: ModelConfig) -> HFConfig:
    if config.moe_layers != list(range(config.num_layers)) or not config.norm_topk_prob:
        raise ValueError(f"{config.name}: transformers' Mixtral routes every layer, renormalized")
    return {"num_local_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok}


MIXTRAL = Architecture(
    "mixtral", "MixtralForCausalLM", configure=configure_sliding_windows, gguf_name="llama", gguf_qk_permuted=True,
    experts=ExpertsFormat(_read, _write, {
        "router": "model.layers.{i}.block_sparse_moe.gate.weight",
        "expert_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        "expert_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        "expert_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
    }))
