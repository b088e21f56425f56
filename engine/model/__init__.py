"""The model: the Llama-family decoder and what a step runs through it.

- ``llama.py``: ``LlamaForCausalLM``: the embeddings, the layers (or, for prompt rows, the bf16 prefill's), the
  final norm and the logits; loading from a state dict, and which form each role holds;
- ``layers.py``: a decoder layer's modules (``RMSNorm``, ``Linear``, ``Attention``, ``MLP``, ``DecoderLayer``);
- ``attention.py``: paged attention over the KV cache, and the per-step metadata that plans it;
- ``rotary.py``: RoPE (with the checkpoints' scaling), its tables and a step's rows;
- ``bf16_prefill.py``: the bf16 copy of the layers that prompt rows run through where prefill computes in bf16.
"""
