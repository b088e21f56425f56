"""The native CPU kernels and what the CPU offers.

- ``cpu_kernels.py``: the kernels' typed entry points (their C++ source in ``csrc/``), called through ctypes;
- ``decode_layers.py``: a model's layers as the one-call decode reads them (``DecodeLayers``, a table built once);
- ``build.py``: compiles that library once per machine, keyed on the CPU's flags;
- ``cpu_features.py``: the CPU's feature flags, read once, and the prefill compute format chosen from them.
"""
