"""Qwen2 and Qwen2.5: the Llama core with biased q, k and v (o_proj has none), whatever ``attention_bias`` says;
llama.cpp converts its Q and K rows unpermuted. Its optional sliding-window layers (``use_sliding_window``) attend
over their window (``ModelConfig.layer_windows``)."""

from splitserve.engine.model.architectures.architecture import Architecture, configure_sliding_windows

QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", gguf_name="qwen2", qkv_bias=True,
                     configure=configure_sliding_windows)
