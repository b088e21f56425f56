"""Weights kept in quantized blocks (docs/quantization.md): what ``EngineConfig.quantization`` other than ``none``
makes of a checkpoint, from the loader to the native kernels' panels.

- ``BlockQuantized``: one [out, in] weight as GGUF block formats hold it: per block of 32 inputs of an output, a
  float16 scale ``d`` (and, Q4_1, a float16 minimum ``m``) and 32 quants. Q4_0: w = d (q - 8), q in 0..15;
  Q4_1: w = d q + m; Q8_0: w = d q, q in -127..127. A loader fills one from a GGUF file's blocks as stored
  (``from_gguf``), or quantizes a float weight at load: ``quantize_int8`` (symmetric per output channel: Q8_0
  with the channel's one scale in every block) and ``quantize_int4`` (group 32, scale and minimum: Q4_1's math).
  ``dequantize`` widens it to float32 exactly as gguf's numpy dequantization does: the reference, and the
  weights of every path that does not run the kernels (CUDA, other dtypes, CPUs without them).
- ``pack_panels``: the kernels' layout (engine/kernels/csrc/quant_kernels.cpp), the same scales and quants reordered
  into panels of 16 outputs that a product streams linearly.
- ``quantize_state_dict``: a float state dict's products' weights (``parameter_layout.product_weights``) -> int8
  or int4.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels.weight_formats import PANEL, QUANT_BLOCK, quantized_shape
from splitserve.engine.weights.parameter_layout import EMBEDDING, HEAD_PARAMETERS, StateDict, product_weights

logger = logging.getLogger(__name__)

# GGUF's tensor type -> our format name, for the block formats the kernels run.
GGUF_TYPES = {2: "q4_0", 3: "q4_1", 8: "q8_0"}  # gguf.GGMLQuantizationType values
_GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}  # per block of 32 weights in the file


@dataclass(frozen=True)
class BlockQuantized:
    """An [out, in] weight in one of ``QUANTIZED_FORMATS``; ``in`` a multiple of 32."""

    format: str
    q: torch.Tensor  # [out, in]: uint8 0..15 (q4_0, q4_1) or int8 (q8_0)
    scale: torch.Tensor  # [out, in / 32] float16
    min: torch.Tensor | None = None  # [out, in / 32] float16, q4_1 only

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: d * q (+ m), each operation rounded to float32, as gguf's numpy code does."""
        d = self.scale.float().repeat_interleave(QUANT_BLOCK, dim=1)
        q = self.q.float() - 8 if self.format == "q4_0" else self.q.float()
        w = d * q
        return w + self.min.float().repeat_interleave(QUANT_BLOCK, dim=1) if self.min is not None else w

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BlockQuantized":
        """The weight with ``fn`` (a reordering of rows) applied to the rows of its quants, scales and minimums."""
        return BlockQuantized(self.format, fn(self.q), fn(self.scale), None if self.min is None else fn(self.min))

    @staticmethod
    def cat(parts: list["BlockQuantized | torch.Tensor"]) -> "BlockQuantized | torch.Tensor":
        """The parts' rows, in order (a fused product's weight): in their blocks when all share one format, else
        widened to float32 (a file may store q, k and v differently)."""
        if len({p.format if isinstance(p, BlockQuantized) else "float" for p in parts}) != 1:
            logger.info("fused weight with parts in different formats: widened to float32")
            return torch.cat([p.dequantize() if isinstance(p, BlockQuantized) else p.float() for p in parts])
        mins = None if parts[0].min is None else torch.cat([p.min for p in parts])
        return BlockQuantized(parts[0].format, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                              mins)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, format: str) -> "BlockQuantized":
        """A GGUF tensor's data ([rows, row bytes] uint8, GGUF's blocks) in ``format``, as stored."""
        rows = raw.shape[0]
        blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(rows, -1, _GGUF_BLOCK_BYTES[format])
        halves = lambda i: blocks[..., 2 * i: 2 * i + 2].contiguous().view(torch.float16)[..., 0]  # noqa: E731
        if format == "q8_0":
            return cls(format, blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), halves(0))
        header = 4 if format == "q4_1" else 2
        qs = blocks[..., header:]  # byte j: element j in its low nibble, element j + 16 in its high one
        q = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(rows, -1)
        return cls(format, q, halves(0), halves(1) if format == "q4_1" else None)


def quantize_int8(weight: torch.Tensor) -> BlockQuantized:
    """Symmetric per output channel: d = max |w| / 127 (float16), q = round(w / d) in -127..127, as Q8_0 blocks
    that all carry their channel's d."""
    w = weight.float()
    d = (w.abs().amax(dim=1) / 127).half()  # [out]
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return BlockQuantized("q8_0", q, d[:, None].expand(-1, w.shape[1] // QUANT_BLOCK).contiguous())


def quantize_int4(weight: torch.Tensor) -> BlockQuantized:
    """Group-wise, group 32, scale and zero point: per group m = min w, d = (max w - m) / 15 (both float16),
    q = round((w - m) / d) in 0..15, so w ~ d q + m: Q4_1 blocks."""
    out, in_ = weight.shape
    groups = weight.float().reshape(out, -1, QUANT_BLOCK)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = torch.round((groups - m.float()[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return BlockQuantized("q4_1", q.reshape(out, in_), d, m)


def pack_panels(weight: BlockQuantized) -> torch.Tensor:
    """The kernels' layout, uint8 ``quantized_shape(format, out, in)``: per panel of 16 outputs (the last one
    padded with zero weights), per block of 32 inputs, the 16 scales, the 16 minimums (Q4_1), then the quants:
    Q4_* as 4 chunks of 16 32-bit lanes, lane o's nibble n of chunk g being output o's quant for input 8g + n;
    Q8_0 as 8 chunks of 16 32-bit lanes, byte t of lane o of chunk 2g + h being output o's quant for input
    8g + 2t + h: the inputs of a 4-bit chunk's low (h = 0) or high (h = 1) nibbles, so that both formats' lanes
    meet the same int8 activations (engine/kernels/csrc/quant_kernels.cpp reads them)."""
    out, in_ = weight.shape
    panels, blocks = -(-out // PANEL), in_ // QUANT_BLOCK

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [out, ...] -> [P, 16, ...], zero rows padding the last panel
        return F.pad(t, (0, 0, 0, panels * PANEL - out)).view(panels, PANEL, *t.shape[1:])

    def scales(t: torch.Tensor) -> torch.Tensor:  # [out, nb] float16 -> [P, nb, 32] bytes
        return by_panel(t.view(torch.int16)).transpose(1, 2).contiguous().view(torch.uint8)

    parts = [scales(weight.scale)] + ([] if weight.min is None else [scales(weight.min)])
    if weight.format == "q8_0":  # input 8g + 2t + h is byte t of chunk 2g + h's lanes, as a 4-bit chunk's nibbles
        q = by_panel(weight.q.view(torch.uint8)).view(panels, PANEL, blocks, 4, 4, 2)  # [P, o, b, g, t, h]
        parts.append(q.permute(0, 2, 3, 5, 1, 4).reshape(panels, blocks, QUANT_BLOCK * PANEL))
    else:
        q = by_panel(weight.q).view(panels, PANEL, blocks, 4, 4, 2)  # [P, o, b, g, byte t, nibble of the byte]
        nibbles = q[..., 0] | (q[..., 1] << 4)
        parts.append(nibbles.permute(0, 2, 3, 1, 4).reshape(panels, blocks, 4 * PANEL * 4))
    packed = torch.cat(parts, dim=-1).reshape(panels, -1)
    assert packed.shape == quantized_shape(weight.format, out, in_)
    return packed


def quantize_state_dict(state: StateDict, config: ModelConfig, method: str) -> StateDict:
    """``state`` with its ``product_weights`` quantized by ``method``: ``int8`` (all Q8_0 per channel) or
    ``int4`` (the layers' products Q4_1 group 32; the head, read once per step but the largest weight of a small
    model and the most sensitive, int8, as llama.cpp keeps its output tensor at 8 bits or more). Weights whose
    input size is not a multiple of 32, and any already quantized, are kept as they are."""
    if method not in ("int8", "int4"):
        raise ValueError(f"quantize_state_dict: method must be int8 or int4, got {method!r}")
    head = {p.name for p in HEAD_PARAMETERS} | {EMBEDDING.name}
    quantized = dict(state)
    for name in product_weights(config):
        weight = state[name]
        if isinstance(weight, BlockQuantized):
            continue
        if weight.shape[1] % QUANT_BLOCK:
            logger.warning("%s: %d inputs are not whole blocks of %d; kept in float", name, weight.shape[1],
                           QUANT_BLOCK)
            continue
        quantized[name] = quantize_int4(weight) if method == "int4" and name not in head else quantize_int8(weight)
    return quantized
