"""A model's decoder layers as the native one-call decode (``CpuKernels.decode_layers``, ``ss_decode_layers`` in
``csrc/cpu_kernels.cpp``) reads them: ``LayerTensors`` per layer, checked once and laid out as a ctypes table of
pointers in ``DecodeLayers``, built once per KV cache (the weights never move) and reused by every decode step."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from splitserve.engine.kernels.checks import check_args, check_caches, head_norm_pointers, supports_head_dim
from splitserve.engine.kernels.weight_formats import format_code, in_features_of, is_weight
from splitserve.engine.kv_formats import rows as kv_rows


class LayerTensors(NamedTuple):
    """One decoder layer for ``DecodeLayers``: packed linear weights, norm weights, QKV bias (or None), caches, the q
    and k heads' norm weights (Qwen3; or None), each product's ``WEIGHT_FORMATS`` name, and whether its quantized
    products take int8 activations."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_attn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv_format: str = "float32"
    o_format: str = "float32"
    gate_up_format: str = "float32"
    down_format: str = "float32"
    int8_activations: bool = False

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self[:11]

    @property
    def formats(self) -> tuple[str, ...]:
        return self[11:15]


class _DecodeLayer(ctypes.Structure):  # DecodeLayer in the source
    _fields_ = ([(name, ctypes.c_void_p) for name in LayerTensors._fields[:11]]
                + [(name, ctypes.c_int64) for name in LayerTensors._fields[11:15]])


class DecodeLayers:
    """A model's layers as ``ss_decode_layers`` reads them, checked once: the weights never move, so the table of
    pointers is built once per KV cache and reused by every decode step."""

    def __init__(self, layers: list[LayerTensors], num_heads: int, num_kv_heads: int, eps: float, scale: float):
        first = layers[0]
        self.num_heads, self.num_kv_heads, self.eps, self.scale = num_heads, num_kv_heads, eps, scale
        self.hidden = first.input_norm.shape[0]
        self.inter = in_features_of(first.down, first.down_format)
        self.block_size, self.head_dim = first.k_cache.shape[1], kv_rows.head_dim_of(first.k_cache)
        check_caches(first.k_cache, first.v_cache, "DecodeLayers", self.head_dim)
        self.cache_dtype = first.k_cache.dtype
        width = (num_heads + 2 * num_kv_heads) * self.head_dim
        for layer in layers:
            vectors = (layer.input_norm, layer.post_attn_norm, layer.qkv_bias)
            check_args(all(t.dtype == torch.float32 and t.is_contiguous() for t in vectors if t is not None)
                   and all(t.dtype == self.cache_dtype and t.is_contiguous() for t in (layer.k_cache, layer.v_cache))
                   and layer.input_norm.shape == layer.post_attn_norm.shape == (self.hidden,)
                   and is_weight(layer.qkv, layer.qkv_format, width, self.hidden)
                   and (layer.qkv_bias is None or layer.qkv_bias.shape == (width,))
                   and is_weight(layer.o, layer.o_format, self.hidden, num_heads * self.head_dim)
                   and is_weight(layer.gate_up, layer.gate_up_format, 2 * self.inter, self.hidden)
                   and is_weight(layer.down, layer.down_format, self.hidden, self.inter)
                   and layer.k_cache.shape == layer.v_cache.shape == first.k_cache.shape
                   and layer.k_cache.shape[2] == num_kv_heads and supports_head_dim(self.head_dim)
                   and (layer.q_norm is None) == (layer.k_norm is None),
                   "DecodeLayers: a layer's tensors do not match")
            if layer.q_norm is not None:
                head_norm_pointers((layer.q_norm, layer.k_norm), self.head_dim, "DecodeLayers")
        self._layers = layers  # keeps the tensors alive while the table points at them
        self.table = (_DecodeLayer * len(layers))(*(
            _DecodeLayer(*(None if t is None else t.data_ptr() for t in layer.tensors),
                         *(format_code(f, layer.int8_activations) for f in layer.formats))
            for layer in layers
        ))
