"""Rotary position embeddings (RoPE): the cos/sin tables of every position, computed once per model, and one step's
view of them, with the checkpoint's rope scaling (linear, Llama 3.1's, Phi-3's longrope) applied to the frequencies
and longrope's attention factor to the tables; a second pair for the windowed layers of a model whose local layers
rotate with a base of their own (Gemma 3)."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
from torch import nn

from splitserve.engine.config import ModelConfig


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position_embeddings``, computed once (HF's non-interleaved layout).

    Tables take 2 * max_positions * head_dim elements (4 MiB for SmolLM2's 8192 x 64 in float32).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin_signed", None, persistent=False)
        self.cos, self.sin_signed = _tables(config, dtype, device)  # [P, D] each
        # Gemma 3's windowed layers rotate with a base of their own (rope_local_base_freq, unscaled): a second pair.
        self.register_buffer("local_cos", None, persistent=False)
        self.register_buffer("local_sin_signed", None, persistent=False)
        if config.local_rope_theta is not None:
            local = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.local_cos, self.local_sin_signed = _tables(local, dtype, device)

    def for_step(self, positions: torch.Tensor) -> "StepRotary":
        if positions.numel() and int(positions.max()) >= len(self.cos):
            raise ValueError(f"position {int(positions.max())} is past max_position_embeddings ({len(self.cos)})")
        local = None if self.local_cos is None else StepRotary(positions, self.local_cos, self.local_sin_signed)
        return StepRotary(positions, self.cos, self.sin_signed, local)


def _tables(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [P, D] of every position, with ``config``'s base and scaling."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, rope_inv_freq(config))  # [P, D/2]
    scale = rope_attention_factor(config)  # as transformers: cos and sin times the factor, so q and k both
    cos, sin = angles.cos() * scale, angles.sin() * scale
    # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): the sign moves into the table.
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


class StepRotary:
    """The rotary inputs of one step: every token's position [T] and the [P, D] tables (which the native kernels
    index themselves), and, looked up once on first use for all layers, each token's rows [T, 1, D]."""

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_signed_table: torch.Tensor,
                 local: "StepRotary | None" = None):
        self.positions, self.cos_table, self.sin_signed_table = positions, cos_table, sin_signed_table
        self.local = local  # the windowed layers' rotary where it differs (Gemma 3), else None

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position, [T, 1, D] each (broadcast over heads)."""
        cos = self.cos_table.index_select(0, self.positions).unsqueeze(1)
        return cos, self.sin_signed_table.index_select(0, self.positions).unsqueeze(1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated copy, [T, heads, D]."""
        cos, sin_signed = self.rows
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin_signed)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, with the checkpoint's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        return _longrope_short_inv_freq(config, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3, longrope)")


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, but for longrope, whose factor is the config's ``attention_factor``,
    else sqrt(1 + ln(factor) / ln(original context)) for a ``factor`` over 1 (transformers'
    ``_compute_longrope_parameters``: the factor, when the config has none, is the context over the original one)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_short_inv_freq(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """longrope's frequencies with its short factors, one per frequency: what transformers computes for a sequence
    of at most ``original_max_position_embeddings`` tokens. Past that it switches every position of the sequence,
    cached ones too, to the long factors; a context that long is not computed here (the entry caps it)."""
    original = scaling["original_max_position_embeddings"]
    if config.max_position_embeddings > original:
        raise ValueError(f"longrope past original_max_position_embeddings ({original}): its long factors")
    dim = config.head_dim
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if short.shape != (dim // 2,):
        raise ValueError(f"longrope short_factor has {len(short)} values, not head_dim / 2 = {dim // 2}")
    return 1.0 / (short * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_context / low, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_context / high) & (wavelen <= original_context / low)
    return torch.where(in_band, interpolated, scaled)
