// The products over weights kept in quantized blocks (quant_kernels.cpp), as cpu_kernels.cpp's decoder-layer
// entry points call them: every linear weight there is a pointer and a WeightFormat.
#pragma once

#include <stdint.h>

// How a linear weight is stored (WEIGHT_FORMATS in engine/kernels/weight_formats.py): float32 panels [P, in, 16], or
// panels of 16 outputs x blocks of 32 inputs in one of GGUF's block formats (quant_kernels.cpp describes the layout).
enum WeightFormat : int { kWeightF32 = 0, kWeightQ4_0 = 1, kWeightQ4_1 = 2, kWeightQ8_0 = 3 };

// OR'd into a quantized WeightFormat (INT8_ACTIVATIONS in engine/kernels/weight_formats.py): the product quantizes
// its input rows to int8 per block of 32 and sums integer dot products (quant_kernels.cpp, "int8 activations"):
// faster, and no longer the float32 path's bits. A float32 weight ignores it.
constexpr int kInt8Activations = 16;
constexpr int kFormatMask = 15;

extern "C" {

void ss_linear(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t out, int64_t in,
               const float* bias, float* y, int64_t ldy, int threads);

void ss_quant_linear(const float* x, int64_t rows, int64_t ldx, const void* packed, int format, int64_t out,
                     int64_t in, const float* bias, float* y, int64_t ldy, int threads);

void ss_quant_rows(const void* packed, int format, int64_t in, const int64_t* ids, int64_t n, float* y,
                   int threads);
}

// y[rows, out] = x W^T + bias for a weight in any WeightFormat: ss_linear or ss_quant_linear.
inline void weight_product(const float* x, int64_t rows, int64_t ldx, const void* weight, int format, int64_t out,
                           int64_t in, const float* bias, float* y, int64_t ldy, int threads) {
  if ((format & kFormatMask) == kWeightF32) {
    ss_linear(x, rows, ldx, static_cast<const float*>(weight), out, in, bias, y, ldy, threads);
  } else {
    ss_quant_linear(x, rows, ldx, weight, format, out, in, bias, y, ldy, threads);
  }
}
