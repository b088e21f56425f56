"""Qwen2 and Qwen2.5: the Llama core with biased q, k and v (o_proj has none), whatever ``attention_bias`` says;
llama.cpp converts its Q and K rows unpermuted. Its optional sliding-window layers are refused."""

from splitserve.engine.model.architectures.architecture import Architecture, refuse_sliding_window

QWEN2 = Architecture("qwen2", "Qwen2ForCausalLM", gguf_name="qwen2", qkv_bias=True, refuse=(refuse_sliding_window,))
