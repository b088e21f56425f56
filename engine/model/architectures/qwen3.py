"""Qwen3 (dense): the Llama core with each head's q and k RMS-normalized over head_dim (weights ``q_norm``,
``k_norm`` [head_dim], the model's eps) after the QKV product and before RoPE, and no QKV bias (its
``attention_bias`` would bias o_proj too: refused). head_dim is the config's (128 in every released size), not
hidden / heads: Qwen3-0.6B has 16 heads of 128 over a hidden size of 1024.

The native kernels' fused layer input normalizes the q and k heads before it rotates them (``ss_rope_and_cache``),
so its layers run fused like Llama's, in the bf16 prefill and the one-call decode too; a config with sliding-window
layers (``use_sliding_window``) attends over their window, its layers composed in PyTorch (layers.py)."""

from splitserve.engine.model.architectures.architecture import (
    Architecture,
    configure_sliding_windows,
    refuse_o_proj_bias,
)

QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", gguf_name="qwen3", qk_norm=True,
                     refuse=(refuse_o_proj_bias,), configure=configure_sliding_windows)
