"""A decoder layer's modules: ``RMSNorm``, ``Linear`` (its weight packed for the native kernels, or in quantized
blocks), ``Attention`` (fused QKV, Qwen3's and Gemma 3's per-head q/k norm, RoPE, paged GQA attention with the
layer's sliding window and score soft-cap, output), ``MLP`` (SwiGLU or Gemma's GeGLU, with fused gate/up; also each
expert of moe.py's mixture) and ``DecoderLayer``, which runs its two halves around the attention natively where
``fused_layers_refusal`` finds nothing the fused kernels lack. ``llama.py`` stacks them into the model."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels import checks
from splitserve.engine.kernels.cpu_kernels import CpuKernels
from splitserve.engine.kernels.weight_formats import PANEL, packed_shape, weight_shape
from splitserve.engine.model.attention import AttentionMetadata, paged_attention
from splitserve.engine.model.rotary import StepRotary
from splitserve.engine.weights.quantized_weights import BlockQuantized, pack_panels


def fused_layers_refusal(config: ModelConfig) -> str | None:
    """Why the native kernels' fused layer calls cannot run ``config``'s layers, or None where they can: the one
    rule for every such call, the layer's native halves (``ss_attention_input``: norm, QKV product, RoPE and the
    cache write in one call; ``ss_attention_output_and_mlp``), the one-call decode of all layers and the bf16
    prefill's layers. Where it refuses, the layers run as PyTorch compositions around the native products and paged
    attention (the path tensor-parallel ranks take), with the same float32 arithmetic in another grouping."""
    if not checks.supports_head_dim(config.head_dim):
        return f"head_dim {config.head_dim} (the attention kernels take multiples of 8 up to 512)"
    if any(w is not None for w in config.layer_windows) or config.attn_logit_softcap is not None:
        return "sliding windows and score soft-caps (the native attention has neither)"
    if config.hidden_act != "silu":
        return f"the {config.hidden_act} MLP (the fused MLP is SwiGLU)"
    if config.sandwich_norms:
        return "norms of the attention's and the MLP's outputs"
    if config.moe_layers:
        return "mixture-of-experts layers (a router and per-expert products: engine/model/moe.py)"
    return None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Module):
    """``x W^T + b``; its state-dict entries are ``weight`` [out, in] and ``bias`` [out].

    With the native CPU kernels (``kernels``, engine/kernels/cpu_kernels.py) the weight is held in panels of 16 outputs,
    [ceil(out / 16), in, 16], converted on ``load_state_dict`` and back on ``state_dict``, and the product runs in
    the kernels: a decode step then reads each weight at the memory's speed. Otherwise it is a plain ``F.linear``.
    ``weight_format`` other than float32 (with the kernels only): the weight is loaded from a ``BlockQuantized``
    in that format and kept in its blocks, packed into panels (engine/weights/quantized_weights.py),
    [P, in / 32 * bytes] uint8, which ``state_dict`` returns as they are; with ``int8_activations`` its products
    quantize their input rows to int8 per block of 32 (docs/quantization.md). Parameters are uninitialized until
    loaded.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 kernels: CpuKernels | None, weight_format: str = "float32", int8_activations: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.kernels = in_features, out_features, kernels
        self.weight_format = weight_format if kernels is not None else "float32"
        self.int8_activations = int8_activations
        if self.weight_format != "float32":
            self.weight = nn.Parameter(torch.empty(weight_shape(weight_format, out_features, in_features),
                                                   dtype=torch.uint8, device=device), requires_grad=False)
        else:
            shape = packed_shape(out_features, in_features) if kernels else (out_features, in_features)
            self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if kernels is not None:
            self.register_load_state_dict_pre_hook(Linear._pack_on_load)
            if self.weight_format == "float32":
                self.register_state_dict_post_hook(Linear._unpack_on_save)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if self.kernels is None:
            return F.linear(x, self.weight, self.bias)
        if self.weight_format != "float32":
            return self.kernels.quant_linear(x, self.weight, self.weight_format, self.out_features, self.bias,
                                             self.int8_activations)
        return self.kernels.linear(x, self.weight, self.out_features, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, [len(ids), in]: the embedding lookup of a head tied to the embeddings."""
        if self.kernels is None:
            return F.embedding(ids, self.weight)
        if self.weight_format != "float32":
            return self.kernels.quant_rows(self.weight, self.weight_format, self.in_features, ids)
        return self.weight[ids // PANEL, :, ids % PANEL]

    def _pack_on_load(self, state_dict, prefix, *_) -> None:
        key = prefix + "weight"
        weight = state_dict.get(key)
        if isinstance(weight, BlockQuantized):
            if weight.format == self.weight_format and weight.shape == (self.out_features, self.in_features):
                self.weight.data.copy_(pack_panels(weight))
                state_dict[key] = self.weight
            return  # a mismatch is reported by loading, which refuses a non-tensor
        if weight is not None and weight.shape == (self.out_features, self.in_features):
            padding = self.weight.shape[0] * PANEL - len(weight)
            padded = F.pad(weight.detach().to(self.weight.dtype), (0, 0, 0, padding))
            self.weight.data.copy_(padded.view(-1, PANEL, self.in_features).transpose(1, 2))
            state_dict[key] = self.weight  # loading then copies the parameter onto itself; a wrong shape is reported

    def _unpack_on_save(self, state_dict, prefix, _) -> None:
        panels = state_dict[prefix + "weight"]
        state_dict[prefix + "weight"] = panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]


# A layer's products' weight formats, by parameter name within the layer ("attn.qkv_proj.weight": "q4_1"); absent:
# float32.
LayerFormats = dict[str, str]


@dataclass(frozen=True)
class Products:
    """How a layer's products are stored and computed: the weights' formats, and whether the quantized ones take
    int8 activations (``EngineConfig.int8_activations``)."""

    formats: LayerFormats
    int8_activations: bool = False

    def linear(self, name: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
               device: torch.device, kernels: CpuKernels | None) -> "Linear":
        """The product whose weight is the layer's parameter ``name`` + ``.weight``."""
        return Linear(in_features, out_features, bias, dtype, device, kernels,
                      self.formats.get(name + ".weight", "float32"), self.int8_activations)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.qk_size = self.q_size + config.num_kv_heads * config.head_dim
        qkv_rows = self.qk_size + config.num_kv_heads * config.head_dim
        self.qkv_proj = products.linear("attn.qkv_proj", config.hidden_size, qkv_rows, config.qkv_bias, dtype, device,
                                        kernels)
        self.o_proj = products.linear("attn.o_proj", self.q_size, config.hidden_size, False, dtype, device, kernels)
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.window, self.softcap = config.window(layer), config.attn_logit_softcap  # Gemma, sliding-window layers
        self.local_rope = self.window is not None and config.local_rope_theta is not None  # Gemma 3's local layers
        self.kernels = kernels
        # Qwen3: each head's q and k RMS-normalized over D before RoPE, one weight for all heads of each.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None

    @property
    def head_norms(self) -> checks.HeadNorms | None:
        """The q and k heads' norm weights (Qwen3), as the fused kernels take them; None without them."""
        return None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)

    def forward(self, x, rotary: StepRotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        qk = qkv[:, : self.qk_size].view(len(qkv), -1, self.head_dim)  # [T, Hq + Hkv, D]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        rotary = rotary.local if self.local_rope else rotary
        return self.o_proj(self.attend(rotary.apply(qk), qkv, k_cache, v_cache, meta, kv_written=False))

    def attend(self, qk: torch.Tensor, qkv: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata,
               kv_written: bool) -> torch.Tensor:
        """Paged attention of the rotated q and k ``qk`` [T, Hq + Hkv, D] with the v of ``qkv`` -> [T, Hq D]."""
        t = len(qkv)
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq, D], [T, Hkv, D]
        meta = meta.for_layer(self.window is not None)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.kernels, kv_written, self.window,
                              self.softcap)  # [T, Hq, D]
        return out.reshape(t, self.q_size).contiguous()


class MLP(nn.Module):
    """SwiGLU: the layer's dense MLP, or (``name``, ``width``) one expert of a mixture-of-experts layer (moe.py)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products, name: str = "mlp.", width: int = 0):
        super().__init__()
        self.intermediate_size = width or config.intermediate_size
        self.gate_up_proj = products.linear(name + "gate_up_proj", config.hidden_size, 2 * self.intermediate_size,
                                            False, dtype, device, kernels)
        self.down_proj = products.linear(name + "down_proj", self.intermediate_size, config.hidden_size, False, dtype,
                                         device, kernels)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(_gated_by_rows(gate, up, self.gelu))


# PyTorch's CPU loops split an elementwise op over threads from this many elements (at::internal::GRAIN_SIZE).
_TORCH_GRAIN = 32768


def _gated_by_rows(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up [T, I] (act SiLU, or GELU's tanh form with ``gelu``), each row's bits independent of T and of the
    thread count. A row's activation is one vectorized pass with a scalar tail (I mod 2 vector widths, scalar exp); an
    op over T rows of >= 32768 elements is split over threads at any element, so a split inside a row moves a tail
    there and that row's bits change (seen: one row of 343 at I = 96, 2 threads). So it runs in calls of whole rows
    each under that size."""
    act = partial(F.gelu, approximate="tanh") if gelu else F.silu
    rows = max(1, _TORCH_GRAIN // gate.shape[1] - 1)
    if len(gate) <= rows:
        return act(gate).mul_(up)
    out = torch.empty_like(gate)
    for start in range(0, len(gate), rows):
        part = slice(start, start + rows)
        torch.mul(act(gate[part]), up[part], out=out[part])
    return out


class DecoderLayer(nn.Module):
    """Layer ``layer`` of the model (its index picks its sliding window). ``post_attn_norm`` is the MLP's input norm
    (Gemma's pre_feedforward_layernorm); with ``sandwich_norms`` (Gemma) ``attn_out_norm`` and ``mlp_out_norm``
    normalize the attention's and the MLP's outputs before their residual adds."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products | None = None, layer: int = 0, mlp: nn.Module | None = None):
        """``mlp``: the layer's MLP where it is not the dense one (a mixture of experts, moe.py)."""
        super().__init__()
        products = products or Products({})
        self.int8_activations = products.int8_activations
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = Attention(config, dtype, device, kernels, products, layer)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = mlp or MLP(config, dtype, device, kernels, products)
        sandwich = config.sandwich_norms
        self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device) if sandwich else None
        self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device) if sandwich else None
        # The layer's halves around its attention run natively where the fused kernels can run this model's layers
        # (and, per step, take the cache's dtype); its products use the kernels either way.
        self.kernels = kernels if kernels is not None and fused_layers_refusal(config) is None else None

    def forward(self, x, rotary: StepRotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream [T, H], updated in place and returned."""
        if self.kernels is not None and self.kernels.supports_cache_dtype(k_cache.dtype):
            return self._forward_native(x, rotary, k_cache, v_cache, meta)
        if self.attn_out_norm is not None:
            x += self.attn_out_norm(self.attn(self.input_norm(x), rotary, k_cache, v_cache, meta))
            x += self.mlp_out_norm(self.mlp(self.post_attn_norm(x)))
            return x
        x += self.attn(self.input_norm(x), rotary, k_cache, v_cache, meta)
        x += self.mlp(self.post_attn_norm(x))
        return x

    def _forward_native(self, x, rotary: StepRotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The same layer in two native calls around the attention: norm, QKV product, rotary and the cache write;
        then the output product, residual add, norm, SwiGLU MLP and residual add. One Python call per stage keeps
        a decode step's interpreter time small next to its weight reads."""
        attn, mlp, kernels = self.attn, self.mlp, self.kernels
        qkv = kernels.attention_input(
            x, self.input_norm.weight, self.input_norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
            rotary.positions, rotary.cos_table, rotary.sin_signed_table, attn.num_heads, attn.num_kv_heads,
            k_cache, v_cache, meta.slot_mapping, attn.qkv_proj.weight_format, self.int8_activations,
            attn.head_norms,
        )
        qk = qkv[:, : attn.qk_size].view(len(qkv), -1, attn.head_dim)  # rotated in place
        out = attn.attend(qk, qkv, k_cache, v_cache, meta, kv_written=True)
        kernels.attention_output_and_mlp(x, out, attn.o_proj.weight, self.post_attn_norm.weight,
                                         self.post_attn_norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                         (attn.o_proj.weight_format, mlp.gate_up_proj.weight_format,
                                          mlp.down_proj.weight_format), self.int8_activations)
        return x
