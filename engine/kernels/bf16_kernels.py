"""The bf16 prefill's kernels (``csrc/bf16_kernels.cpp``, ``csrc/bf16_tiles.h``): their typed entry points, the
weights' packing, and which ISA multiplies.

Every bf16 product goes through one tiling that the kernels own (``csrc/bf16_tiles.h`` explains it): weights packed
once at load as panels of 16 outputs with their inputs in pairs (``pack``), every output summed in float32 in one
fixed order, work split over tiles of rows and groups of panels, never over a sum. So a prompt position's K/V and
logits do not depend on its chunk, its batch or the thread count, on every CPU, by construction (oneDNN's products,
which this replaced, chose kernels by shape and threads: on an AMX CPU a position's bits followed its chunk).

The ISA (``BF16_ISAS``; ``cpu_features.bf16_isa`` picks it from the CPU's flags, which tests can feed):

- ``amx``: AMX tiles (Sapphire Rapids and later), 32 rows x 32 outputs, 32 inputs per instruction;
- ``avx512_bf16``: ``vdpbf16ps`` (Zen 4, Cooper Lake), 6 rows x 64 outputs;
- ``fma``: the same arithmetic as ``vdpbf16ps`` on AVX2 FMAs, the same bits (any x86-64 the kernels run on; slow:
  ``auto`` keeps float32 prefill on such CPUs);
- ``amx-emulated``: ``amx``'s tiling with the tiles emulated in scalar code, so that a CPU without AMX tests the AMX
  path's structure (tiles, padding, remainders); never chosen for serving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from splitserve.engine.kernels.build import KernelsUnavailable
from splitserve.engine.kernels.checks import (
    CACHE_TYPES,
    HeadNorms,
    check_args,
    check_cache_write,
    check_caches,
    check_own_keys,
    head_norm_pointers,
    pointer,
)
from splitserve.engine.kernels.cpu_features import bf16_isas
from splitserve.engine.kernels.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)

BF16_ISAS = {"fma": 0, "avx512_bf16": 1, "amx": 2, "amx-emulated": 3}  # bf16::Isa in csrc/bf16_tiles.h
PANEL = 16  # outputs per panel
K_STEP = 32  # inputs per AMX tile row: a product's inputs are padded with zeros to a multiple of it


def padded_inputs(n: int) -> int:
    """A product's inputs as the kernels hold them: ``n`` rounded up to ``K_STEP``."""
    return -(-n // K_STEP) * K_STEP


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A product's weight [out, in] (any float dtype) in the kernels' layout: bf16 panels of 16 outputs with their
    inputs in pairs, [ceil(out / 16), kp / 2, 16, 2] (kp: ``padded_inputs(in)``), zero padded."""
    out, inputs = weight.shape
    panels, kp = -(-out // PANEL), padded_inputs(inputs)
    padded = F.pad(weight.detach().to(torch.bfloat16), (0, kp - inputs, 0, panels * PANEL - out))
    return padded.view(panels, PANEL, kp // 2, 2).transpose(1, 2).contiguous()


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2 I, in] (gate rows first) packed with its panels interleaved, gate 0, up 0, gate 1,
    up 1, ...: each tile of the product then holds the gate and up of the same outputs, and SiLU(gate) * up is
    computed from the tile (``ss_bf16_output_and_mlp``)."""
    gate, up = weight.chunk(2)
    return torch.stack((pack(gate), pack(up)), dim=1).flatten(0, 1)


def is_packed(packed: torch.Tensor, out_features: int, in_features: int) -> bool:
    """Whether ``packed`` is ``pack`` of a weight [out_features, in_features]."""
    shape = (-(-out_features // PANEL), padded_inputs(in_features) // 2, PANEL, 2)
    return packed.dtype == torch.bfloat16 and packed.is_contiguous() and packed.shape == shape


class Bf16Kernels:
    """The bf16 entry points of the native kernels' library, on one ISA. Activations and weights are bf16, sums
    and the residual stream float32, everything on the CPU."""

    def __init__(self, kernels: CpuKernels, isa: str):
        """The library of ``kernels``, multiplying on ``isa`` (one of ``BF16_ISAS``); raises ``KernelsUnavailable``
        when this CPU (or, for AMX, the operating system) does not run it."""
        check_args(isa in BF16_ISAS, f"bf16 ISA must be one of {', '.join(BF16_ISAS)}, got {isa!r}")
        self._lib, self.isa, self._code = kernels._lib, isa, BF16_ISAS[isa]
        if not self._lib.ss_bf16_isa_ready(self._code):
            raise KernelsUnavailable(f"bf16 products on {isa} do not run on this CPU"
                                     + (" (or Linux refused this process the AMX tiles)" if isa == "amx" else ""))

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] bf16 @ W^T (+ bias) -> [rows, out_features] float32, W ``pack``ed."""
        rows, in_features = x.shape
        check_args(x.dtype == torch.bfloat16 and is_packed(packed, out_features, in_features)
                   and (bias is None or bias.dtype == torch.float32 and bias.shape == (out_features,)),
                   "bf16 linear: x, the weight and the bias do not match")
        kp = padded_inputs(in_features)
        x = F.pad(x, (0, kp - in_features)).contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        self._call(self._lib.ss_bf16_linear, x.data_ptr(), rows, kp, packed.data_ptr(), out_features, kp,
                   None if bias is None else bias.data_ptr(), y.data_ptr(), out_features)
        return y

    def attention_input(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: torch.Tensor,
                        qkv_bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
                        sin_signed: torch.Tensor, num_heads: int, num_kv_heads: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        head_norms: HeadNorms | None = None) -> torch.Tensor:
        """A layer's prompt rows up to their attention: bf16(RMSNorm(x)) Wqkv^T (+ bias) in float32, q and k heads
        RMS-normalized with ``head_norms`` where given (Qwen3), then rotated (cos, sin_signed: [P, D] tables indexed
        by positions [T]), k and v written to the caches at slot_mapping.
        x [T, H] float32; ``qkv`` ``pack``ed -> qkv [T, (Hq + 2 Hkv) D] float32."""
        tokens, hidden = x.shape
        head_dim = cos.shape[1]
        width = (num_heads + 2 * num_kv_heads) * head_dim
        check_args(x.is_contiguous() and x.dtype == torch.float32 and norm_weight.shape == (hidden,)
                   and is_packed(qkv, width, hidden) and (qkv_bias is None or qkv_bias.shape == (width,))
                   and head_dim == sin_signed.shape[1] and head_dim % 8 == 0 and head_dim <= 512,
                   "bf16 attention_input: x, the norm and the qkv weight do not match")
        check_cache_write(positions, slot_mapping, tokens, k_cache, v_cache, num_kv_heads, head_dim,
                          "bf16 attention_input")
        q_norm, k_norm = head_norm_pointers(head_norms, head_dim, "bf16 attention_input")
        out = torch.empty(tokens, width, dtype=torch.float32)
        self._call(self._lib.ss_bf16_attention_input, x.data_ptr(), tokens, hidden, norm_weight.data_ptr(), eps,
                   qkv.data_ptr(), None if qkv_bias is None else qkv_bias.data_ptr(), out.data_ptr(),
                   positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), num_heads, num_kv_heads, head_dim,
                   q_norm, k_norm, k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype],
                   slot_mapping.data_ptr())
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                          prefix: int, scale: float, out: torch.Tensor, own_keys: torch.Tensor | None = None) -> None:
        """Causal attention of one sequence's n new queries q [n, Hq, D] float32 (rows may be strided, heads
        contiguous) at positions prefix .. prefix + n - 1 over its keys 0 .. prefix + n - 1, which the caches
        [num_blocks, block_size, Hkv, row] hold (kv_formats/rows.py), found through ``blocks`` (int64) -> ``out``
        [n, >= Hq D] bf16 (rows contiguous, may be strided), its first Hq D columns written. ``own_keys``: as
        ``CpuKernels.prefill_attention``'s."""
        n, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        check_args(q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim,
                   "bf16 prefill attention: bad q")
        check_args(k_cache.is_contiguous() and v_cache.is_contiguous() and num_heads % num_kv_heads == 0,
                   "bf16 prefill attention: caches do not match q")
        check_caches(k_cache, v_cache, "bf16 prefill attention", head_dim)
        check_args(blocks.dtype == torch.int64 and blocks.is_contiguous() and len(blocks) * block_size >= prefix + n,
                   "bf16 prefill attention: bad block list")
        check_args(out.dtype == torch.bfloat16 and out.stride(1) == 1 and len(out) == n
                   and out.shape[1] >= num_heads * head_dim, "bf16 prefill attention: bad out")
        check_own_keys(own_keys, (prefix % block_size + n,), k_cache, "bf16 prefill attention")
        self._call(self._lib.ss_bf16_prefill_attention, q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                   v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype], blocks.data_ptr(), n, prefix, pointer(own_keys),
                   num_heads, num_kv_heads, head_dim, block_size, scale, out.data_ptr(), out.stride(0))

    def output_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, attn_width: int, o: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor, down: torch.Tensor,
                       inter: int) -> None:
        """The rest of a layer's prompt rows, in place on the residual stream x [T, H] float32: x += attn Wo^T, then
        x += down(silu(gate) * up) of bf16(RMSNorm(x)). attn: [T, padded_inputs(attn_width)] bf16 (its padding
        zero); weights ``pack``ed (``gate_up``: ``pack_gate_up`` of [2 inter, H])."""
        tokens, hidden = x.shape
        check_args(x.is_contiguous() and x.dtype == torch.float32 and attn.is_contiguous()
                   and attn.dtype == torch.bfloat16 and attn.shape == (tokens, padded_inputs(attn_width))
                   and is_packed(o, hidden, attn_width) and norm_weight.shape == (hidden,)
                   and is_packed(gate_up, 2 * -(-inter // PANEL) * PANEL, hidden) and is_packed(down, hidden, inter),
                   "bf16 output_and_mlp: shapes do not match")
        self._call(self._lib.ss_bf16_output_and_mlp, x.data_ptr(), tokens, hidden, attn.data_ptr(), attn_width,
                   o.data_ptr(), norm_weight.data_ptr(), eps, gate_up.data_ptr(), down.data_ptr(), inter)

    def _call(self, entry_point, *args) -> None:
        if entry_point(*args, torch.get_num_threads(), self._code) != 0:
            raise KernelsUnavailable(f"bf16 products on {self.isa} do not run on this CPU")


def choose(kernels: CpuKernels, flags: Iterable[str] | None = None) -> Bf16Kernels:
    """The bf16 kernels on the best ISA this CPU runs (``cpu_features.bf16_isas``, ``flags``: default this CPU's):
    an ISA the library refuses (Linux may refuse this process the AMX tiles) gives way to the next, with a warning.
    Raises ``KernelsUnavailable`` when none runs."""
    problems = []
    for isa in bf16_isas(flags):
        try:
            return Bf16Kernels(kernels, isa)
        except KernelsUnavailable as e:
            logger.warning("%s; trying the next ISA", e)
            problems.append(str(e))
    raise KernelsUnavailable("no ISA for bf16 products on this CPU" + (f" ({'; '.join(problems)})" if problems else ""))
