"""What the phases benchmarks feed an engine: prompts of random ids, and decode sequences admitted as a decode pod
admits transferred ones, with real KV on every page."""

from __future__ import annotations

import random
import time

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams


def random_prompt(rng: random.Random, cfg: ModelConfig, length: int) -> list[int]:
    """``length`` random ids above the low (special) ids; fresh draws never hit the prefix cache."""
    return [rng.randrange(min(100, cfg.vocab_size // 2), cfg.vocab_size) for _ in range(length)]


def admit_transferred(engine: LLMEngine, rng: random.Random, batch: int, context: int, max_tokens: int) -> list[str]:
    """``batch`` sequences of ``context`` tokens admitted as a decode pod admits transferred ones (no prefill
    computed; ``reserve_for_transfer`` + ``admit_prefilled``), each to decode ``max_tokens`` tokens: their request
    ids. Every page of their KV is written first with real values, as a transfer writes it: a pool page never written
    is the kernel's shared zero page, which reads from cache and makes a long-context decode step look faster than any
    served one (issue 46)."""
    cfg, cache = engine.model_config, engine.runner.kv_cache  # a tensor-parallel engine's cache writes every rank's
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"decode-{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = random_prompt(rng, cfg, context)
        seq = engine.reserve_for_transfer(request_id, prompt, params)
        if seq is None:
            raise RuntimeError(f"the KV pool cannot hold {batch} sequences of {context} tokens")
        slots = cache.slots(seq.block_table, 0, context)
        values = torch.randn(context, cfg.num_kv_heads, cfg.head_dim, generator=torch.Generator().manual_seed(i))
        for layer in range(cfg.num_layers):
            for kind in ("k", "v"):
                cache.write(layer, kind, slots, values)
        engine.admit_prefilled(seq, prompt[-1])
    return ids
