"""The model registry, as vLLM's: an architecture's name in a checkpoint -> what splitserve builds for it.

A checkpoint names its architecture (a Hugging Face ``config.json``'s ``model_type`` and ``architectures``, a GGUF
file's ``general.architecture``); the loaders (engine/weights/) ask the registry for it, which either returns the
``ModelConfig`` the model is built from or refuses in one line naming the architectures it serves. Every architecture
here is the Llama core (engine/model/llama.py: RMSNorm, fused QKV, RoPE, GQA paged attention, SwiGLU) plus what its
own module states differs:

- ``architecture.py``: ``Architecture``, what a module states (names, QKV bias, per-head q/k norm, what it refuses),
  and the Llama core's reading of a ``config.json`` that every entry shares;
- ``llama.py``: Llama 2/3.x and SmolLM (the core itself; Llama 3.x's RoPE scaling is the config's, rotary.py);
- ``mistral.py``: Mistral (the core; a sliding window the context exceeds windows every layer);
- ``phi3.py``: Phi-3 and Phi-3.5 (q|k|v and gate|up stored fused, as the core's; longrope within its original
  context; its sliding window windows every layer);
- ``qwen2.py``: Qwen2 and Qwen2.5 (biased q, k and v);
- ``qwen3.py``: Qwen3 (per-head RMSNorm of q and k before RoPE; its own head_dim);
- ``gemma.py``: Gemma 2 and Gemma 3's text model (scaled embeddings, 1 + w norms around attention and MLP, GeGLU,
  local sliding-window and global layers, soft-caps, Gemma 3's q/k norms and local RoPE base);
- ``qwen3_moe.py``: Qwen3-MoE (Qwen3's attention; routed experts, some layers dense);
- ``qwen2_moe.py``: Qwen2-MoE (Qwen2's attention; Qwen3-MoE's routing plus a gated shared expert);
- ``mixtral.py``: Mixtral (Mistral's attention; top-2 of 8 experts in every layer);
- ``experts.py``: ``ExpertsFormat``, how a mixture-of-experts entry's config and checkpoints name its experts;
- ``registry.py``: the table of every entry, and the look-ups the loaders call.

docs/models.md lists what is served, on which paths, how each is verified, and what is not.
"""
