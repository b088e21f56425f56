// splitserve's products over weights kept in quantized blocks (docs/quantization.md): GGUF's Q4_0, Q4_1 and Q8_0,
// which also hold the int8 (per-channel) and int4 (group 32, scale + min) formats quantized at load.
//
// Built into the same library as cpu_kernels.cpp (engine/kernels/build.py), called through ctypes
// (engine/kernels/cpu_kernels.py) and by cpu_kernels.cpp's decoder-layer entry points (quant_kernels.h).
//
// Layout (engine/weights/quantized_weights.py packs it at load): panels of 16 outputs, each one contiguous stream of
// its blocks of 32 inputs, so that a 1-row product reads the weight once, linearly, at the memory's speed. A panel's
// block b holds, in order:
//   - d[16], the 16 outputs' scales (float16), then for Q4_1 m[16], their minimums (float16);
//   - Q4_0 / Q4_1: 4 chunks of 64 bytes, chunk g = 16 little-endian 32-bit lanes, lane o's nibble n (bits 4n..4n+3)
//     being output o's quant for input 8g + n (0..15; the weight is d (q - 8) for Q4_0, d q + m for Q4_1);
//   - Q8_0: 8 chunks of 64 bytes, chunk c = 16 32-bit lanes, byte t of lane o being output o's quant for input
//     8 (c / 2) + 2t + c % 2 (weight d q): the inputs of a 4-bit chunk's low (c even) or high nibbles.
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
//
// Opt-in (kInt8Activations in the format, EngineConfig.int8_activations): llama.cpp's int8 activations, any row
// count. The rows are quantized to int8 per block of 32 once per call, and each weight block meets them in exact
// int32 dot products (VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd without it), scaled in float32 in one fixed
// order: the same bits in every build, a row's bits independent of its batch, but not the float32 path's.

#include "quant_kernels.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kQPanel = 16;  // outputs per panel, as kPanel in cpu_kernels.cpp
constexpr int kBlock = 32;   // inputs per block
constexpr int64_t kDequantRows = 16;  // from this many rows on, dequantize panels and run the float32 GEMM
// How far ahead of the blocks it reads the int8-activation tile asks for its panels' next blocks: the integer
// products run fast enough that the hardware prefetcher alone leaves the memory's bandwidth unused (~25 GB/s of a
// core's ~37 measured; with this, 30-38).
constexpr int kPrefetchBytes = 2560;

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
  static constexpr int kBytes = kHeader + kBlock * kQPanel;  // 8 chunks of 64 bytes
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

// Byte `byte` of every lane of the Q8_0 chunk at p, sign-extended, as float32.
inline V16 q8(const uint8_t* p, int byte) {
  return {_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(p), 24 - 8 * byte), 24))};
}

// The int8-activation path's integers: 16 outputs' int32 sums, and their chunks' bytes.
#ifndef __AVX512BW__
// Every AVX-512 CPU but Xeon Phi has AVX512BW; on one without, SPLITSERVE_CPU_KERNELS=avx2 builds the AVX2 kernels.
#error "the AVX-512 build needs AVX512BW"
#endif
struct I16 {
  __m512i v;
};
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 isub(I16 a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline V16 icvt(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline N16 low_nibbles(N16 q) { return {_mm512_and_si512(q.v, _mm512_set1_epi8(15))}; }
inline N16 high_nibbles(N16 q) { return {_mm512_and_si512(_mm512_srli_epi32(q.v, 4), _mm512_set1_epi8(15))}; }
inline N16 nbcast(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
inline N16 nabs(N16 w) { return {_mm512_abs_epi8(w.v)}; }
// a with each byte negated where w's is negative (a's bytes are at least -127).
inline N16 nsign(N16 a, N16 w) {
  return {_mm512_mask_sub_epi8(a.v, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), a.v)};
}
// acc + per 32-bit lane the sum of its 4 byte products, u's unsigned (at most 127) times s's signed: exact.
inline I16 idot(I16 acc, N16 u, N16 s) {
#ifdef __AVX512VNNI__
  return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
#else
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(u.v, s.v), _mm512_set1_epi16(1)))};
#endif
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

inline __m256 q8_8(const uint8_t* p, int byte) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * byte), 24));
}

inline V16 q8(const uint8_t* p, int byte) { return {q8_8(p, byte), q8_8(p + 32, byte)}; }

struct I16 {
  __m256i lo, hi;
};
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 iadd(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I16 isub(I16 a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline V16 icvt(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline N16 low_nibbles(N16 q) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(q.lo, m), _mm256_and_si256(q.hi, m)};
}
inline N16 high_nibbles(N16 q) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi32(q.lo, 4), m), _mm256_and_si256(_mm256_srli_epi32(q.hi, 4), m)};
}
inline N16 nbcast(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
inline N16 nabs(N16 w) { return {_mm256_abs_epi8(w.lo), _mm256_abs_epi8(w.hi)}; }
inline N16 nsign(N16 a, N16 w) { return {_mm256_sign_epi8(a.lo, w.lo), _mm256_sign_epi8(a.hi, w.hi)}; }
inline __m256i idot8(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // the pairs' sums stay within int16: 2 x 127 x 127 < 32768
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline I16 idot(I16 acc, N16 u, N16 s) { return {idot8(acc.lo, u.lo, s.lo), idot8(acc.hi, u.hi, s.hi)}; }
#endif

// A tile's sums (R rows x NP panels) + bias (nullptr or the panels' padded values) -> y rows (stride ldy), the
// last panel keeping `valid_last` outputs.
template <int R, int NP>
inline void store_tile(const V16 (&acc)[R][NP], const float* bias, float* y, int64_t ldy, int valid_last) {
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

// A tile's R x NP accumulators, zeroed (store_tile writes them out).
template <int R, int NP>
inline void zero_tile(V16 (&acc)[R][NP]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[r][j] = vzero();
}

// Rows [0, R) of x (stride ldx) times NP consecutive panels (panel j at panels + j * panel_bytes) of nb blocks each
// -> y rows (stride ldy), the last panel keeping `valid_last` outputs; bias: nullptr or the panels' (padded)
// values. Each weight is dequantized in registers as dequantize_panel does it, and each output sums its products in
// order of the inputs: the bits of ss_linear. NP panels' sums (R x NP chains) keep the multiply-add units busy.
template <int F, int R, int NP>
void quant_tile(const float* x, int64_t ldx, const uint8_t* panels, int64_t panel_bytes, int64_t nb,
                const float* bias, float* y, int64_t ldy, int valid_last) {
  V16 acc[R][NP];
  zero_tile<R, NP>(acc);
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
            w = vmul(d[j], q8(block[j] + Format<F>::kHeader + 64 * (2 * g + (n & 1)), n >> 1));
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
  store_tile<R, NP>(acc, bias, y, ldy, valid_last);
}

template <int F, int R, int NP>
struct FloatTile {
  static constexpr auto run = quant_tile<F, R, NP>;
};

// Rows of activations quantized to int8 per block of 32, as llama.cpp's Q8_0 / Q8_1 quantize them: d = max |x| /
// 127, q = x / d rounded to the nearest integer (ties to even), sum = the block's sum of q (Q4_0's offset, Q4_1's
// minimum term), s = d * sum. A block's 32 quants are 8 groups of 4 bytes in "kInt8 order": byte t of group c is
// input 8 (c / 2) + 2t + c % 2, the 4 inputs that one 32-bit lane of a weight's chunk holds (chunk c / 2's low (c
// even) or high nibbles of a 4-bit weight, chunk c of a Q8_0 weight: quantized_weights.pack_panels), so that a
// group, broadcast, meets every output's lane at once.
struct Int8Rows {
  int64_t nb = 0;
  std::vector<int8_t> q;  // [rows, nb, 32]
  std::vector<float> d, s;  // [rows, nb]
  std::vector<int32_t> sum;  // [rows, nb]
};

// One block of 32 activations -> its 32 quants in kInt8 order at q; returns their sum, sets *d. AVX2 in every
// build: the same operations, hence the same quants, whatever the build (the conversion rounds to nearest even).
inline int32_t quantize_block(const float* x, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float scale = _mm_cvtss_f32(m) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // within -127..127
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  // int32 -> int8 in input order (the packs interleave the 128-bit halves; the permutation undoes it), then each
  // 8 inputs' bytes as [0 2 4 6 1 3 5 7]: kInt8 order.
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                         0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_shuffle_epi8(packed, order));
  *d = scale;
  return _mm_cvtsi128_si32(t);
}

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t ldx, int64_t in, int threads) {
  Int8Rows a;
  a.nb = in / kBlock;
  a.q.resize(rows * in);
  a.d.resize(rows * a.nb);
  a.s.resize(rows * a.nb);
  a.sum.resize(rows * a.nb);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
  for (int64_t i = 0; i < rows * a.nb; ++i) {
    a.sum[i] = quantize_block(x + (i / a.nb) * ldx + (i % a.nb) * kBlock, a.q.data() + i * kBlock, &a.d[i]);
    a.s[i] = a.d[i] * static_cast<float>(a.sum[i]);
  }
  return a;
}

// Rows [r0, r0 + R) of quantized activations times NP consecutive panels -> y, as quant_tile's. Per block, each
// output's integer dot product over its 32 inputs (exact, in int32, whatever the ISA sums first), then in float32:
// acc += (dw * da) * dot, Q4_0's dot first less 8 x the activations' sum, and Q4_1 then acc += mw * s: the same
// operations in the same order in every build, hence the same bits. Two sums per output (even and odd groups) keep
// more products in flight.
template <int F, int R, int NP>
void int8_tile(const Int8Rows& a, int64_t r0, const uint8_t* panels, int64_t panel_bytes, const float* bias, float* y,
               int64_t ldy, int valid_last) {
  const int64_t nb = a.nb;
  constexpr int kAhead = (kPrefetchBytes + Format<F>::kBytes - 1) / Format<F>::kBytes * Format<F>::kBytes;
  V16 acc[R][NP];
  zero_tile<R, NP>(acc);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) block[j] = panels + j * panel_bytes + b * Format<F>::kBytes;
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
#pragma GCC unroll 16
      for (int off = 0; off < Format<F>::kBytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(block[j] + kAhead + off), _MM_HINT_T0);
      }
    }
    const int8_t* qa[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) qa[r] = a.q.data() + ((r0 + r) * nb + b) * kBlock;
    I16 even[R][NP], odd[R][NP];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) even[r][j] = odd[r][j] = izero();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const uint8_t* quants = block[j] + Format<F>::kHeader;
        if constexpr (F == kWeightQ8_0) {  // |w| times a with w's sign: unsigned times signed
          const N16 w0 = nload(quants + 64 * (2 * g)), w1 = nload(quants + 64 * (2 * g + 1));
          const N16 u0 = nabs(w0), u1 = nabs(w1);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            even[r][j] = idot(even[r][j], u0, nsign(nbcast(qa[r] + 8 * g), w0));
            odd[r][j] = idot(odd[r][j], u1, nsign(nbcast(qa[r] + 8 * g + 4), w1));
          }
        } else {  // the nibbles 0..15, unsigned, times a
          const N16 q = nload(quants + 64 * g), lo = low_nibbles(q), hi = high_nibbles(q);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            even[r][j] = idot(even[r][j], lo, nbcast(qa[r] + 8 * g));
            odd[r][j] = idot(odd[r][j], hi, nbcast(qa[r] + 8 * g + 4));
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      const V16 dw = vhalf(block[j]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        I16 dot = iadd(even[r][j], odd[r][j]);
        if constexpr (F == kWeightQ4_0) dot = isub(dot, 8 * a.sum[i]);
        acc[r][j] = vfma(vmul(dw, vbcast(&a.d[i])), icvt(dot), acc[r][j]);
        if constexpr (F == kWeightQ4_1) acc[r][j] = vfma(vhalf(block[j] + 32), vbcast(&a.s[i]), acc[r][j]);
      }
    }
  }
  store_tile<R, NP>(acc, bias, y, ldy, valid_last);
}

template <int F, int R, int NP>
struct Int8Tile {
  static constexpr auto run = int8_tile<F, R, NP>;
};

// tile_table<Tile, F>(...)[R][NP]: Tile's function for R rows (1..kTileRows) and NP panels (1..kPanelGroup).
template <template <int, int, int> class Tile, int F, int R, int... NP>
constexpr auto tiles_of_rows(std::integer_sequence<int, NP...>) {
  using Fn = std::remove_const_t<decltype(Tile<F, 1, 1>::run)>;
  return std::array<Fn, sizeof...(NP) + 1>{nullptr, Tile<F, R, NP + 1>::run...};
}

template <template <int, int, int> class Tile, int F, int... R>
constexpr auto tile_table(std::integer_sequence<int, R...>) {
  using Row = decltype(tiles_of_rows<Tile, F, 1>(std::make_integer_sequence<int, kPanelGroup>()));
  return std::array<Row, sizeof...(R) + 1>{Row{}, tiles_of_rows<Tile, F, R + 1>(
                                                      std::make_integer_sequence<int, kPanelGroup>())...};
}

// Calls run(r, n, p, count, valid_last) for every tile of n rows from r and `count` panels from p, in parallel
// over groups of kPanelGroup panels, each group's weights read once for all the rows: tiles of up to kTileRows
// rows and panels_per_tile(n) panels, as many sums as the registers hold.
template <typename RunTile>
void over_tiles(int64_t rows, int64_t out, int threads, RunTile&& run) {
  const int64_t panels = (out + kQPanel - 1) / kQPanel;
  const int64_t groups = (panels + kPanelGroup - 1) / kPanelGroup;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * kPanelGroup, np = std::min<int64_t>(kPanelGroup, panels - p0);
    for (int64_t r = 0; r < rows; r += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r));
      for (int64_t p = p0; p < p0 + np; p += panels_per_tile(n)) {
        const int count = static_cast<int>(std::min<int64_t>(panels_per_tile(n), p0 + np - p));
        run(r, n, p, count, static_cast<int>(std::min<int64_t>(kQPanel, out - (p + count - 1) * kQPanel)));
      }
    }
  }
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
        w = vmul(d, q8(quants + 64 * (2 * (k / 8) + (k & 1)), (k % 8) >> 1));
      } else {
        w = vmul(d, nibble<F>(nload(quants + 64 * (k / 8)), k % 8));
        if constexpr (F == kWeightQ4_1) w = vadd(w, vhalf(block + 32));
      }
      vstore(o + k * kQPanel, w);
    }
  }
}

// The bias over whole panels (zeros after `out`), so that a tile reads it like the weights; empty without one.
std::vector<float> padded_bias(const float* bias, int64_t out) {
  std::vector<float> padded;
  if (bias != nullptr) {
    padded.assign((out + kQPanel - 1) / kQPanel * kQPanel, 0.0f);
    memcpy(padded.data(), bias, sizeof(float) * out);
  }
  return padded;
}

template <int F>
void quant_linear(const float* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t out, int64_t in,
                  const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t nb = in / kBlock;
  const int64_t panel_bytes = nb * Format<F>::kBytes;
  const int64_t panels = (out + kQPanel - 1) / kQPanel;
  const std::vector<float> bias_padded = padded_bias(bias, out);
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
  static constexpr auto tiles = tile_table<FloatTile, F>(std::make_integer_sequence<int, kTileRows>());
  over_tiles(rows, out, threads, [&](int64_t r, int n, int64_t p, int count, int valid_last) {
    tiles[n][count](x + r * ldx, ldx, packed + p * panel_bytes, panel_bytes, nb,
                    padded != nullptr ? padded + p * kQPanel : nullptr, y + r * ldy + p * kQPanel, ldy, valid_last);
  });
}

// quant_linear with int8 activations (kInt8Activations), any row count: x's rows quantized once, then the integer
// tiles. A row's result depends on that row only, so it is the same alone or in a batch.
template <int F>
void int8_linear(const float* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t out, int64_t in,
                 const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t panel_bytes = in / kBlock * Format<F>::kBytes;
  const std::vector<float> padded = padded_bias(bias, out);
  const Int8Rows a = quantize_rows(x, rows, ldx, in, threads);
  static constexpr auto tiles = tile_table<Int8Tile, F>(std::make_integer_sequence<int, kTileRows>());
  over_tiles(rows, out, threads, [&](int64_t r, int n, int64_t p, int count, int valid_last) {
    const float* tile_bias = bias != nullptr ? padded.data() + p * kQPanel : nullptr;
    tiles[n][count](a, r, packed + p * panel_bytes, panel_bytes, tile_bias, y + r * ldy + p * kQPanel, ldy, valid_last);
  });
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
        w = d * static_cast<float>(static_cast<int8_t>(quants[64 * (2 * (k / 8) + (k & 1)) + 4 * lane + (k % 8) / 2]));
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
  const auto* weight = static_cast<const uint8_t*>(packed);
  with_format(format & kFormatMask, [&](auto f) {
    if (format & kInt8Activations) {
      int8_linear<f>(x, rows, ldx, weight, out, in, bias, y, ldy, threads);
    } else {
      quant_linear<f>(x, rows, ldx, weight, out, in, bias, y, ldy, threads);
    }
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
