"""The native CPU kernels: their C++ source (``csrc/``), the build that compiles them once per machine, and their ctypes entry points."""
