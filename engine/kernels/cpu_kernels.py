"""splitserve's native CPU kernels (``engine/kernels/csrc/cpu_kernels.cpp``): their typed entry points, called through
ctypes.

Decode on a CPU is a stream of weight reads, and MKL's few-row products read weights well below the memory's speed
(docs/architecture.md has the measurements). The kernels here store every linear weight in panels of 16 outputs
([P, in, 16]), which a 1-row product reads as one stream and a many-row product runs as a GEMM micro-kernel (6 rows
x 16 outputs with AVX2, 12 rows x 32 outputs with AVX-512); and they attend a decode step's queries over K/V read
in place through the block tables instead of gathering a copy.

Weights kept in quantized blocks (``quantization``: docs/quantization.md) are panels of GGUF blocks instead
(``WEIGHT_FORMATS``, packed by engine/weights/quantized_weights.py), dequantized in registers by
``csrc/quant_kernels.cpp`` with the float32 path's arithmetic; every product entry point takes a weight with its
format.

``load()`` finds or builds the library (engine/kernels/build.py) and opens it, once per process; it says
which path the model's layers take (``KernelChoice``: the native kernels, or PyTorch ops and why), logging the
reason when it is PyTorch: not x86-64 with AVX2, FMA and F16C, no compiler, no writable cache directory, a failed
build, a library whose ABI disagrees with its declarations (engine/kernels/abi.py), or ``SPLITSERVE_CPU_KERNELS=0``.
The PyTorch path stays the reference in the tests. The same library holds the bf16 prefill's kernels
(engine/kernels/bf16_kernels.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from splitserve.engine.kernels import checks
from splitserve.engine.kernels.abi import ENTRY_POINTS, KernelABIError, check_abi, library_abi
from splitserve.engine.kernels.build import KernelsUnavailable, library_path
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
from splitserve.engine.kernels.weight_formats import (
    PANEL,
    QUANT_BLOCK,
    QUANTIZED_FORMATS,
    WEIGHT_FORMATS,
    format_code,
    in_features_of,
    is_weight,
)

if TYPE_CHECKING:
    from splitserve.engine.kernels.decode_layers import DecodeLayers
    from splitserve.engine.kv_formats.open_keys import OwnKeyPlan

logger = logging.getLogger(__name__)


class CpuKernels:
    """Typed entry points of the built library. Tensors are float32 (int64 for tables and lengths), on the CPU."""

    def __init__(self, path: Path):
        """Open the library at ``path``; raises ``KernelABIError`` when it is not the one declared here."""
        lib = ctypes.CDLL(str(path))
        check_abi(*library_abi(lib))
        for name, (argtypes, restype) in ENTRY_POINTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib
        self.path = path
        self.isa = "avx512" if lib.ss_vector_bits() == 512 else "avx2"  # what the GEMM micro-kernel runs on

    supports_head_dim = staticmethod(checks.supports_head_dim)
    supports_cache_dtype = staticmethod(checks.supports_cache_dtype)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (rows contiguous) @ W^T + bias -> [rows, out_features]."""
        rows, in_features = x.shape
        check_args(x.stride(1) == 1 and x.dtype == torch.float32 and packed.is_contiguous()
               and packed.shape[1] == in_features and packed.shape[0] * PANEL >= out_features,
               "linear: x does not match the weight")
        y = torch.empty(rows, out_features, dtype=torch.float32)
        self._lib.ss_linear(
            x.data_ptr(), rows, x.stride(0), packed.data_ptr(), out_features, in_features,
            None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads(),
        )
        return y

    def quant_linear(self, x: torch.Tensor, packed: torch.Tensor, weight_format: str, out_features: int,
                     bias: torch.Tensor | None = None, int8_activations: bool = False) -> torch.Tensor:
        """x [rows, in] (rows contiguous) @ W^T + bias -> [rows, out_features], W packed in quantized blocks
        (``weight_format``, one of ``QUANTIZED_FORMATS``); ``int8_activations``: x quantized to int8 per block of
        32, integer dot products (``format_code``)."""
        rows, in_features = x.shape
        check_args(x.stride(1) == 1 and x.dtype == torch.float32
               and is_weight(packed, weight_format, out_features, in_features),
               "quant_linear: x does not match the weight")
        y = torch.empty(rows, out_features, dtype=torch.float32)
        self._lib.ss_quant_linear(
            x.data_ptr(), rows, x.stride(0), packed.data_ptr(), format_code(weight_format, int8_activations),
            out_features,
            in_features, None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
            torch.get_num_threads(),
        )
        return y

    def quant_rows(self, packed: torch.Tensor, weight_format: str, in_features: int,
                   ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [n] of a weight packed in quantized blocks, as float32 [n, in_features]."""
        ids = ids.contiguous()
        check_args(packed.dtype == torch.uint8 and packed.is_contiguous() and ids.dtype == torch.int64
               and packed.shape[1] == in_features // QUANT_BLOCK * QUANTIZED_FORMATS[weight_format]
               and (len(ids) == 0 or 0 <= int(ids.min()) and int(ids.max()) < len(packed) * PANEL),
               "quant_rows: bad weight or ids")
        y = torch.empty(len(ids), in_features, dtype=torch.float32)
        self._lib.ss_quant_rows(packed.data_ptr(), WEIGHT_FORMATS[weight_format], in_features, ids.data_ptr(),
                                len(ids), y.data_ptr(), torch.get_num_threads())
        return y

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               own_keys: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D] (a ``CACHE_TYPES`` dtype); block_tables [B, nb]
        int64; seq_lens [B] int64 (keys per sequence, the new one included, all written) -> [B, Hq, D].
        ``own_keys`` [B, block_size, Hkv, D] float16: each query's own block's keys, its own included, which it reads
        from there (kv_formats/open_keys.py); None: every key as the pool stores it."""
        q = q.contiguous()
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        check_args(k_cache.is_contiguous() and v_cache.is_contiguous(), "attention: caches must be contiguous")
        check_caches(k_cache, v_cache, "attention", head_dim)
        check_args(block_tables.dtype == torch.int64 and block_tables.stride(1) == 1, "attention: bad block tables")
        check_args(seq_lens.dtype == torch.int64 and seq_lens.is_contiguous(), "attention: bad sequence lengths")
        check_own_keys(own_keys, (batch, block_size), k_cache, "attention")
        out = torch.empty_like(q)
        self._lib.ss_paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype], block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), pointer(own_keys), batch, num_heads, num_kv_heads,
            head_dim, block_size, scale, out.data_ptr(), torch.get_num_threads(),
        )
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                          prefix: int, scale: float, out: torch.Tensor,
                          own_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of one sequence's n new queries q [n, Hq, D] (rows may be strided, heads contiguous)
        at positions prefix .. prefix + n - 1 over its keys 0 .. prefix + n - 1, which the caches
        [num_blocks, block_size, Hkv, row] already hold (kv_formats/rows.py), found through ``blocks``
        [>= ceil((prefix + n) / block_size)] int64 -> ``out`` [n, Hq, D] (contiguous), filled and returned.
        ``own_keys``: the float16 keys [m, Hkv, D] of the positions from prefix's block's first on
        (``OwnKeyPlan.segment_index`` of its source), which each query reads for its own block's; None: every key as
        the pool holds it."""
        n, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        check_args(q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim,
                   "prefill attention: bad q")
        check_args(k_cache.is_contiguous() and v_cache.is_contiguous(), "prefill attention: caches must be contiguous")
        check_caches(k_cache, v_cache, "prefill attention", head_dim)
        check_args(blocks.dtype == torch.int64 and blocks.is_contiguous()
               and len(blocks) * block_size >= prefix + n, "prefill attention: bad block list")
        check_args(out.is_contiguous() and out.shape == q.shape and out.dtype == torch.float32,
                   "prefill attention: bad out")
        check_own_keys(own_keys, (prefix % block_size + n,), k_cache, "prefill attention")
        self._lib.ss_prefill_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype],
            blocks.data_ptr(), n, prefix, pointer(own_keys), num_heads, num_kv_heads, head_dim, block_size, scale,
            out.data_ptr(), num_heads * head_dim, torch.get_num_threads(),
        )
        return out

    def attention_input(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                        qkv_bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
                        sin_signed: torch.Tensor, num_heads: int, num_kv_heads: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, qkv_format: str = "float32",
                        int8_activations: bool = False, head_norms: HeadNorms | None = None) -> torch.Tensor:
        """A decoder layer up to its attention: qkv = RMSNorm(x) Wqkv^T (+ bias), q and k heads RMS-normalized with
        ``head_norms`` where given (Qwen3), then rotated (cos, sin_signed: [P, D] tables, indexed by positions [T]),
        k and v written to the caches at slot_mapping.
        x [T, H]; packed qkv weight (in ``qkv_format``, with int8 activations where asked: ``format_code``);
        caches [num_blocks, block_size, Hkv, row] (kv_formats/rows.py) -> qkv [T, (Hq + 2 Hkv) D]."""
        tokens, hidden = x.shape
        head_dim = cos.shape[1]
        width = (num_heads + 2 * num_kv_heads) * head_dim
        check_args(x.is_contiguous() and norm_weight.shape == (hidden,)
               and is_weight(qkv_weight, qkv_format, width, hidden) and self.supports_head_dim(head_dim)
               and head_dim == sin_signed.shape[1],
               "attention_input: x, norm and qkv weights do not match")
        check_cache_write(positions, slot_mapping, tokens, k_cache, v_cache, num_kv_heads, head_dim, "attention_input")
        q_norm, k_norm = head_norm_pointers(head_norms, head_dim, "attention_input")
        qkv = torch.empty(tokens, width, dtype=torch.float32)
        self._lib.ss_attention_input(
            x.data_ptr(), tokens, hidden, norm_weight.data_ptr(), eps, qkv_weight.data_ptr(),
            format_code(qkv_format, int8_activations),
            None if qkv_bias is None else qkv_bias.data_ptr(), qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(),
            sin_signed.data_ptr(), num_heads, num_kv_heads, head_dim, q_norm, k_norm, k_cache.data_ptr(),
            v_cache.data_ptr(), CACHE_TYPES[k_cache.dtype], slot_mapping.data_ptr(), torch.get_num_threads(),
        )
        return qkv

    def attention_output_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                                 down_weight: torch.Tensor, formats: tuple[str, str, str] = ("float32",) * 3,
                                 int8_activations: bool = False) -> None:
        """The rest of a decoder layer, in place on the residual stream x [T, H]: x += attn Wo^T, then
        x += down(silu(gate) * up) of RMSNorm(x). attn: [T, Hq D]; weights packed, in ``formats`` (o, gate_up,
        down), with int8 activations where asked (``format_code``)."""
        tokens, hidden = x.shape
        o_format, gate_up_format, down_format = formats
        o_code, gate_up_code, down_code = (format_code(f, int8_activations) for f in formats)
        inter = in_features_of(down_weight, down_format)
        check_args(x.is_contiguous() and attn.is_contiguous() and len(attn) == tokens
               and is_weight(o_weight, o_format, hidden, attn.shape[1]) and norm_weight.shape == (hidden,)
               and is_weight(gate_up_weight, gate_up_format, 2 * inter, hidden)
               and is_weight(down_weight, down_format, hidden, inter), "attention_output_and_mlp: shapes do not match")
        self._lib.ss_attention_output_and_mlp(
            x.data_ptr(), tokens, hidden, attn.data_ptr(), attn.shape[1], o_weight.data_ptr(), o_code,
            norm_weight.data_ptr(), eps, gate_up_weight.data_ptr(), gate_up_code, down_weight.data_ptr(), down_code,
            inter,
            torch.get_num_threads(),
        )

    def decode_layers(self, x: torch.Tensor, layers: DecodeLayers, positions: torch.Tensor, cos: torch.Tensor,
                      sin_signed: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, own_keys: OwnKeyPlan | None = None) -> None:
        """Every layer of a decode step (token b is sequence b's one new token) in one call, in place on the
        residual stream x [B, H]: the same kernels, in the same order, as the layer-by-layer calls. ``own_keys``: a
        scaled pool's plan of the step's own-block keys (kv_formats/open_keys.py), which the call follows as
        ``paged_attention`` does."""
        batch = len(x)
        check_args(x.is_contiguous() and x.dtype == torch.float32 and x.shape[1] == layers.hidden,
               "decode_layers: bad residual stream")
        check_args(all(t.dtype == torch.int64 and t.is_contiguous() and len(t) == batch
                   for t in (positions, slot_mapping, seq_lens)) and block_tables.dtype == torch.int64
               and block_tables.stride(1) == 1 and len(block_tables) == batch and cos.shape[1] == layers.head_dim,
               "decode_layers: bad positions, slots, block tables or lengths")
        steps = None if own_keys is None else _own_key_steps(own_keys, batch, layers.block_size)
        self._lib.ss_decode_layers(
            x.data_ptr(), batch, layers.hidden, len(layers.table), layers.table, CACHE_TYPES[layers.cache_dtype],
            layers.eps, positions.data_ptr(),
            cos.data_ptr(), sin_signed.data_ptr(), layers.num_heads, layers.num_kv_heads, layers.head_dim,
            layers.inter, slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            seq_lens.data_ptr(), None if steps is None else ctypes.addressof(steps), layers.block_size, layers.scale,
            torch.get_num_threads(),
        )


class _OwnKeySteps(ctypes.Structure):  # OwnKeySteps in csrc/cpu_kernels.cpp
    _fields_ = [("index", ctypes.c_void_p), ("read_blocks", ctypes.c_void_p), ("num_read", ctypes.c_int64),
                ("write_blocks", ctypes.c_void_p), ("write_positions", ctypes.c_void_p),
                ("write_rows", ctypes.c_void_p), ("num_writes", ctypes.c_int64)]


def _own_key_steps(plan: OwnKeyPlan, batch: int, block_size: int) -> _OwnKeySteps:
    """A decode step's ``OwnKeyPlan`` as the native struct (its tensors stay the plan's: it outlives the call)."""
    tensors = (plan.decode_index, plan.read_blocks, plan.write_blocks, plan.write_positions, plan.write_rows)
    check_args(plan.decode_index is not None and tuple(plan.decode_index.shape) == (batch, block_size)
               and all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors)
               and len(plan.write_positions) == len(plan.write_rows) == len(plan.write_blocks),
               "decode_layers: bad own-key plan")
    return _OwnKeySteps(plan.decode_index.data_ptr(), plan.read_blocks.data_ptr(), len(plan.read_blocks),
                        plan.write_blocks.data_ptr(), plan.write_positions.data_ptr(), plan.write_rows.data_ptr(),
                        len(plan.write_blocks))


class KernelChoice(NamedTuple):
    """Which code runs a model's layers: the native kernels, or PyTorch ops and why."""

    kernels: CpuKernels | None
    reason: str = ""  # why not native

    @property
    def path(self) -> str:
        """``native`` or ``pytorch`` (the ``kernels`` label of ``splitserve_engine_info``)."""
        return "pytorch" if self.kernels is None else "native"

    def __str__(self) -> str:
        if self.kernels is None:
            return f"PyTorch ops ({self.reason})"
        return f"native CPU kernels ({self.kernels.isa.upper()}, {self.kernels.path})"


def choose(device: torch.device | str, dtype: torch.dtype, enabled: bool = True) -> KernelChoice:
    """The kernels for a model on ``device`` in ``dtype`` when they can run it (CPU, float32) and are enabled."""
    if not enabled:
        return KernelChoice(None, "cpu_kernels=False")
    if torch.device(device).type != "cpu":
        return KernelChoice(None, f"device {torch.device(device).type}: the native kernels are for CPUs")
    if dtype != torch.float32:
        return KernelChoice(None, f"dtype {str(dtype).removeprefix('torch.')}: the native kernels compute in float32")
    return load()


@functools.cache
def load() -> KernelChoice:
    """The built kernels, or why not (logged), once per process."""
    choice = os.environ.get("SPLITSERVE_CPU_KERNELS", "1")
    if choice == "0":
        logger.info("native CPU kernels disabled by SPLITSERVE_CPU_KERNELS=0")
        return KernelChoice(None, "SPLITSERVE_CPU_KERNELS=0")
    if choice not in ("1", "avx2"):
        logger.warning("SPLITSERVE_CPU_KERNELS must be 0, 1 or avx2, got %r; building for this CPU", choice)
    try:
        return KernelChoice(build(avx512=choice != "avx2"))
    except KernelABIError as e:
        logger.error("%s; using the PyTorch path", e)
        return KernelChoice(None, str(e))
    except (KernelsUnavailable, OSError) as e:
        logger.warning("%s; using the PyTorch path", e)
        return KernelChoice(None, str(e))


def build(avx512: bool = True, vnni: bool = True) -> CpuKernels:
    """The kernels built for this CPU (``avx512=False``: without its AVX-512, if it has any; ``vnni=False``:
    without its VNNI dot products), built now if no cache directory holds them. Raises ``KernelsUnavailable``
    (``KernelABIError`` for a library that disagrees)."""
    return CpuKernels(library_path(avx512, vnni))
