"""Llama 2, Llama 3.x and SmolLM: the core itself. Llama 3.x's RoPE scaling (``rope_scaling`` type ``llama3``, 128k
contexts) and linear scaling are the config's, computed as transformers does in engine/model/rotary.py; llama.cpp's
converter permutes its Q and K rows, which the GGUF loader undoes."""

from splitserve.engine.model.architectures.architecture import Architecture, refuse_o_proj_bias

LLAMA = Architecture("llama", "LlamaForCausalLM", gguf_name="llama", gguf_qk_permuted=True,
                     refuse=(refuse_o_proj_bias,))
