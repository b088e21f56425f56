"""The native CPU kernels and what the CPU offers.

- ``cpu_kernels.py``: the float32 and quantized kernels' typed entry points (their C++ source in ``csrc/``), called
  through ctypes; ``bf16_kernels.py``: the bf16 prefill's (its products on one tiling for every row, per ISA);
- ``abi.py``: every entry point's declaration, checked against the library before any call; ``checks.py``: the
  argument checks before raw pointers; ``weight_formats.py``: how product weights are stored;
- ``decode_layers.py``: a model's layers as the one-call decode reads them (``DecodeLayers``, a table built once);
- ``build.py``: compiles that library once per machine, keyed on the CPU's flags;
- ``cpu_features.py``: the CPU's feature flags, read once, and the prefill compute format and bf16 ISA chosen from
  them.
"""
