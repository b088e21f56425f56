"""``LlamaForCausalLM``: the Llama-family decoder (Llama 2/3, SmolLM, Qwen2) in plain PyTorch, for inference.

One step runs a flattened batch over the paged KV cache:
``forward(input_ids [T], positions [T], kv_cache, attn_metadata) -> hidden [T, H]``, then
``compute_logits(hidden rows [N, H]) -> [N, V] float32`` for the rows that sample.
Each layer: RMSNorm -> fused QKV projection (optional bias, Qwen2) -> RoPE (theta, Llama-3 scaling) -> paged GQA
attention (attention.py) -> output projection -> residual -> RMSNorm -> SwiGLU with fused gate/up -> residual.
Decode on CPU streams every weight once per step; ``threaded_linear`` spreads that over the cores.

Parameter names, the layout engine/weights.py produces (``random_state_dict`` builds the same for tiny models):
``embed_tokens.weight`` [V, H]; ``layers.{i}.input_norm.weight`` [H];
``layers.{i}.attn.qkv_proj.weight`` [(Hq + 2 Hkv) D, H], rows q then k then v in HF order (``.bias`` with qkv_bias);
``layers.{i}.attn.o_proj.weight`` [H, Hq D]; ``layers.{i}.post_attn_norm.weight`` [H];
``layers.{i}.mlp.gate_up_proj.weight`` [2 I, H], gate rows then up rows; ``layers.{i}.mlp.down_proj.weight`` [H, I];
``norm.weight`` [H]; ``lm_head.weight`` [V, H], absent when the embeddings are tied.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


# A product of at most this many rows (a decode batch) is split across threads by ``threaded_linear``;
# with more (prefill) MKL's own threading does as well.
SPLIT_MAX_ROWS = 32


def threaded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; x: [rows, in], weight: [out, in] in either storage order -> [rows, out].

    With few rows MKL runs the product on one thread, which streams the weight at one core's memory bandwidth,
    and decode is nothing but streaming weights. Issued instead as one batched product over ``parts`` slices of the
    output features, MKL gives each thread its own slice. Measured on 2 cores with SmolLM2's shapes and the layouts
    of ``_weight``: the products of a 1-row decode step take ~27 ms instead of ~33 (down_proj 1.4x, the head 1.2x);
    at 16-32 rows the split is about even.
    """
    rows = x.shape[0]
    if parts == 1 or rows > SPLIT_MAX_ROWS:
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    slices = weight.unflatten(0, (parts, out_features // parts)).transpose(1, 2)  # [parts, in, out / parts]
    y = torch.bmm(x.expand(parts, rows, in_features), slices)  # [parts, rows, out / parts]
    y = y.transpose(0, 1).reshape(rows, out_features)  # a view when rows == 1
    return y if bias is None else y.add_(bias)


def _thread_parts(out_features: int, device: torch.device) -> int:
    """Slices for ``threaded_linear``: one per CPU thread at build time, when they divide the outputs evenly."""
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    return threads if out_features % threads == 0 else 1


def _weight(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized [out, in] weight. On CPU, one with more outputs than inputs is stored transposed ([in, out]
    contiguous, seen as [out, in] through ``.t()``): MKL's one-row products stream a weight faster along long
    contiguous rows. Measured at 1 row, 1 thread, SmolLM2's shapes: gate_up 3072 x 576 25 -> 18 ms for 30 layers,
    the 49152 x 576 head 13 -> 8 ms, qkv 960 x 576 7.9 -> 6.4; down_proj 576 x 1536 is faster as it is. The price:
    ~1.3x slower head products for batches of 4-32 rows, and a strided embedding lookup (~10 us a token) when the
    head is tied. ``load_state_dict`` copies into the existing storage, so the layout survives loading."""
    if device.type == "cpu" and out_features > in_features:
        return nn.Parameter(torch.empty(in_features, out_features, dtype=dtype, device=device).t())
    return nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))


class Linear(nn.Module):
    """``x W^T + b`` with an uninitialized weight [out, in] (and bias [out]), run by ``threaded_linear`` with as
    many slices as ``torch.get_num_threads()`` when the layer is built."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _weight(out_features, in_features, dtype, device)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.parts = _thread_parts(out_features, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return threaded_linear(x, self.weight, self.bias, self.parts)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position_embeddings``, computed once (HF's non-interleaved layout).

    Tables take 2 * max_positions * head_dim elements (4 MiB for SmolLM2's 8192 x 64 in float32).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(config))  # [P, D/2]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device, dtype), persistent=False)  # [P, D]
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): the sign moves into the table.
        self.register_buffer("sin_signed", torch.cat((-sin, sin), -1).to(device, dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position, [T, 1, D] each (broadcast over heads)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        return cos, self.sin_signed.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] -> rotated copy, [T, heads, D]."""
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
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.qk_size = self.q_size + config.num_kv_heads * config.head_dim
        qkv_rows = self.qk_size + config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_rows, config.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype, device)
        self.scale = config.head_dim**-0.5

    def forward(self, x, cos, sin_signed, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        qk = apply_rotary(qkv[:, : self.qk_size].view(t, -1, self.head_dim), cos, sin_signed)  # [T, Hq + Hkv, D]
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = Attention(config, dtype, device)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(self, x, cos, sin_signed, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream [T, H], updated in place and returned."""
        x += self.attn(self.input_norm(x), cos, sin_signed, k_cache, v_cache, meta)
        x += self.mlp(self.post_attn_norm(x))
        return x


class LlamaForCausalLM(nn.Module):
    """Parameters are uninitialized until ``load_state_dict``; ``from_state_dict`` does both."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | str = torch.float32, device="cpu"):
        super().__init__()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device)
        self.config = config
        self.embed_tokens = skip_init(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:  # it is the head too: laid out for the head's products
            self.embed_tokens.weight = _weight(config.vocab_size, config.hidden_size, dtype, device)
        self.tied_head_parts = _thread_parts(config.vocab_size, device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype, device
        )
        self.rotary = RotaryEmbedding(config, dtype, device)
        self.requires_grad_(False)

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype=torch.float32, device="cpu"
    ) -> "LlamaForCausalLM":
        model = cls(config, dtype, device)
        model.load_state_dict(state_dict)  # strict: a missing or unexpected name is an error
        return model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        attn_metadata: AttentionMetadata,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] long -> final hidden states [T, H]. ``layer_done(i)`` runs once layer i's
        K/V are in the cache (the prefill service streams them from there while later layers compute)."""
        cos, sin_signed = self.rotary.lookup(positions)  # [T, 1, D] each
        x = F.embedding(input_ids, self.embed_tokens.weight)  # [T, H], the residual stream
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin_signed, kv_cache.k[i], kv_cache.v[i], attn_metadata)
            if layer_done is not None:
                layer_done(i)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] float32."""
        if self.lm_head is None:
            return threaded_linear(hidden, self.embed_tokens.weight, None, self.tied_head_parts).float()
        return self.lm_head(hidden).float()


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter, in the layout documented at the top of this file."""
    h, d = config.hidden_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes[p + "input_norm.weight"] = (h,)
        shapes[p + "attn.qkv_proj.weight"] = (qkv_rows, h)
        if config.qkv_bias:
            shapes[p + "attn.qkv_proj.bias"] = (qkv_rows,)
        shapes[p + "attn.o_proj.weight"] = (h, config.num_heads * d)
        shapes[p + "post_attn_norm.weight"] = (h,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random float32 CPU weights: norms 1, everything else N(0, 0.02) (GPT-2/Llama init scale)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=generator) * 0.02
    return state
