"""``LlamaForCausalLM``: the Llama-family decoder (Llama 2/3, SmolLM, Qwen2) in plain PyTorch, for inference.

One step runs a flattened batch over the paged KV cache:
``forward(input_ids [T], positions [T], kv_cache, attn_metadata) -> hidden [T, H]``, then
``compute_logits(hidden rows [N, H]) -> [N, V] float32`` for the rows that sample.
Each layer: RMSNorm -> fused QKV projection (optional bias, Qwen2) -> RoPE (theta, Llama-3 scaling) -> paged GQA
attention (attention.py) -> output projection -> residual -> RMSNorm -> SwiGLU with fused gate/up -> residual.
Decode streams every weight once per step; on CPU the native kernels (engine/kernels/cpu_kernels.py) run the products
and the decode attention when ``kernels`` is given (``LlamaForCausalLM``'s default: whenever they can).

Its parameters are the layout of engine/weights/parameter_layout.py (names, shapes, what each fuses), which every
weight loader produces; ``from_state_dict`` checks a state dict against it before loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionMetadata, paged_attention
from splitserve.engine.bf16_prefill import Bf16Prefill, copied_weights
from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels import bf16_kernels
from splitserve.engine.kernels.build import KernelsUnavailable
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype as resolve_prefill_dtype
from splitserve.engine.kernels.cpu_kernels import CpuKernels, KernelChoice
from splitserve.engine.kernels.cpu_kernels import choose as choose_kernels
from splitserve.engine.kernels.decode_layers import DecodeLayers, LayerTensors
from splitserve.engine.kernels.weight_formats import PANEL, packed_shape, weight_shape
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.rotary import RotaryEmbedding, StepRotary
from splitserve.engine.weights.parameter_layout import check_state_dict, product_weights
from splitserve.engine.weights.quantized_weights import BlockQuantized, pack_panels

logger = logging.getLogger(__name__)


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
                 products: Products):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.qk_size = self.q_size + config.num_kv_heads * config.head_dim
        qkv_rows = self.qk_size + config.num_kv_heads * config.head_dim
        self.qkv_proj = products.linear("attn.qkv_proj", config.hidden_size, qkv_rows, config.qkv_bias, dtype, device,
                                        kernels)
        self.o_proj = products.linear("attn.o_proj", self.q_size, config.hidden_size, False, dtype, device, kernels)
        self.scale = config.head_dim**-0.5
        self.kernels = kernels

    def forward(self, x, rotary: StepRotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        qk = rotary.apply(qkv[:, : self.qk_size].view(len(qkv), -1, self.head_dim))  # [T, Hq + Hkv, D]
        return self.o_proj(self.attend(qk, qkv, k_cache, v_cache, meta, kv_written=False))

    def attend(self, qk: torch.Tensor, qkv: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata,
               kv_written: bool) -> torch.Tensor:
        """Paged attention of the rotated q and k ``qk`` [T, Hq + Hkv, D] with the v of ``qkv`` -> [T, Hq D]."""
        t = len(qkv)
        v = qkv[:, self.qk_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq, D], [T, Hkv, D]
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.kernels, kv_written)  # [T, Hq, D]
        return out.reshape(t, self.q_size).contiguous()


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = products.linear("mlp.gate_up_proj", config.hidden_size, 2 * config.intermediate_size,
                                            False, dtype, device, kernels)
        self.down_proj = products.linear("mlp.down_proj", config.intermediate_size, config.hidden_size, False, dtype,
                                         device, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products | None = None):
        super().__init__()
        products = products or Products({})
        self.int8_activations = products.int8_activations
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = Attention(config, dtype, device, kernels, products)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device, kernels, products)
        # The layer's halves around its attention run natively when the kernels take its heads (and, per step,
        # the cache's dtype); its products use the kernels either way.
        self.kernels = kernels if kernels is not None and kernels.supports_head_dim(config.head_dim) else None

    def forward(self, x, rotary: StepRotary, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """x: the residual stream [T, H], updated in place and returned."""
        if self.kernels is not None and self.kernels.supports_cache_dtype(k_cache.dtype):
            return self._forward_native(x, rotary, k_cache, v_cache, meta)
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
        )
        qk = qkv[:, : attn.qk_size].view(len(qkv), -1, attn.head_dim)  # rotated in place
        out = attn.attend(qk, qkv, k_cache, v_cache, meta, kv_written=True)
        kernels.attention_output_and_mlp(x, out, attn.o_proj.weight, self.post_attn_norm.weight,
                                         self.post_attn_norm.eps, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                         (attn.o_proj.weight_format, mlp.gate_up_proj.weight_format,
                                          mlp.down_proj.weight_format), self.int8_activations)
        return x


class LlamaForCausalLM(nn.Module):
    """Parameters are uninitialized until ``load_state_dict``; ``from_state_dict`` does both.

    ``cpu_kernels``: run the products and the decode attention in the native CPU kernels when they can serve this
    device and dtype (CPU, float32) and build on this machine; False keeps the pure-PyTorch path everywhere.
    ``weight_formats``: parameter name -> format of the products' weights kept in quantized blocks (the native
    kernels only; engine/weights/quantized_weights.py); the rest are float. ``int8_activations``: the products over
    those weights quantize their input rows to int8 per block of 32 and sum integer dot products (faster; no longer the
    float32 path's bits: docs/quantization.md).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype | str = torch.float32, device="cpu",
                 cpu_kernels: bool = True, weight_formats: dict[str, str] | None = None,
                 int8_activations: bool = False):
        super().__init__()
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device)
        self.config = config
        self.compute_path: KernelChoice = choose_kernels(device, dtype, cpu_kernels)
        self.kernels = self.compute_path.kernels
        products = Products(weight_formats or {}, int8_activations)
        if config.tie_word_embeddings:  # one weight, laid out for the head's products, looked up by rows
            self.embed_tokens = products.linear("embed_tokens", config.hidden_size, config.vocab_size, False, dtype,
                                                device, self.kernels)
        else:
            # Left uninitialized (from_state_dict loads it): not skip_init, whose meta-device init imports torch's
            # compiler (torch._dynamo), seconds of every engine's start.
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
                config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device, self.kernels,
                         Products(_layer_formats(products.formats, i), int8_activations))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = None if config.tie_word_embeddings else products.linear(
            "lm_head", config.hidden_size, config.vocab_size, False, dtype, device, self.kernels
        )
        self.rotary = RotaryEmbedding(config, dtype, device)
        self.requires_grad_(False)
        self._decode_table: tuple[tuple[int, int], DecodeLayers] | None = None  # per KV cache, built on first use
        self.bf16_prefill: Bf16Prefill | None = None  # from_state_dict's, where prefill computes in bf16
        self.decodes = True  # False: only the bf16 prefill's weights are held (from_state_dict's prefill_only)

    @classmethod
    def from_state_dict(
        cls, config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype=torch.float32, device="cpu",
        cpu_kernels: bool = True, int8_activations: bool = False, prefill_compute_dtype: str = "float32",
        prefill_only: bool = False,
    ) -> "LlamaForCausalLM":
        """The model with ``state_dict``'s weights. Weights in quantized blocks (``BlockQuantized``) stay in them
        where the native kernels run the model, and are widened to ``dtype`` everywhere else (the fallback, where
        ``int8_activations`` has nothing to act on). ``prefill_compute_dtype`` (auto, float32, bfloat16;
        engine/kernels/cpu_features.py): where it resolves to bfloat16 for a float32 model, the model also keeps a bf16
        copy of its layers' products for its prefill rows (engine/bf16_prefill.py), and with ``prefill_only`` (a
        prefill pod, which never runs a decode row) only that copy: the layers' decode-path products are never
        loaded, and a step with decode rows is refused."""
        check_state_dict(config, state_dict)  # names the missing, unexpected or misshapen parameters
        blocks = set(product_weights(config))
        formats = {n: t.format for n, t in state_dict.items() if isinstance(t, BlockQuantized) and n in blocks}
        model = cls(config, dtype, device, cpu_kernels, formats, int8_activations)
        if formats and model.kernels is None:
            logger.warning("weights in quantized blocks widened to %s: %s", str(model.norm.weight.dtype),
                           model.compute_path.reason)
        kept = formats if model.kernels is not None else {}
        if model.norm.weight.dtype == torch.float32 and resolve_prefill_dtype(
                prefill_compute_dtype, str(model.norm.weight.device)) == "bfloat16":
            kernels = model._bf16_kernels(prefill_compute_dtype)
            if kernels is not None:
                model.bf16_prefill = Bf16Prefill.from_state_dict(config, state_dict, kernels)
        skipped = set(copied_weights(config)) if prefill_only and model.bf16_prefill is not None else set()
        for name in skipped:  # an empty weight: the decode path's form is never built
            linear = model.get_submodule(name.removesuffix(".weight"))
            linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
        model.decodes = not skipped
        missing, _ = model.load_state_dict({n: t if n in kept else _widened(t, model.norm.weight.dtype)
                                            for n, t in state_dict.items() if n not in skipped}, strict=not skipped)
        assert set(missing) == skipped, missing  # check_state_dict has named any other gap
        return model

    def _bf16_kernels(self, setting: str) -> bf16_kernels.Bf16Kernels | None:
        """The bf16 prefill's kernels, or None where ``auto`` meets a machine without them (float32 prefill, logged);
        ``bfloat16`` asked for explicitly there is an error."""
        try:
            if self.kernels is None:
                raise KernelsUnavailable(f"bf16 prefill runs on the native CPU kernels: {self.compute_path.reason}")
            return bf16_kernels.choose(self.kernels)
        except KernelsUnavailable as e:
            if setting != "auto":
                raise ValueError(f"prefill_compute_dtype {setting!r}: {e}") from e
            logger.warning("%s; prefill computes in float32", e)
            return None

    @property
    def prefill_dtype(self) -> str:
        """What the prefill rows' products compute in: ``bfloat16`` with a bf16 copy, else the model's dtype."""
        return "bfloat16" if self.bf16_prefill is not None else str(self.norm.weight.dtype).removeprefix("torch.")

    @property
    def prefill_isa(self) -> str:
        """What the prefill rows' products run on: the bf16 kernels' ISA (``amx``, ``avx512_bf16``, ``fma``), else the
        float32 kernels' (``avx512``, ``avx2``), or ``pytorch``."""
        if self.bf16_prefill is not None:
            return self.bf16_prefill.kernels.isa
        return "pytorch" if self.kernels is None else self.kernels.isa

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] long -> their embeddings [T, H], the start of the residual stream."""
        embed = self.embed_tokens
        return embed.rows(input_ids) if isinstance(embed, Linear) else embed(input_ids)

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
        if self.bf16_prefill is not None and attn_metadata.prefills:
            if attn_metadata.decode is not None:
                return self._forward_phases(input_ids, positions, kv_cache, attn_metadata, layer_done)
            return self._run_layers(self.bf16_prefill.layers, input_ids, positions, kv_cache, attn_metadata,
                                    layer_done)
        if not self.decodes:
            raise RuntimeError("this model holds only its bf16 prefill weights (a prefill pod's): it runs no decode "
                               "rows")
        if layer_done is None and self._decodes_natively(kv_cache, attn_metadata):
            rotary = self.rotary.for_step(positions)
            x = self.embed(input_ids)  # [T, H], the residual stream
            group = attn_metadata.decode  # every token, in order: one per sequence
            self.kernels.decode_layers(x, self._decode_layers(kv_cache), positions, rotary.cos_table,
                                       rotary.sin_signed_table, attn_metadata.slot_mapping, group.tables,
                                       group.seq_lens)
            return self.norm(x)
        return self._run_layers(self.layers, input_ids, positions, kv_cache, attn_metadata, layer_done)

    def _run_layers(self, layers, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                    meta: AttentionMetadata, layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """The step through ``layers`` (the model's, or the bf16 prefill's for prompt rows), each called as
        ``layer(x, rotary, k_cache, v_cache, meta)`` on the residual stream x, then the final norm."""
        rotary = self.rotary.for_step(positions)
        x = self.embed(input_ids)  # [T, H], the residual stream
        for i, layer in enumerate(layers):
            x = layer(x, rotary, kv_cache.k_blocks[i], kv_cache.v_blocks[i], meta)
            if layer_done is not None:
                layer_done(i)
        return self.norm(x)

    def _forward_phases(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                        meta: AttentionMetadata, layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """A step with prompt rows and decode rows, where the prompt rows compute in bf16: the prompt rows as a step
        of their own first (their K/V then never depend on the decodes beside them), then the decode rows on the
        decode path, which keep their float32 bits and attend to K/V written by the first (a resumed request's)."""
        (prefill_meta, prefill_rows), (decode_meta, decode_rows) = meta.split_phases()
        hidden = torch.empty(len(input_ids), self.config.hidden_size, dtype=torch.float32, device=input_ids.device)
        hidden[prefill_rows] = self._run_layers(self.bf16_prefill.layers, input_ids[prefill_rows],
                                                positions[prefill_rows], kv_cache, prefill_meta, None)
        # layer_done(i) after the decode rows' layer i: then every row's K/V of layer i is in the cache.
        hidden[decode_rows] = self(input_ids[decode_rows], positions[decode_rows], kv_cache, decode_meta, layer_done)
        return hidden

    def _decodes_natively(self, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        """A decode-only step on the native kernels runs all its layers in one native call."""
        return (self.kernels is not None and meta.is_decode_only and self.kernels.supports_cache_dtype(kv_cache.dtype)
                and self.kernels.supports_head_dim(self.config.head_dim))

    def _decode_layers(self, kv_cache: PagedKVCache) -> DecodeLayers:
        key = (id(kv_cache), kv_cache.k_blocks[0].data_ptr())
        if self._decode_table is None or self._decode_table[0] != key:
            layers = [
                LayerTensors(layer.input_norm.weight, layer.attn.qkv_proj.weight, layer.attn.qkv_proj.bias,
                             layer.attn.o_proj.weight, layer.post_attn_norm.weight, layer.mlp.gate_up_proj.weight,
                             layer.mlp.down_proj.weight, k, v, layer.attn.qkv_proj.weight_format,
                             layer.attn.o_proj.weight_format, layer.mlp.gate_up_proj.weight_format,
                             layer.mlp.down_proj.weight_format, layer.int8_activations)
                for layer, k, v in zip(self.layers, kv_cache.k_blocks, kv_cache.v_blocks)
            ]
            config = self.config
            self._decode_table = key, DecodeLayers(layers, config.num_heads, config.num_kv_heads,
                                                   config.rms_norm_eps, config.head_dim**-0.5)
        return self._decode_table[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head(hidden).float()


def _layer_formats(formats: dict[str, str], layer: int) -> LayerFormats:
    prefix = f"layers.{layer}."
    return {name.removeprefix(prefix): f for name, f in formats.items() if name.startswith(prefix)}


def _widened(t: torch.Tensor | BlockQuantized, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize().to(dtype) if isinstance(t, BlockQuantized) else t
