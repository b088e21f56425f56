"""``splitserve bench phases``: prefill and decode of the engine against this machine's limits.

- ``command.py``: the command line and its default run, prefill and decode over a grid, against the matmul peak and
  the read bandwidth (a roofline), and the simulator's profile fit;
- ``step_cost.py``: a step's FLOPs and bytes, from the model's config;
- ``sequences.py``: what the runs feed the engine: random prompts, and decode sequences admitted with real KV;
- ``prefill_formats.py``: ``--prefill-formats``, float32 and bf16 prefill side by side against the bf16 GEMM peak;
- ``prefill_quality.py``: ``--prefill-quality``, each prefill format's answers against float32's;
- ``kv_pools.py``: ``--kv-pools``, long-context decode per KV pool format against each one's byte floor;
- ``kv_schemes.py``: ``--kv-schemes``, KV formats not built, simulated on the model: their answers and capacity;
- ``llamacpp_pools.py``: llama.cpp's decode over its quantized KV caches beside them, on the same GGUF file;
- ``attention_probe.py``: ``--attention-probe``, the decode attention alone per pool format: memory or arithmetic.
"""
