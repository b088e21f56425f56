"""How a product's weight is stored for the native CPU kernels: its format (float32 panels of 16 outputs, or panels
of GGUF blocks) and the packed shape of each. The float32 and quantized products (engine/kernels/cpu_kernels.py), the
decode layers' table (decode_layers.py) and the quantized weights' packing (engine/weights/quantized_weights.py) read
them from here; the bf16 prefill's panels are bf16_kernels.py's."""

from __future__ import annotations

import torch

PANEL = 16  # outputs per weight panel; kPanel in the sources
# How a product's weight is stored (WeightFormat in csrc/quant_kernels.h): float32 panels [P, in, 16], or panels
# of GGUF blocks (engine/weights/quantized_weights.py packs them), [P, in / 32 * bytes per panel block] uint8.
WEIGHT_FORMATS = {"float32": 0, "q4_0": 1, "q4_1": 2, "q8_0": 3}
QUANT_BLOCK = 32  # inputs per block
QUANTIZED_FORMATS = {"q4_0": 16 * 2 + 256, "q4_1": 16 * 4 + 256, "q8_0": 16 * 2 + 512}  # bytes per panel block
# OR'd into a quantized format's code (kInt8Activations in csrc/quant_kernels.h): the product quantizes its input
# rows to int8 per block of 32 and sums integer dot products (EngineConfig.int8_activations, docs/quantization.md).
INT8_ACTIVATIONS = 16


def format_code(weight_format: str, int8_activations: bool = False) -> int:
    """The kernels' code for a product over a weight in ``weight_format`` (``WEIGHT_FORMATS``), with int8
    activations where asked and the weight is quantized (a float32 weight's product stays float32)."""
    code = WEIGHT_FORMATS[weight_format]
    return code | INT8_ACTIVATIONS if int8_activations and weight_format != "float32" else code


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """A float32 weight's panels: [ceil(out / 16), in, 16]."""
    return (-(-out_features // PANEL), in_features, PANEL)


def quantized_shape(weight_format: str, out_features: int, in_features: int) -> tuple[int, int]:
    """A quantized weight's panels (one of ``QUANTIZED_FORMATS``): [ceil(out / 16), in / 32 * bytes per block]."""
    return (-(-out_features // PANEL), in_features // QUANT_BLOCK * QUANTIZED_FORMATS[weight_format])


def weight_shape(weight_format: str, out_features: int, in_features: int) -> tuple[int, ...]:
    """The packed shape of a product's weight in any of ``WEIGHT_FORMATS``."""
    if weight_format == "float32":
        return packed_shape(out_features, in_features)
    return quantized_shape(weight_format, out_features, in_features)


def is_weight(weight: torch.Tensor, weight_format: str, out_features: int, in_features: int) -> bool:
    """Whether ``weight`` is a product's packed weight of that format and size, ready for the kernels."""
    if weight_format != "float32" and in_features % QUANT_BLOCK:
        return False
    dtype = torch.float32 if weight_format == "float32" else torch.uint8
    return (weight.dtype == dtype and weight.is_contiguous()
            and weight.shape == weight_shape(weight_format, out_features, in_features))


def in_features_of(weight: torch.Tensor, weight_format: str) -> int:
    """The input size of a packed weight."""
    if weight_format == "float32":
        return weight.shape[1]
    return weight.shape[1] // QUANTIZED_FORMATS[weight_format] * QUANT_BLOCK
