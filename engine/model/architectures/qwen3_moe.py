"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm before RoPE, no QKV bias)
and, in its sparse layers, a router over ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, each token
taking the top ``num_experts_per_tok`` of the softmax, renormalized to sum to 1 where ``norm_topk_prob`` (true in the
released models; transformers' default is false). A layer is sparse unless it is in ``mlp_only_layers`` or
``(layer + 1) % decoder_sparse_step`` is not 0; the others have the dense MLP of width ``intermediate_size``. No
shared expert (Qwen2-MoE's, qwen2_moe.py). Its experts are named per expert, as the hub's checkpoints and
transformers' ``save_pretrained`` write them; transformers' stacked in-memory form is read too (hf_checkpoint.py).
llama.cpp's ``qwen3moe`` GGUF files stack each layer's experts ([E, rows, cols]); the GGUF loader splits them per
expert, in their blocks (gguf_file.py).

The fused native layer kernels do not run a router (``fused_layers_refusal``): the layers compose in PyTorch around
the native products and attention, and prefill computes in float32."""

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.architecture import (
    Architecture,
    configure_sliding_windows,
    refuse_o_proj_bias,
)
from splitserve.engine.model.architectures.experts import ExpertsFormat, HFConfig


def read_experts(hf: HFConfig) -> dict:
    """Qwen-MoE's keys (Qwen2-MoE's too): its sparse layers by ``mlp_only_layers`` and ``decoder_sparse_step``."""
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    sparse = [i for i in range(hf["num_hidden_layers"]) if experts and i not in dense and (i + 1) % step == 0]
    return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=hf.get("norm_topk_prob", False),
                moe_layers=sparse)


def write_experts(config: ModelConfig) -> HFConfig:
    return {"num_experts": config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(config.num_layers) if i not in config.moe_layers]}


QWEN3_MOE = Architecture(
    "qwen3_moe", "Qwen3MoeForCausalLM", gguf_name="qwen3moe", qk_norm=True,
    refuse=(refuse_o_proj_bias,), configure=configure_sliding_windows,
    experts=ExpertsFormat(read_experts, write_experts, {
        "router": "model.layers.{i}.mlp.gate.weight",
        "expert_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "expert_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "expert_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    }))
