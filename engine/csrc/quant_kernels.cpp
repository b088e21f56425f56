// splitserve's products over weights kept in quantized blocks (docs/quantization.md): GGUF's Q4_0, Q4_1 and Q8_0,
// which also hold the int8 (per-channel) and int4 (group 32, scale + min) formats quantized at load.
//
// Built into the same library as cpu_kernels.cpp (engine/cpu_kernels_build.py), called through ctypes
// (engine/cpu_kernels.py) and by cpu_kernels.cpp's decoder-layer entry points (quant_kernels.h).
//
// Layout (engine/quantized_weights.py packs it at load): panels of 16 outputs, each one contiguous stream of its
// blocks of 32 inputs, so that a 1-row product reads the weight once, linearly, at the memory's speed. A panel's
// block b holds, in order:
//   - d[16], the 16 outputs' scales (float16), then for Q4_1 m[16], their minimums (float16);
//   - Q4_0 / Q4_1: 4 chunks of 64 bytes, chunk g = 16 little-endian 32-bit lanes, lane o's nibble n (bits 4n..4n+3)
//     being output o's quant for input 8g + n (0..15; the weight is d (q - 8) for Q4_0, d q + m for Q4_1);
//   - Q8_0: 32 rows of 16 signed bytes, row k holding the 16 outputs' quants for input k (weight d q).
// These are GGUF's blocks, the same scales and quants, in another order: the weights are exactly the file's.
//
// Every weight is dequantized exactly as the float32 path dequantizes the file (gguf's numpy code: d * q, exact in
// float32 for a float16 scale and a quant of at most 8 bits, then + m, rounded), and every output sums its products
// in order of the inputs, one fused multiply-add each, then adds its bias: ss_linear's arithmetic on the float32
// path's weights. So a product over quantized blocks gives the float32 path's bits, whatever the row count and the
// ISA: "gguf" answers as "none" does, token for token, and a row gets the same bits alone, in a batch, in a
// speculative verification or in a prefill.
//
// Few rows (decode, speculative verification; rows < kDequantRows) are computed in registers: a block's quants
// become 16 outputs' weights in a few instructions (a shift, and a permutation that looks the nibble up in a
// 16-entry table, then the scale and minimum; Q8_0: sign extension and conversion), each serving up to kTileRows
// rows, over several panels at once so that enough sums are in flight. Many rows (prefill) dequantize two panels at
// a time into float32 panels ([in, 16]) and run ss_linear's GEMM micro-kernel on them. Either way a decode step
// reads the blocks' bytes (a fifth of float32's for Q4_1), not float32's.

#include "quant_kernels.h"

#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace {

constexpr int kQPanel = 16;  // outputs per panel, as kPanel in cpu_kernels.cpp
constexpr int kBlock = 32;   // inputs per block
constexpr int64_t kDequantRows = 16;  // from this many rows on, dequantize panels and run the float32 GEMM

template <int F>
struct Format;

template <>
struct Format<kWeightQ4_0> {
  static constexpr int kHeader = 32;  // d[16]
  static constexpr int kBytes = kHeader + 256;
};

template <>
struct Format<kWeightQ4_1> {
  static constexpr int kHeader = 64;  // d[16], m[16]
  static constexpr int kBytes = kHeader + 256;
};

template <>
struct Format<kWeightQ8_0> {
  static constexpr int kHeader = 32;
  static constexpr int kBytes = kHeader + kBlock * kQPanel;
};

// 16 outputs' float32 values, and a chunk of 16 lanes of 8 nibbles: one register with AVX-512, two with AVX2. The
// tiles below are written once over these; both ISAs round every operation the same way.
#ifdef __AVX512F__
constexpr int kTileRows = 4;
constexpr int kPanelGroup = 4;
// Panels per tile of R rows: R x NP sums + NP scales, minimums and quant chunks within the 32 registers.
constexpr int panels_per_tile(int rows) { return rows <= 2 ? 4 : 2; }

struct V16 {
  __m512 v;
};
struct N16 {
  __m512i v;
};

inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vbcast(const float* x) { return {_mm512_set1_ps(*x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vhalf(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline N16 nload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }

// Nibble n of every lane as float32: q (Q4_1) or q - 8 (Q4_0). vpermps reads only an index's low 4 bits, so the
// shifted lane indexes the table as it is.
template <int F>
inline V16 nibble(N16 q, int n) {
  const __m512 table = F == kWeightQ4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                        : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(q.v, 4 * n), table)};
}

inline V16 q8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
#else
constexpr int kTileRows = 2;
constexpr int kPanelGroup = 2;
constexpr int panels_per_tile(int rows) { return rows == 1 ? 2 : 1; }  // sums, scales, quants in 16 registers

struct V16 {
  __m256 lo, hi;
};
struct N16 {
  __m256i lo, hi;
};

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vbcast(const float* x) {
  const __m256 b = _mm256_broadcast_ss(x);
  return {b, b};
}
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vhalf(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline N16 nload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}

template <int F>
inline __m256 nibble8(__m256i q, int n) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q, 4 * n), _mm256_set1_epi32(15)));
  return F == kWeightQ4_0 ? _mm256_sub_ps(v, _mm256_set1_ps(8.0f)) : v;  // exact: small integers
}

template <int F>
inline V16 nibble(N16 q, int n) {
  return {nibble8<F>(q.lo, n), nibble8<F>(q.hi, n)};
}

inline V16 q8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
#endif

// Rows [0, R) of x (stride ldx) times NP consecutive panels (panel j at panels + j * panel_bytes) of nb blocks each
// -> y rows (stride ldy), the last panel keeping `valid_last` outputs; bias: nullptr or the panels' (padded)
// values. Each weight is dequantized in registers as dequantize_panel does it, and each output sums its products in
// order of the inputs: the bits of ss_linear. NP panels' sums (R x NP chains) keep the multiply-add units busy.
template <int F, int R, int NP>
void quant_tile(const float* x, int64_t ldx, const uint8_t* panels, int64_t panel_bytes, int64_t nb,
                const float* bias, float* y, int64_t ldy, int valid_last) {
  V16 acc[R][NP];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[r][j] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block[NP];
    V16 d[NP], m[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      block[j] = panels + j * panel_bytes + b * Format<F>::kBytes;
      d[j] = vhalf(block[j]);
      m[j] = F == kWeightQ4_1 ? vhalf(block[j] + 32) : vzero();
    }
    const float* xb = x + b * kBlock;
#pragma GCC unroll 1
    for (int g = 0; g < 4; ++g) {
      N16 q[NP];
      if constexpr (F != kWeightQ8_0) {
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) q[j] = nload(block[j] + Format<F>::kHeader + 64 * g);
      }
#pragma GCC unroll 8
      for (int n = 0; n < 8; ++n) {
        const int k = 8 * g + n;
#pragma GCC unroll 4
        for (int j = 0; j < NP; ++j) {
          V16 w;
          if constexpr (F == kWeightQ8_0) {
            w = vmul(d[j], q8(block[j] + Format<F>::kHeader + k * kQPanel));
          } else {
            w = vmul(d[j], nibble<F>(q[j], n));
            if constexpr (F == kWeightQ4_1) w = vadd(w, m[j]);
          }
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][j] = vfma(vbcast(xb + r * ldx + k), w, acc[r][j]);
        }
      }
    }
  }
  alignas(64) float tmp[kQPanel];
#pragma GCC unroll 4
  for (int j = 0; j < NP; ++j) {
    const int valid = j == NP - 1 ? valid_last : kQPanel;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const V16 out = bias != nullptr ? vadd(acc[r][j], vload(bias + j * kQPanel)) : acc[r][j];
      if (valid == kQPanel) {
        vstore(y + r * ldy + j * kQPanel, out);
      } else {
        vstore(tmp, out);
        memcpy(y + r * ldy + j * kQPanel, tmp, sizeof(float) * valid);
      }
    }
  }
}

using QuantTileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, int64_t,
                             int);

// kTiles[R][NP]: the tile of R rows (1..kTileRows) and NP panels (1..kPanelGroup).
template <int F, int R, int... NP>
constexpr std::array<QuantTileFn, sizeof...(NP) + 1> tiles_of_rows(std::integer_sequence<int, NP...>) {
  return {nullptr, quant_tile<F, R, NP + 1>...};
}

template <int F, int... R>
constexpr std::array<std::array<QuantTileFn, kPanelGroup + 1>, sizeof...(R) + 1> quant_tiles(
    std::integer_sequence<int, R...>) {
  return {std::array<QuantTileFn, kPanelGroup + 1>{},
          tiles_of_rows<F, R + 1>(std::make_integer_sequence<int, kPanelGroup>())...};
}

// Panel p's weights as float32, [in, 16] (the float32 weights' panel layout): d * q (exact), then + m for Q4_1,
// as the float32 path's dequantization (gguf's, in numpy) computes them.
template <int F>
void dequantize_panel(const uint8_t* panel, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = panel + b * Format<F>::kBytes;
    const uint8_t* quants = block + Format<F>::kHeader;
    const V16 d = vhalf(block);
    float* o = out + b * kBlock * kQPanel;
    for (int k = 0; k < kBlock; ++k) {
      V16 w;
      if constexpr (F == kWeightQ8_0) {
        w = vmul(d, q8(quants + k * kQPanel));
      } else {
        w = vmul(d, nibble<F>(nload(quants + 64 * (k / 8)), k % 8));
        if constexpr (F == kWeightQ4_1) w = vadd(w, vhalf(block + 32));
      }
      vstore(o + k * kQPanel, w);
    }
  }
}

template <int F>
void quant_linear(const float* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t out, int64_t in,
                  const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t nb = in / kBlock;
  const int64_t panel_bytes = nb * Format<F>::kBytes;
  const int64_t panels = (out + kQPanel - 1) / kQPanel;
  std::vector<float> bias_padded;  // whole panels, so that a tile reads the bias like the weights
  if (bias != nullptr) {
    bias_padded.assign(panels * kQPanel, 0.0f);
    memcpy(bias_padded.data(), bias, sizeof(float) * out);
  }
  const float* padded = bias != nullptr ? bias_padded.data() : nullptr;
  if (rows >= kDequantRows) {
    constexpr int64_t kGroup = 2;  // panels per GEMM call: the AVX-512 micro-kernel's 2 x 16 outputs
    const int64_t groups = (panels + kGroup - 1) / kGroup;
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> weights(kGroup * in * kQPanel);
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t p0 = g * kGroup, np = std::min(kGroup, panels - p0);
        for (int64_t i = 0; i < np; ++i) {
          dequantize_panel<F>(packed + (p0 + i) * panel_bytes, nb, weights.data() + i * in * kQPanel);
        }
        const int64_t o0 = p0 * kQPanel;
        ss_linear(x, rows, ldx, weights.data(), std::min(np * kQPanel, out - o0), in,
                  padded != nullptr ? padded + o0 : nullptr, y + o0, ldy, 1);
      }
    }
    return;
  }
  static constexpr auto tiles = quant_tiles<F>(std::make_integer_sequence<int, kTileRows>());
  const int64_t groups = (panels + kPanelGroup - 1) / kPanelGroup;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * kPanelGroup, np = std::min<int64_t>(kPanelGroup, panels - p0);
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
      // Tiles of up to panels_per_tile(n) panels: as many sums as the registers hold.
      for (int64_t p = p0; p < p0 + np; p += panels_per_tile(n)) {
        const int64_t count = std::min<int64_t>(panels_per_tile(n), p0 + np - p);
        const int valid_last = static_cast<int>(std::min<int64_t>(kQPanel, out - (p + count - 1) * kQPanel));
        tiles[n][count](x + r * ldx, ldx, packed + p * panel_bytes, panel_bytes, nb,
                        padded != nullptr ? padded + p * kQPanel : nullptr, y + r * ldy + p * kQPanel, ldy,
                        valid_last);
      }
    }
  }
}

// Calls f(std::integral_constant<int, F>) for the quantized format the caller named (checked there).
template <typename Fn>
void with_format(int format, Fn&& f) {
  switch (format) {
    case kWeightQ4_0:
      f(std::integral_constant<int, kWeightQ4_0>{});
      break;
    case kWeightQ4_1:
      f(std::integral_constant<int, kWeightQ4_1>{});
      break;
    default:
      f(std::integral_constant<int, kWeightQ8_0>{});
  }
}

// Row o of a packed weight as float32 (the embedding lookup of a head tied to the embeddings), as dequantize_panel
// computes it.
template <int F>
void dequantize_row(const uint8_t* packed, int64_t in, int64_t o, float* y) {
  const int64_t nb = in / kBlock;
  const uint8_t* panel = packed + (o / kQPanel) * nb * Format<F>::kBytes;
  const int lane = static_cast<int>(o % kQPanel);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = panel + b * Format<F>::kBytes;
    const uint8_t* quants = block + Format<F>::kHeader;
    uint16_t half[2];
    memcpy(half, block + 2 * lane, 2);
    memcpy(half + 1, block + 32 + 2 * lane, 2);
    const float d = _cvtsh_ss(half[0]);
    for (int k = 0; k < kBlock; ++k) {
      float w;
      if constexpr (F == kWeightQ8_0) {
        w = d * static_cast<float>(static_cast<int8_t>(quants[k * kQPanel + lane]));
      } else {
        const uint8_t byte = quants[64 * (k / 8) + 4 * lane + (k % 8) / 2];
        const int q = k % 2 == 0 ? byte & 15 : byte >> 4;
        w = d * static_cast<float>(F == kWeightQ4_0 ? q - 8 : q);
        if constexpr (F == kWeightQ4_1) w = w + _cvtsh_ss(half[1]);
      }
      y[b * kBlock + k] = w;
    }
  }
}

}  // namespace

extern "C" {

// y[rows, out] (row stride ldy) = x[rows, in] (row stride ldx) W^T + bias, W packed in `format` (a WeightFormat
// other than float32) as described at the top; in a multiple of 32.
void ss_quant_linear(const float* x, int64_t rows, int64_t ldx, const void* packed, int format, int64_t out,
                     int64_t in, const float* bias, float* y, int64_t ldy, int threads) {
  with_format(format, [&](auto f) {
    quant_linear<f>(x, rows, ldx, static_cast<const uint8_t*>(packed), out, in, bias, y, ldy, threads);
  });
}

// y[i] = row ids[i] of the packed weight, as float32 [n, in].
void ss_quant_rows(const void* packed, int format, int64_t in, const int64_t* ids, int64_t n, float* y,
                   int threads) {
  with_format(format, [&](auto f) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 64)
    for (int64_t i = 0; i < n; ++i) dequantize_row<f>(static_cast<const uint8_t*>(packed), in, ids[i], y + i * in);
  });
}

}  // extern "C"
