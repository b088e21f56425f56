"""What one engine step of a Llama-family model must compute and read, from its config alone: the FLOPs of its
matrix products and the bytes it moves at least, for the benchmarks' floors and rooflines.

  FLOPs  2 per multiply-add of the projections, the MLP and the attention (QK^T and PV over the context), plus
         the lm_head rows the step samples from; norms, RoPE, softmax and the sampler are left out (a few %).
  bytes  every weight once per step, the K/V of the context the attention reads, and the K/V the step writes;
         activations are left out (they stay in cache at these sizes). A lower bound, hence "at least".
"""

from __future__ import annotations

from splitserve.engine.config import ModelConfig


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """FLOPs of one token through one layer's projections and MLP (fused QKV, output, gate+up, down)."""
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    return 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * h * 2 * inter + 2 * inter * h


def attention_flops(cfg: ModelConfig, context: int) -> int:
    """FLOPs of one query token attending over ``context`` tokens in one layer (QK^T and PV)."""
    return 2 * 2 * cfg.num_heads * cfg.head_dim * context


def lm_head_flops(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size * cfg.vocab_size


def kv_bytes_per_token(cfg: ModelConfig, cache_elem_bytes: float) -> int:
    """K and V of one token across all layers, as the cache stores them (``cache_elem_bytes``: per value, an int8
    row's scale shared out: ``PagedKVCache.element_size``)."""
    return round(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cache_elem_bytes)


def prefill_flops(cfg: ModelConfig, num_tokens: int, context_before: int = 0) -> float:
    """Matmul FLOPs of prefilling tokens ``[context_before, context_before + num_tokens)`` of a prompt (causal: token
    i attends over i + 1 tokens), with one lm_head row (the last token samples)."""
    attended = num_tokens * context_before + num_tokens * (num_tokens + 1) / 2  # sum of each token's context
    per_layer = linear_flops_per_token(cfg) * num_tokens + attention_flops(cfg, 1) * attended
    return cfg.num_layers * per_layer + lm_head_flops(cfg)


def prefill_bytes(cfg: ModelConfig, weight_bytes: int, num_tokens: int, context_before: int = 0,
                  cache_elem_bytes: float = 4) -> int:
    """Bytes a prefill step of ``num_tokens`` after ``context_before`` cached ones moves at least: the weights, the
    K/V it attends over (cached and new) and the K/V it writes."""
    kv = kv_bytes_per_token(cfg, cache_elem_bytes)
    return weight_bytes + kv * (context_before + num_tokens) + kv * num_tokens


def decode_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """Matmul FLOPs of one decode step: ``batch`` sequences, each one new token over ``context`` tokens."""
    per_layer = (linear_flops_per_token(cfg) + attention_flops(cfg, context)) * batch
    return cfg.num_layers * per_layer + lm_head_flops(cfg) * batch


def decode_bytes(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, cache_elem_bytes: float = 4) -> int:
    """Bytes a decode step must read at least: every weight once, plus each sequence's K and V."""
    return weight_bytes + kv_bytes_per_token(cfg, cache_elem_bytes) * context * batch
