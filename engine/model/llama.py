"""``LlamaForCausalLM``: the Llama core decoder, which every architecture of the registry (engine/model/architectures/:
Llama 2/3.x, SmolLM, Mistral, Qwen2, Qwen3, their MoEs, Mixtral) is built as, in plain PyTorch, for inference.

One step runs a flattened batch over the paged KV cache:
``forward(input_ids [T], positions [T], kv_cache, attn_metadata) -> hidden [T, H]``, then
``compute_logits(hidden rows [N, H]) -> [N, V] float32`` for the rows that sample.
Each layer (layers.py): RMSNorm -> fused QKV projection (optional bias, Qwen2) -> per-head q/k RMSNorm (Qwen3) ->
RoPE (theta, Llama-3 scaling) -> paged GQA attention (attention.py) -> output projection -> residual -> RMSNorm ->
SwiGLU with fused gate/up (in a mixture-of-experts layer, its routed experts': moe.py) -> residual; prompt rows run
the bf16 prefill's layers instead where prefill computes in bf16 (bf16_prefill.py). Gemma 2 and 3 add, from the
config: embeddings scaled by sqrt(hidden), norms of the attention's and the MLP's outputs, GeGLU, a per-layer sliding
window (and Gemma 3's local RoPE base), a scale and a soft-cap of the scores, and a soft-cap of the logits.
Decode streams every weight once per step; on CPU the native kernels (engine/kernels/cpu_kernels.py) run the products
and the decode attention when ``kernels`` is given (``LlamaForCausalLM``'s default: whenever they can).

Its parameters are the layout of engine/weights/parameter_layout.py (names, shapes, what each fuses), which every
weight loader produces; ``from_state_dict`` checks a state dict against it before loading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels import bf16_kernels
from splitserve.engine.kernels.build import KernelsUnavailable
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype as resolve_prefill_dtype
from splitserve.engine.kernels.cpu_kernels import KernelChoice
from splitserve.engine.kernels.cpu_kernels import choose as choose_kernels
from splitserve.engine.kernels.decode_layers import DecodeLayers, LayerTensors
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.bf16_prefill import Bf16Prefill, copied_weights
from splitserve.engine.model.layers import (
    DecoderLayer,
    LayerFormats,
    Linear,
    Products,
    RMSNorm,
    fused_layers_refusal,
)
from splitserve.engine.model.moe import MoE
from splitserve.engine.model.rotary import RotaryEmbedding
from splitserve.engine.weights.parameter_layout import check_state_dict, product_weights
from splitserve.engine.weights.quantized_weights import BlockQuantized

logger = logging.getLogger(__name__)


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
        if self.kernels is not None and (refusal := fused_layers_refusal(config)):
            logger.info("%s: native products and attention, its layers composed in PyTorch around them: the fused "
                        "layer kernels lack %s", config.name, refusal)
        products = Products(weight_formats or {}, int8_activations)
        if config.tie_word_embeddings:  # one weight, laid out for the head's products, looked up by rows
            self.embed_tokens = products.linear("embed_tokens", config.hidden_size, config.vocab_size, False, dtype,
                                                device, self.kernels)
        else:
            # Left uninitialized (from_state_dict loads it): not skip_init, whose meta-device init imports torch's
            # compiler (torch._dynamo), seconds of every engine's start.
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
                config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            layer_products = Products(_layer_formats(products.formats, i), int8_activations)
            experts = MoE(config, dtype, device, self.kernels, layer_products) if i in config.moe_layers else None
            self.layers.append(DecoderLayer(config, dtype, device, self.kernels, layer_products, i, experts))
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
        copy of its layers' products for its prefill rows (engine/model/bf16_prefill.py), and with ``prefill_only`` (a
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
            if refusal := fused_layers_refusal(self.config):
                raise KernelsUnavailable(f"bf16 prefill runs the native kernels' fused layers, which lack {refusal}")
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
        x = embed.rows(input_ids) if isinstance(embed, Linear) else embed(input_ids)
        if self.config.scale_embeddings:  # Gemma: times sqrt(hidden_size), rounded to the hidden dtype first
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

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
            own_keys = attn_metadata.own_keys if kv_rows.is_scaled(kv_cache.dtype) else None  # (open_keys.py)
            self.kernels.decode_layers(x, self._decode_layers(kv_cache), positions, rotary.cos_table,
                                       rotary.sin_signed_table, attn_metadata.slot_mapping, group.tables,
                                       group.seq_lens, own_keys)
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
        """A decode-only step on the native kernels runs all its layers in one native call, where the fused kernels
        run this model's layers (``fused_layers_refusal``)."""
        return (self.kernels is not None and meta.is_decode_only and self.kernels.supports_cache_dtype(kv_cache.dtype)
                and fused_layers_refusal(self.config) is None)

    def _decode_layers(self, kv_cache: PagedKVCache) -> DecodeLayers:
        key = (id(kv_cache), kv_cache.k_blocks[0].data_ptr())
        if self._decode_table is None or self._decode_table[0] != key:
            layers = [
                LayerTensors(layer.input_norm.weight, layer.attn.qkv_proj.weight, layer.attn.qkv_proj.bias,
                             layer.attn.o_proj.weight, layer.post_attn_norm.weight, layer.mlp.gate_up_proj.weight,
                             layer.mlp.down_proj.weight, k, v, *(layer.attn.head_norms or (None, None)),
                             layer.attn.qkv_proj.weight_format,
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
        logits = head(hidden).float()
        if (cap := self.config.final_logit_softcap) is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits


def _layer_formats(formats: dict[str, str], layer: int) -> LayerFormats:
    prefix = f"layers.{layer}."
    return {name.removeprefix(prefix): f for name, f in formats.items() if name.startswith(prefix)}


def _widened(t: torch.Tensor | BlockQuantized, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize().to(dtype) if isinstance(t, BlockQuantized) else t
