"""The model: the Llama core decoder, the registry of architectures built on it, and what a step runs through it.

- ``llama.py``: ``LlamaForCausalLM``: the embeddings, the layers (or, for prompt rows, the bf16 prefill's), the
  final norm and the logits; loading from a state dict, and which form each role holds;
- ``layers.py``: a decoder layer's modules (``RMSNorm``, ``Linear``, ``Attention``, ``MLP``, ``DecoderLayer``);
- ``moe.py``: a mixture-of-experts layer's MLP (router, experts grouped by the tokens routed to them);
- ``attention.py``: paged attention over the KV cache, and the per-step metadata that plans it;
- ``rotary.py``: RoPE (with the checkpoints' scaling), its tables and a step's rows;
- ``architectures/``: the model registry: each served architecture's module (what differs from the core), and the
  look-ups the weight loaders call; anything else is refused at load;
- ``bf16_prefill.py``: the bf16 copy of the layers that prompt rows run through where prefill computes in bf16.
"""
