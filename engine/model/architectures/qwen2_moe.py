"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biased q, k and v) and Qwen3-MoE's routing
(qwen3_moe.py: top ``num_experts_per_tok`` of the softmax, renormalized only with ``norm_topk_prob``, false in these
models; dense layers by ``mlp_only_layers`` / ``decoder_sparse_step``), plus a shared expert every token takes: a
SwiGLU of width ``shared_expert_intermediate_size`` scaled by sigmoid(x w_g) (``shared_expert_gate`` [1, H]) and added
to the routed experts' sum. Its optional sliding-window layers are windowed, as Qwen2's."""

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.architecture import Architecture, configure_sliding_windows
from splitserve.engine.model.architectures.experts import ExpertsFormat, HFConfig
from splitserve.engine.model.architectures.qwen3_moe import QWEN3_MOE, read_experts, write_experts


def _read(hf: HFConfig) -> dict:
    return {**read_experts(hf), "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size", 0)}


def _write(config: ModelConfig) -> HFConfig:
    return {**write_experts(config), "shared_expert_intermediate_size": config.shared_expert_intermediate_size}


QWEN2_MOE = Architecture(
    "qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, configure=configure_sliding_windows,
    experts=ExpertsFormat(_read, _write, {
        **QWEN3_MOE.experts.hf_names,
        "shared_gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
    }))
