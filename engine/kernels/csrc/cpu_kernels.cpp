// splitserve's CPU kernels for the memory-bound half of inference: the decode step.
//
// Built by engine/kernels/build.py (g++ -O3 -march=native -fopenmp; at set-up, or at first use) and called
// through ctypes (engine/kernels/cpu_kernels.py) with raw pointers; nothing here knows about torch. OpenMP resolves to
// the libgomp torch already loaded, so these kernels share torch's thread pool, and the caller passes torch's thread
// count explicitly. ss_abi_version and ss_abi_table (at the end) report the entry points' argument types as the
// compiler sees them, which the Python side checks against its declarations before calling anything.
//
// The entry points (extern "C", below the helpers):
//  - ss_linear: y[R, out] = x[R, in] W^T (+ bias) with W stored in panels of 16 outputs, [P, in, 16]. Each panel
//    is one contiguous stream, so a 1-row product reads W at the memory's speed, and for more rows a 6 x 16 tile of
//    accumulators reuses every loaded W vector six times (a GEMM micro-kernel). The accumulation order of an output
//    depends only on `in`, never on R: a row gets the same bits alone or in a batch.
//  - ss_paged_decode_attention: one new query per sequence attends over its K/V read in place through its block
//    table (no gather copy), in 256-key chunks merged in order; each K/V vector loaded serves up to three query
//    heads of its group, and the next block is asked for while the current one is read. The cache holds float32,
//    bfloat16 or float16 (CacheType), widened to float32 as it is loaded; ss_rope_and_cache writes it rounded.
//  - ss_attention_input / ss_attention_output_and_mlp: a decoder layer's two halves around its attention (norm,
//    QKV, rotary, cache write; output product, residual, norm, SwiGLU MLP, residual), built from ss_add_rms_norm,
//    ss_linear (or ss_quant_linear, quant_kernels.cpp, for a weight in quantized blocks: every weight is passed
//    with its WeightFormat), ss_rope_and_cache and ss_silu_mul.
//  - ss_decode_layers: every layer of a decode-only step in one call.

#include <immintrin.h>
#include <math.h>

#include "bf16_kernels.h"
#include "cache_elems.h"
#include "quant_kernels.h"
#include "vector_math.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <array>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kPanel = 16;   // outputs per panel: two AVX2 vectors
constexpr int kRowTile = 6;  // rows per micro-kernel tile: 12 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kChunkKeys = 256;  // keys per work item of the decode attention
constexpr int64_t kPrefetchBlocks = 1;  // how many blocks ahead the decode attention asks for K/V
constexpr int64_t kAttentionRows = 48;  // query rows per work item of the prefill attention
constexpr int kHeadSet = 3;  // query heads per attention tile: 3 x 4 accumulators + 3 + 1 of the 16 registers


// Rows [0, R) of x (row stride ldx) times one panel [in, 16] -> y rows (stride ldy), `valid` outputs kept.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t /*panel_stride*/, int64_t in,
                       const float* bias, float* y, int64_t ldy, int valid) {
  __m256 acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(xv, w0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(xv, w1, acc1[r]);
    }
  }
  alignas(32) float tmp[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (bias != nullptr) {
      acc0[r] = _mm256_add_ps(acc0[r], _mm256_loadu_ps(bias));
      acc1[r] = _mm256_add_ps(acc1[r], _mm256_loadu_ps(bias + 8));
    }
    float* out = y + r * ldy;
    if (valid == kPanel) {
      _mm256_storeu_ps(out, acc0[r]);
      _mm256_storeu_ps(out + 8, acc1[r]);
    } else {
      _mm256_store_ps(tmp, acc0[r]);
      _mm256_store_ps(tmp + 8, acc1[r]);
      memcpy(out, tmp, sizeof(float) * valid);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t, int);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr,         panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                         panel_tile<4>,   panel_tile<5>, panel_tile<6>};

#ifdef __AVX512F__
// With AVX-512 a panel's 16 outputs are one register, and the tile is R rows x NP panels: 2 x 12 accumulators
// reuse every loaded W vector twelve times and every broadcast x value twice, from 32 registers. Each output still
// sums its products in order of k with one fused multiply-add each, so its bits are the AVX2 tile's bits.
constexpr int kRowTile512 = 12;
constexpr int kPanelTile512 = 2;

template <int R, int NP>
inline void panel_tile512(const float* x, int64_t ldx, const float* panels, int64_t panel_stride, int64_t in,
                          const float* bias, float* y, int64_t ldy, int valid_last) {
  __m512 acc[R][NP];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    __m512 w[NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_ps(panels + p * panel_stride + k * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
    }
  }
#pragma GCC unroll 2
  for (int p = 0; p < NP; ++p) {
    const __mmask16 keep = p == NP - 1 ? static_cast<__mmask16>((1u << valid_last) - 1) : 0xffff;
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + p * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 out = bias != nullptr ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
      _mm512_mask_storeu_ps(y + r * ldy + p * kPanel, keep, out);
    }
  }
}

template <int NP, int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> tiles512(std::integer_sequence<int, R...>) {
  return {nullptr, panel_tile512<R + 1, NP>...};
}
constexpr auto kTiles512One = tiles512<1>(std::make_integer_sequence<int, kRowTile512>());
constexpr auto kTiles512Two = tiles512<2>(std::make_integer_sequence<int, kRowTile512>());
constexpr int kPanelsPerTile = kPanelTile512;
#else
constexpr int kPanelsPerTile = 1;
#endif

// Panels [p0, p1) of a product, on the calling thread: y[rows, outputs of those panels] = x[rows, in] W^T + bias,
// with panel p ([in, 16]: 16 outputs' weights, row by row) at packed + p * panel_stride, `out` outputs in all (the
// last panel may be partial) and bias nullptr or padded to whole panels. Every output sums its `in` products in
// order of k, one fused multiply-add each, whatever the tile: its bits do not depend on `rows` nor on the ISA.
inline void panels_product(const float* x, int64_t ldx, int64_t rows, const float* packed, int64_t panel_stride,
                           int64_t in, int64_t out, int64_t p0, int64_t p1, const float* bias, float* y,
                           int64_t ldy) {
  for (int64_t p = p0; p < p1; p += kPanelsPerTile) {
    const int np = static_cast<int>(std::min<int64_t>(kPanelsPerTile, p1 - p));
    const int valid_last = static_cast<int>(std::min<int64_t>(kPanel, out - (p + np - 1) * kPanel));
#ifdef __AVX512F__
    const auto& tiles = np == 2 ? kTiles512Two : kTiles512One;
    constexpr int kRows = kRowTile512;
#else
    const TileFn* tiles = kTiles;
    constexpr int kRows = kRowTile;
#endif
    for (int64_t r = 0; r < rows; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r));
      tiles[n](x + r * ldx, ldx, packed + p * panel_stride, panel_stride, in,
               bias != nullptr ? bias + p * kPanel : nullptr, y + r * ldy + p * kPanel, ldy, valid_last);
    }
  }
}

// Asks for `rows` rows (stride row_stride) of `count` elements each, ahead of their use. The decode attention reads
// a context's blocks, which lie anywhere in the pool, where the hardware prefetcher cannot follow; it asks for the
// next block a slice at a time, as it reads the same slice of the current one, so the requests keep the memory
// busy without filling the core's miss buffers all at once (a whole block asked for at once stalls the core).
// Into L2 (T1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers until its line arrives, so only
// a handful of lines were ever in flight; L2's queue keeps many more. The decode attention over scattered float16
// blocks took half the time (bench phases --attention-probe at 16 x 4096 on Zen 4: 227-232 ms -> 118-120 ms), two
// blocks ahead no better than one.
template <typename T>
inline void prefetch_slice(const T* first, int64_t rows, int64_t row_stride, int64_t count) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < count; i += kLine) {
      _mm_prefetch(reinterpret_cast<const char*>(first + r * row_stride + i), _MM_HINT_T1);
    }
  }
}

// scores[h * score_stride] = scale * q_h . K for HS query heads (q_h = q + h * head_dim) and one key row K (a
// scaled cache type's codes times their groups' scales: values8), each lane summing dimensions l, l + 8, ... in
// turn, then hsum: a block's keys past its last multiple of 4 (the 4-key tiles below serve the others). Every K
// vector loaded serves all HS heads.
template <int CT, int HS>
inline void score_tile1(const float* q, int64_t head_dim, const typename CacheElem<CT>::T* k, int64_t /*row_stride*/,
                        float scale, float* scores, int64_t score_stride) {
  __m256 acc[HS];
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 kv = values8<CT>(k, d, head_dim);
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d), kv, acc[h]);
  }
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h) scores[h * score_stride] = hsum(acc[h]) * scale;
}

// The 4-key tiles' order of a score's sum (both builds): lane l (0-15) sums dimensions l, l + 16, l + 32, ... of the
// products in turn, lane l + 8's sum is added to lane l's, and the eight sums are reduced in hsum4's order (adjacent
// lanes, then pairs, then the two 4-lane halves). A 512-bit register holds 16 consecutive dimensions of one key, as
// a row lies, so the 512-bit tile reads each key with one load and widening; the AVX2 tile (score_tile4) gets the
// same bits from two registers per key, the low 8 of each 16 dimensions and the high 8, two keys at a time. A
// head_dim that is not a multiple of 16 ends with 8 dimensions of the low lanes.
//
// score_tile4: the scores of 4 key rows (K_j = k + j * row_stride) as score_tile1 gives one's, in that order, on AVX2.
template <int CT, int HS>
inline void score_tile4(const float* q, int64_t head_dim, const typename CacheElem<CT>::T* k, int64_t row_stride,
                        float scale, float* scores, int64_t score_stride) {
  __m256 sums[HS][4];  // per head and key: its low lanes' sums plus its high lanes'
#pragma GCC unroll 2
  for (int pair = 0; pair < 4; pair += 2) {
    __m256 low[HS][2], high[HS][2];
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) low[h][j] = high[h][j] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= head_dim; d += 16) {
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const typename CacheElem<CT>::T* row = k + (pair + j) * row_stride;
        const __m256 k_low = values8<CT>(row, d, head_dim), k_high = values8<CT>(row, d + 8, head_dim);
#pragma GCC unroll 4
        for (int h = 0; h < HS; ++h) {
          low[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d), k_low, low[h][j]);
          high[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d + 8), k_high, high[h][j]);
        }
      }
    }
    if (d < head_dim) {  // the last 8 dimensions: low lanes
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256 k_low = values8<CT>(k + (pair + j) * row_stride, d, head_dim);
#pragma GCC unroll 4
        for (int h = 0; h < HS; ++h) {
          low[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d), k_low, low[h][j]);
        }
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) sums[h][pair + j] = _mm256_add_ps(low[h][j], high[h][j]);
  }
  const __m128 s = _mm_set1_ps(scale);
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h) {
    _mm_storeu_ps(scores + h * score_stride, _mm_mul_ps(hsum4(sums[h][0], sums[h][1], sums[h][2], sums[h][3]), s));
  }
}

#ifdef SS_ATTENTION_512
// The four scores of keys 0-3 for two heads, from their 512-bit tiles' accumulators (a0: head a's keys 0 and 1,
// each in a 256-bit half; a1: its keys 2 and 3; b0, b1: head b's), each reduced in hsum4's order (adjacent lanes,
// then pairs, then the two 4-lane halves): lanes 0-3 head a's keys 0-3, lanes 4-7 head b's. Across registers, so
// that the shuffles and adds serve all eight sums at once.
inline __m512 reduce4x2(__m512 a0, __m512 a1, __m512 b0, __m512 b1) {
  const auto pairs = [](__m512 x, __m512 y) {  // per 128-bit lane: x0 + x1, x2 + x3, y0 + y1, y2 + y3
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const __m512 r = pairs(pairs(a0, a1), pairs(b0, b1));  // lane i of 128-bit block q: register i's 4-lane sum q
  const __m512 s = _mm512_add_ps(r, _mm512_shuffle_f32x4(r, r, _MM_SHUFFLE(2, 3, 0, 1)));  // blocks 0, 2: lo + hi
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), s);
}

// score_tile4 on 512-bit registers: one key's 16 consecutive dimensions per register, each lane's products summed
// in the 4-key tiles' order; then each register's two halves added, two keys to a register (a key's low and high 8
// lanes become one half), and the sums reduced across registers (reduce4x2) and scaled as score_tile4 does.
template <int CT, int HS>
inline void score_tile512(const float* q, int64_t head_dim, const typename CacheElem<CT>::T* k, int64_t row_stride,
                          float scale, float* scores, int64_t score_stride) {
  __m512 acc[HS][4];
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  const int64_t whole = head_dim / 16 * 16;
  for (int64_t d = 0; d < whole; d += 16) {
    __m512 qv[HS];
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h) qv[h] = _mm512_loadu_ps(q + h * head_dim + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = values16<CT>(k + j * row_stride, d, head_dim);
#pragma GCC unroll 4
      for (int h = 0; h < HS; ++h) acc[h][j] = _mm512_fmadd_ps(qv[h], kv, acc[h][j]);
    }
  }
  if (whole < head_dim) {  // the last 8 dimensions, in the low lanes (the high ones add 0 x 0 to a sum never -0)
    __m512 qv[HS];
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h) qv[h] = _mm512_zextps256_ps512(_mm256_loadu_ps(q + h * head_dim + whole));
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = _mm512_zextps256_ps512(values8<CT>(k + j * row_stride, whole, head_dim));
#pragma GCC unroll 4
      for (int h = 0; h < HS; ++h) acc[h][j] = _mm512_fmadd_ps(qv[h], kv, acc[h][j]);
    }
  }
  const auto halves = [](__m512 a, __m512 b) {  // a's low + high 8 lanes, then b's
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m512 vscale = _mm512_set1_ps(scale);
#pragma GCC unroll 2
  for (int h = 0; h < HS; h += 2) {
    const int h2 = h + 1 < HS ? h + 1 : h;  // an odd last head reduced beside itself, its copy not stored
    const __m512 x = reduce4x2(halves(acc[h][0], acc[h][1]), halves(acc[h][2], acc[h][3]),
                               halves(acc[h2][0], acc[h2][1]), halves(acc[h2][2], acc[h2][3]));
    const __m512 scaled = _mm512_mul_ps(x, vscale);
    _mm_storeu_ps(scores + h * score_stride, _mm512_castps512_ps128(scaled));
    if (h2 != h) _mm_storeu_ps(scores + h2 * score_stride, _mm512_extractf32x4_ps(scaled, 1));
  }
}
#endif

template <int CT>
using ScoreTileFn = void (*)(const float*, int64_t, const typename CacheElem<CT>::T*, int64_t, float, float*,
                             int64_t);
template <int CT>
constexpr ScoreTileFn<CT> kScoreTiles[kHeadSet + 1][5] = {
    {nullptr, nullptr, nullptr, nullptr, nullptr},
#ifdef SS_ATTENTION_512
    {nullptr, score_tile1<CT, 1>, nullptr, nullptr, score_tile512<CT, 1>},
    {nullptr, score_tile1<CT, 2>, nullptr, nullptr, score_tile512<CT, 2>},
    {nullptr, score_tile1<CT, 3>, nullptr, nullptr, score_tile512<CT, 3>},
#else
    {nullptr, score_tile1<CT, 1>, nullptr, nullptr, score_tile4<CT, 1>},
    {nullptr, score_tile1<CT, 2>, nullptr, nullptr, score_tile4<CT, 2>},
    {nullptr, score_tile1<CT, 3>, nullptr, nullptr, score_tile4<CT, 3>},
#endif
};

// out_h[0:8 VEC] += sum_j p[h * score_stride + j] V_j[d0:d0 + 8 VEC] over n value rows (V_j = v + j * row_stride,
// its values as values8 reads them), for HS heads (out_h = out + h * head_dim): the accumulators stay in registers
// through the rows, in row order.
template <int CT, int HS, int VEC>
inline void value_tile(const float* p, int64_t score_stride, const typename CacheElem<CT>::T* v, int64_t row_stride,
                       int64_t d0, int64_t n, float* out, int64_t head_dim) {
  __m256 acc[HS][VEC];
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < VEC; ++c) acc[h][c] = _mm256_loadu_ps(out + h * head_dim + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m256 pv[HS];
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h) pv[h] = _mm256_broadcast_ss(p + h * score_stride + j);
#pragma GCC unroll 4
    for (int c = 0; c < VEC; ++c) {
      const __m256 vv = values8<CT>(v + j * row_stride, d0 + 8 * c, head_dim);
#pragma GCC unroll 4
      for (int h = 0; h < HS; ++h) acc[h][c] = _mm256_fmadd_ps(pv[h], vv, acc[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < VEC; ++c) _mm256_storeu_ps(out + h * head_dim + 8 * c, acc[h][c]);
}

#ifdef SS_ATTENTION_512
// value_tile<CT, HS, 2 * VEC2> on 512-bit registers: two 8-dimension chunks per register, each lane doing the AVX2
// tile's multiply-adds, row by row: the same bits with half the instructions.
template <int CT, int HS, int VEC2>
inline void value_tile512(const float* p, int64_t score_stride, const typename CacheElem<CT>::T* v,
                          int64_t row_stride, int64_t d0, int64_t n, float* out, int64_t head_dim) {
  __m512 acc[HS][VEC2];
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h)
#pragma GCC unroll 2
    for (int c = 0; c < VEC2; ++c) acc[h][c] = _mm512_loadu_ps(out + h * head_dim + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 pv[HS];
#pragma GCC unroll 4
    for (int h = 0; h < HS; ++h) pv[h] = _mm512_set1_ps(p[h * score_stride + j]);
#pragma GCC unroll 2
    for (int c = 0; c < VEC2; ++c) {
      const __m512 vv = values16<CT>(v + j * row_stride, d0 + 16 * c, head_dim);
#pragma GCC unroll 4
      for (int h = 0; h < HS; ++h) acc[h][c] = _mm512_fmadd_ps(pv[h], vv, acc[h][c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HS; ++h)
#pragma GCC unroll 2
    for (int c = 0; c < VEC2; ++c) _mm512_storeu_ps(out + h * head_dim + 16 * c, acc[h][c]);
}
#endif

template <int CT>
using ValueTileFn = void (*)(const float*, int64_t, const typename CacheElem<CT>::T*, int64_t, int64_t, int64_t,
                             float*, int64_t);
template <int CT>
constexpr ValueTileFn<CT> kValueTiles[kHeadSet + 1][5] = {
    {nullptr, nullptr, nullptr, nullptr, nullptr},
#ifdef SS_ATTENTION_512
    {nullptr, value_tile<CT, 1, 1>, value_tile512<CT, 1, 1>, value_tile<CT, 1, 3>, value_tile512<CT, 1, 2>},
    {nullptr, value_tile<CT, 2, 1>, value_tile512<CT, 2, 1>, value_tile<CT, 2, 3>, value_tile512<CT, 2, 2>},
    {nullptr, value_tile<CT, 3, 1>, value_tile512<CT, 3, 1>, value_tile<CT, 3, 3>, value_tile512<CT, 3, 2>},
#else
    {nullptr, value_tile<CT, 1, 1>, value_tile<CT, 1, 2>, value_tile<CT, 1, 3>, value_tile<CT, 1, 4>},
    {nullptr, value_tile<CT, 2, 1>, value_tile<CT, 2, 2>, value_tile<CT, 2, 3>, value_tile<CT, 2, 4>},
    {nullptr, value_tile<CT, 3, 1>, value_tile<CT, 3, 2>, value_tile<CT, 3, 3>, value_tile<CT, 3, 4>},
#endif
};

// out[b, hq, :] = softmax(q[b, hq] . K[b]^T * scale) V[b] for one new query per sequence.
// q, out: [B, Hq, D] contiguous, D a multiple of 8; k_cache, v_cache: [num_blocks, block_size, Hkv, row] contiguous
// (rows of cache type CT, cache_elems.h: D elements, then a scaled type's scale);
// block_tables: [B, table_stride] int64; seq_lens: [B] int64, the keys each sequence attends to; own_keys: null, or
// [B, block_size, Hkv, D] float16, each query's own block's keys (the last block's, its own included): a scaled
// pool's queries read those from there, the keys of every older block as the pool stores them.
//
// Work items are chunks of kChunkKeys keys of one sequence, all heads (flash-decoding's split over keys): a
// single sequence still keeps every thread busy. Each chunk leaves its max score, exp-sum and unnormalized output
// per head; a sequence's chunks are then merged in order. The split depends on the sequence alone, never on the
// batch, so a sequence gets the same bits whatever runs beside it. Threads take items round robin, so each knows
// the blocks it reads next (K, then V, then its next item's K) and asks for them ahead (prefetch_slice).
template <int CT>
void decode_attention(const float* q, const typename CacheElem<CT>::T* k_cache,
                      const typename CacheElem<CT>::T* v_cache, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, const uint16_t* own_keys, int64_t batch, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out,
                      int threads) {
  using T = typename CacheElem<CT>::T;
  const int64_t own_row = num_kv_heads * head_dim;  // a token's keys in own_keys
  const int64_t group = num_heads / num_kv_heads;
  const int64_t width = row_elems<CT>(head_dim);  // a (token, head) row
  const int64_t row_stride = num_kv_heads * width;  // between consecutive slots of a block
  const int64_t block_stride = block_size * row_stride;
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkKeys / block_size);
  const int64_t chunk_keys = chunk_blocks * block_size;
  const int64_t score_stride = (chunk_keys + 7) / 8 * 8;  // room for exp_shifted's padding
  std::vector<int64_t> first_item(batch + 1, 0);  // sequence b's chunks are items first_item[b]..first_item[b+1]
  for (int64_t b = 0; b < batch; ++b) first_item[b + 1] = first_item[b] + (seq_lens[b] + chunk_keys - 1) / chunk_keys;
  const int64_t items = first_item[batch];
  std::vector<float> part_max(items * num_heads), part_sum(items * num_heads), part_out(items * num_heads * head_dim);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(static_cast<size_t>(num_heads * score_stride));
    // The blocks an item reads, in order: its K blocks, its V blocks, then (padded with nulls) the first K blocks
    // of this thread's next item, so the prefetch runs on across the K/V and item boundaries.
    std::vector<const T*> stream(2 * chunk_blocks + kPrefetchBlocks);
    const int64_t stride = omp_get_num_threads();
    // Writes the first `count` blocks of sequence b's chunk to `into` (nulls past its end); returns how many it has.
    const auto chunk_blocks_of = [&](int64_t b, int64_t chunk, const T* cache, const T** into, int64_t count) {
      const int64_t keys = std::min(chunk_keys, seq_lens[b] - chunk * chunk_keys);
      const int64_t n = std::min(count, (keys + block_size - 1) / block_size);
      const int64_t* table = block_tables + b * table_stride + chunk * chunk_blocks;
      for (int64_t i = 0; i < n; ++i) into[i] = cache + table[i] * block_stride;
      std::fill(into + n, into + count, nullptr);
      return n;
    };
    const auto sequence_of = [&](int64_t item) {
      return std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    };
#pragma omp for schedule(static, 1)  // round robin, so a thread knows its next item
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = sequence_of(item), chunk = item - first_item[b];
      const int64_t len = std::min(chunk_keys, seq_lens[b] - chunk * chunk_keys);
      const int64_t blocks = chunk_blocks_of(b, chunk, k_cache, stream.data(), chunk_blocks);
      chunk_blocks_of(b, chunk, v_cache, stream.data() + blocks, blocks);
      const T** ahead = stream.data() + 2 * blocks;  // the next item's first K blocks
      if (item + stride < items) {
        const int64_t next_b = sequence_of(item + stride);
        chunk_blocks_of(next_b, item + stride - first_item[next_b], k_cache, ahead, kPrefetchBlocks);
      } else {
        std::fill(ahead, ahead + kPrefetchBlocks, nullptr);
      }
      const float* qb = q + b * num_heads * head_dim;
      // The query's own block among this item's (-1: not), when its keys come from own_keys.
      const int64_t own = own_keys == nullptr ? -1 : (seq_lens[b] - 1) / block_size - chunk * chunk_blocks;
      // Pass 1: the scaled scores, block by block, four keys at a time; each K vector loaded once serves up to
      // three query heads of its group (a scaled cache's codes times their groups' scales as they are loaded).
      // One block's scores: its n keys of element type E (a KV head g's key j at kb + j * stride + g * head_width),
      // four at a time, then one at a time; while the first head set of each KV head reads them, the same keys of
      // the block `next` are asked for (null: none).
      const auto score_block = [&](auto elem, const auto* kb, int64_t stride, int64_t head_width, const auto* next,
                                   int64_t s0, int64_t n) {
        constexpr int E = decltype(elem)::value;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          for (int64_t r0 = g * group; r0 < (g + 1) * group; r0 += kHeadSet) {
            const int hs = static_cast<int>(std::min<int64_t>(kHeadSet, (g + 1) * group - r0));
            float* at = scores.data() + r0 * score_stride + s0;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) {
              if (next != nullptr && r0 == g * group) {
                prefetch_slice(next + j * stride + g * head_width, 4, stride, head_width);
              }
              kScoreTiles<E>[hs][4](qb + r0 * head_dim, head_dim, kb + j * stride + g * head_width, stride, scale,
                                    at + j, score_stride);
            }
            for (; j < n; ++j) {
              kScoreTiles<E>[hs][1](qb + r0 * head_dim, head_dim, kb + j * stride + g * head_width, stride, scale,
                                    at + j, score_stride);
            }
          }
        }
      };
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t s0 = i * block_size, n = std::min(block_size, len - s0);
        if (i == own) {  // float16 keys, the float16 tiles
          score_block(std::integral_constant<int, kFloat16>{}, own_keys + b * block_size * own_row, own_row, head_dim,
                      static_cast<const uint16_t*>(nullptr), s0, n);
        } else {
          score_block(std::integral_constant<int, CT>{}, stream[i], row_stride, width, stream[i + kPrefetchBlocks], s0,
                      n);
        }
      }
      for (int64_t r = 0; r < num_heads; ++r) {
        part_max[item * num_heads + r] =
            exp_shifted(scores.data() + r * score_stride, len, &part_sum[item * num_heads + r]);
      }
      // Pass 2: the weighted sum of the values, block by block; up to three heads x 32 dimensions of accumulators
      // stay in registers through a block, and each V vector loaded (scaled as the keys are) serves every head of its
      // group.
      float* acc = part_out.data() + item * num_heads * head_dim;
      std::fill(acc, acc + num_heads * head_dim, 0.0f);
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t s0 = i * block_size, n = std::min(block_size, len - s0);
        const T* vb = stream[blocks + i];
        const T* next = stream[blocks + i + kPrefetchBlocks];
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          for (int64_t r0 = g * group; r0 < (g + 1) * group; r0 += kHeadSet) {
            const int hs = static_cast<int>(std::min<int64_t>(kHeadSet, (g + 1) * group - r0));
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
              const int vec = static_cast<int>(std::min<int64_t>(4, (head_dim - d0) / 8));
              if (next != nullptr && r0 == g * group) {  // the slice's values, the last slice's with the scales
                prefetch_slice(next + g * width + d0, n, row_stride, d0 + 8 * vec < head_dim ? 8 * vec : width - d0);
              }
              kValueTiles<CT>[hs][vec](scores.data() + r0 * score_stride + s0, score_stride, vb + g * width,
                                       row_stride, d0, n, acc + r0 * head_dim + d0, head_dim);
            }
          }
        }
      }
    }
    // Merge each sequence's chunks, in chunk order: out = sum_c e^(m_c - m) acc_c / sum_c e^(m_c - m) l_c.
#pragma omp for schedule(static)
    for (int64_t br = 0; br < batch * num_heads; ++br) {
      const int64_t b = br / num_heads, r = br % num_heads;
      float m = -INFINITY;
      for (int64_t c = first_item[b]; c < first_item[b + 1]; ++c) m = std::max(m, part_max[c * num_heads + r]);
      float total = 0.0f;
      float* o = out + br * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t c = first_item[b]; c < first_item[b + 1]; ++c) {
        const float w = expf(part_max[c * num_heads + r] - m);
        total += w * part_sum[c * num_heads + r];
        const float* pc = part_out.data() + (c * num_heads + r) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += w * pc[d];
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    }
  }
}

// Prefill attention: the n new queries of one sequence (positions prefix .. prefix + n - 1; query r of head hq at
// q + r * ldq + hq * head_dim) over its keys 0 .. prefix + n - 1, read through its block table from the caches (the
// new tokens' K and V already written), causal. The products run on the GEMM tiles: K of each KV head is packed as
// panels of 16 keys [key_panels, D, 16] (scores = q K^T, a product with K as its weights) and V as panels of 16
// dimensions [D / 16, keys, 16] (out = p V). Work items are (query head, block of rows): a row's scores span its
// keys, are softmaxed in place (padding after them zero) and multiplied by V. A row's bits depend on its own
// keys only: alone or in a batch, in one chunk or several, it gets the same output. own_keys: null, or the float16
// keys of positions own_start (prefix rounded down to a block) .. prefix + n - 1, [n + prefix - own_start, Hkv, D]: a
// scaled pool's rows read the keys of their own block from there (dot_float16), every older key from the pool.
template <int CT>
void prefill_attention(const float* q, int64_t ldq, const typename CacheElem<CT>::T* k_cache,
                       const typename CacheElem<CT>::T* v_cache, const int64_t* blocks, int64_t n, int64_t prefix,
                       const uint16_t* own_keys, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, float* out, int64_t ldo, int threads) {
  const int64_t own_start = prefix / block_size * block_size;
  const int64_t keys = prefix + n;
  const int64_t width = row_elems<CT>(head_dim);  // a (token, head) row of the caches
  const int64_t key_panels = (keys + kPanel - 1) / kPanel;
  const int64_t keys_padded = key_panels * kPanel;
  const int64_t dim_panels = (head_dim + kPanel - 1) / kPanel;
  const int64_t k_head_size = key_panels * head_dim * kPanel, v_head_size = dim_panels * keys_padded * kPanel;
  std::vector<float> k_packed(num_kv_heads * k_head_size), v_packed(num_kv_heads * v_head_size);  // zero padded
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < num_kv_heads * key_panels; ++item) {
    const int64_t h = item / key_panels, panel = item % key_panels;
    float* k_panel = k_packed.data() + h * k_head_size + panel * head_dim * kPanel;
    float* v_head = v_packed.data() + h * v_head_size;
    alignas(32) float row[512];
    for (int64_t jj = 0; jj < kPanel && panel * kPanel + jj < keys; ++jj) {
      const int64_t j = panel * kPanel + jj;
      const int64_t at = ((blocks[j / block_size] * block_size + j % block_size) * num_kv_heads + h) * width;
      load_row<CT>(k_cache + at, head_dim, row);
      for (int64_t d = 0; d < head_dim; ++d) k_panel[d * kPanel + jj] = row[d];
      load_row<CT>(v_cache + at, head_dim, row);
      for (int64_t d = 0; d < head_dim; d += 8) {
        _mm256_storeu_ps(v_head + (d / kPanel) * keys_padded * kPanel + j * kPanel + d % kPanel,
                         _mm256_load_ps(row + d));
      }
    }
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_blocks = (n + kAttentionRows - 1) / kAttentionRows;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(kAttentionRows * keys_padded), queries(kAttentionRows * head_dim);
    float inv_sum[kAttentionRows];
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < num_heads * row_blocks; ++item) {
      const int64_t block = row_blocks - 1 - item / num_heads;  // the longest rows first, for balance
      const int64_t hq = item % num_heads, h = hq / group;
      const int64_t r0 = block * kAttentionRows, rows = std::min(kAttentionRows, n - r0);
      const int64_t seen = prefix + r0 + rows;  // keys of the block's last row
      const int64_t seen_panels = (seen + kPanel - 1) / kPanel;
      for (int64_t r = 0; r < rows; ++r) {  // the block's queries, scaled, as contiguous rows
        const float* from = q + (r0 + r) * ldq + hq * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) queries[r * head_dim + d] = from[d] * scale;
      }
      panels_product(queries.data(), head_dim, rows, k_packed.data() + h * k_head_size, head_dim * kPanel, head_dim,
                     seen_panels * kPanel, 0, seen_panels, nullptr, scores.data(), keys_padded);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * keys_padded;
        const int64_t valid = prefix + r0 + r + 1;
        for (int64_t j = own_keys == nullptr ? valid : (valid - 1) / block_size * block_size; j < valid; ++j) {
          s[j] = dot_float16(queries.data() + r * head_dim,
                             own_keys + ((j - own_start) * num_kv_heads + h) * head_dim, head_dim);
        }
        const int64_t vectors = (valid + 7) / 8 * 8;
        float sum;
        exp_shifted(s, valid, &sum);
        std::fill(s + vectors, s + std::max(vectors, seen), 0.0f);  // keys this row does not see
        inv_sum[r] = 1.0f / sum;
      }
      float* o = out + r0 * ldo + hq * head_dim;
      panels_product(scores.data(), keys_padded, rows, v_packed.data() + h * v_head_size, keys_padded * kPanel,
                     seen, head_dim, 0, dim_panels, nullptr, o, ldo);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < head_dim; ++d) o[r * ldo + d] *= inv_sum[r];
      }
    }
  }
}

}  // namespace

extern "C" {

// The widest vectors this build's GEMM micro-kernel uses: 512 (AVX-512) or 256 (AVX2).
int ss_vector_bits() {
#ifdef __AVX512F__
  return 512;
#else
  return 256;
#endif
}

// y[rows, out] (row stride ldy) = x[rows, in] (row stride ldx) W^T + bias; W in panels [P, in, 16], the last
// panel's padding outputs zero (engine/model/layers.py's Linear packs them).
void ss_linear(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t out, int64_t in,
               const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t panels = (out + kPanel - 1) / kPanel;
  std::vector<float> bias_padded;  // whole panels, so that a tile reads the bias like the weights
  if (bias != nullptr) {
    bias_padded.assign(panels * kPanel, 0.0f);
    memcpy(bias_padded.data(), bias, sizeof(float) * out);
  }
  const float* padded = bias != nullptr ? bias_padded.data() : nullptr;
  const int64_t groups = (panels + kPanelsPerTile - 1) / kPanelsPerTile;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p0 = g * kPanelsPerTile;
    panels_product(x, ldx, rows, packed, in * kPanel, in, out, p0, std::min(panels, p0 + kPanelsPerTile), padded, y,
                   ldy);
  }
}

// The decode attention (decode_attention above) over caches holding cache_type (a CacheType) elements.
void ss_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache, int cache_type,
                               const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                               const uint16_t* own_keys, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  with_cache_type(cache_type, [&](auto ct) {
    using T = typename CacheElem<ct>::T;
    decode_attention<ct>(q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_tables,
                         table_stride, seq_lens, own_keys, batch, num_heads, num_kv_heads, head_dim, block_size,
                         scale, out, threads);
  });
}

// The prefill attention (prefill_attention above) over caches holding cache_type (a CacheType) elements.
void ss_prefill_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, int cache_type,
                          const int64_t* blocks, int64_t n, int64_t prefix, const uint16_t* own_keys,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          float* out, int64_t ldo, int threads) {
  with_cache_type(cache_type, [&](auto ct) {
    using T = typename CacheElem<ct>::T;
    prefill_attention<ct>(q, ldq, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), blocks, n, prefix,
                          own_keys, num_heads, num_kv_heads, head_dim, block_size, scale, out, ldo, threads);
  });
}

// x[r] += delta[r] when delta is given, then out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x, delta, out:
// [rows, dim] contiguous. The residual add and the norm of every decoder layer in one pass.
void ss_add_rms_norm(float* x, const float* delta, const float* weight, float eps, float* out, int64_t rows,
                     int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    float* outr = out + r * dim;
    if (delta != nullptr) {
      const float* dr = delta + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) xr[i] += dr[i];
    }
    const float sum = sum_of_squares(xr, dim);
    const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * inv * weight[i];
  }
}

// Rotary embedding in place on the q and k heads of qkv [T, (Hq + 2 Hkv) D] (HF's rotate-half layout): each head
// x becomes x * cos + swap_halves(x) * sin_signed at its token's position, cos and sin_signed being [P, D] tables.
// With q_norm and k_norm given (Qwen3), each q and k head is first RMS-normalized over D (ss_add_rms_norm's formula,
// eps) and scaled by its kind's [D] weight. Then, with caches given, the step's k and v go to the caches
// [num_blocks * block_size, Hkv, row] at slot_mapping, as rows of cache_type (a CacheType; cache_elems.h).
void ss_rope_and_cache(float* qkv, int64_t tokens, const int64_t* positions, const float* cos,
                       const float* sin_signed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       const float* q_norm, const float* k_norm, float eps, void* k_cache, void* v_cache,
                       int cache_type, const int64_t* slot_mapping, int threads) {
  const int64_t half = head_dim / 2;
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
  WriteKVFn write_kv = nullptr;
  with_cache_type(cache_type, [&](auto ct) { write_kv = write_cache_row<ct>; });
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 64)
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = qkv + t * width;
    const float* c = cos + positions[t] * head_dim;
    const float* sn = sin_signed + positions[t] * head_dim;
    float rotated[512];  // head_dim <= 512, checked by the caller
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* x = row + h * head_dim;
      const float* norm = h < num_heads ? q_norm : k_norm;
      if (norm != nullptr) {
        const float inv = 1.0f / sqrtf(sum_of_squares(x, head_dim) / static_cast<float>(head_dim) + eps);
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) x[i] = x[i] * inv * norm[i];
      }
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        rotated[i] = x[i] * c[i] + x[i + half] * sn[i];
        rotated[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
      }
      memcpy(x, rotated, sizeof(float) * head_dim);
    }
    if (k_cache != nullptr) {
      const float* k_new = row + num_heads * head_dim;
      write_kv(k_cache, v_cache, slot_mapping[t], k_new, k_new + kv_width, num_kv_heads, head_dim);
    }
  }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]: SwiGLU on the fused gate/up product [rows, 2 inter].
void ss_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 neg_exp = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), neg_exp));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + inter + i)));
    }
    for (; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * g[inter + i];
  }
}

// The first half of a decoder layer for the step's tokens, up to its attention: h = RMSNorm(x);
// qkv [T, (Hq + 2 Hkv) D] = h Wqkv^T (+ bias); q and k heads normalized (q_norm, k_norm: Qwen3's, or null) and
// rotated in place; k and v written to the caches at slots.
void ss_attention_input(const float* x, int64_t tokens, int64_t hidden, const float* norm_weight, float eps,
                        const void* qkv_weight, int qkv_format, const float* qkv_bias, float* qkv,
                        const int64_t* positions,
                        const float* cos, const float* sin_signed, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const float* q_norm, const float* k_norm, void* k_cache, void* v_cache,
                        int cache_type, const int64_t* slot_mapping, int threads) {
  std::unique_ptr<float[]> h(new float[tokens * hidden]);
  ss_add_rms_norm(const_cast<float*>(x), nullptr, norm_weight, eps, h.get(), tokens, hidden, threads);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  weight_product(h.get(), tokens, hidden, qkv_weight, qkv_format, width, hidden, qkv_bias, qkv, width, threads);
  ss_rope_and_cache(qkv, tokens, positions, cos, sin_signed, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps,
                    k_cache, v_cache, cache_type, slot_mapping, threads);
}

// The second half of a decoder layer, from its attention's output attn [T, attn_width] on: x += attn Wo^T;
// h = RMSNorm(x); x += down(silu(gate) * up) with [gate, up] = h Wgate_up^T. x: the residual stream [T, hidden].
void ss_attention_output_and_mlp(float* x, int64_t tokens, int64_t hidden, const float* attn, int64_t attn_width,
                                 const void* o_weight, int o_format, const float* norm_weight, float eps,
                                 const void* gate_up_weight, int gate_up_format, const void* down_weight,
                                 int down_format, int64_t inter, int threads) {
  std::unique_ptr<float[]> o(new float[tokens * hidden]), h(new float[tokens * hidden]);
  std::unique_ptr<float[]> gate_up(new float[tokens * 2 * inter]), act(new float[tokens * inter]);
  weight_product(attn, tokens, attn_width, o_weight, o_format, hidden, attn_width, nullptr, o.get(), hidden, threads);
  ss_add_rms_norm(x, o.get(), norm_weight, eps, h.get(), tokens, hidden, threads);
  weight_product(h.get(), tokens, hidden, gate_up_weight, gate_up_format, 2 * inter, hidden, nullptr, gate_up.get(),
                 2 * inter, threads);
  ss_silu_mul(gate_up.get(), act.get(), tokens, inter, threads);
  weight_product(act.get(), tokens, inter, down_weight, down_format, hidden, inter, nullptr, o.get(), hidden, threads);
  const int64_t n = tokens * hidden;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) x[i] += o[i];
}

// A decode step's own-block keys over a scaled pool (engine/kv_formats/open_keys.py's OwnKeyPlan, its index tensors):
// a layer's source rows are the open blocks' keys as the steps before left them (read_blocks, block_size rows each)
// and then the step's new keys; each sequence's own block is index[b * block_size + t] of them, and after the
// layer's attention each write w puts the new key of row write_rows[w] into open block write_blocks[w] at
// write_positions[w] % block_size.
struct OwnKeySteps {
  const int64_t* index;  // [B, block_size]
  const int64_t* read_blocks;  // [num_read]
  int64_t num_read;
  const int64_t* write_blocks;  // [num_writes]
  const int64_t* write_positions;
  const int64_t* write_rows;
  int64_t num_writes;
};

// own [B, block_size, Hkv * D] float16: each sequence's own block's keys, from the open blocks and the step's new
// keys (rows of k_new, stride k_stride, float32, rounded as torch rounds to float16).
inline void gather_own_keys(const OwnKeySteps& plan, const OpenKeys& open, const float* k_new, int64_t k_stride,
                            int64_t batch, int64_t block_size, uint16_t* own) {
  const int64_t from_open = plan.num_read * block_size;
  for (int64_t i = 0; i < batch * block_size; ++i) {
    const int64_t at = plan.index[i];
    uint16_t* to = own + i * open.row;
    if (at < from_open) {
      memcpy(to, open.keys(plan.read_blocks[at / block_size], at % block_size), sizeof(uint16_t) * open.row);
    } else {
      store_row<kFloat16>(to, k_new + (at - from_open) * k_stride, open.row);
    }
  }
}

inline void write_open_keys(const OwnKeySteps& plan, const OpenKeys& open, const float* k_new, int64_t k_stride,
                            int64_t block_size) {
  for (int64_t w = 0; w < plan.num_writes; ++w) {
    store_row<kFloat16>(open.keys(plan.write_blocks[w], plan.write_positions[w] % block_size),
                        k_new + plan.write_rows[w] * k_stride, open.row);
  }
}

// One decoder layer's weights (packed linear weights, norm weights, optional QKV bias), its KV caches, and the
// WeightFormat of each linear weight.
struct DecodeLayer {
  const float* input_norm;
  const void* qkv;
  const float* qkv_bias;
  const void* o;
  const float* post_attn_norm;
  const void* gate_up;
  const void* down;
  void* k_cache;  // elements of the step's cache type
  void* v_cache;
  const float* q_norm;  // Qwen3's per-head q and k norms, or null
  const float* k_norm;
  int64_t qkv_format;
  int64_t o_format;
  int64_t gate_up_format;
  int64_t down_format;
};

// A whole decode step's layers: one new token per sequence (token b is sequence b), every layer run as
// ss_attention_input, ss_paged_decode_attention and ss_attention_output_and_mlp in turn, the residual stream
// x [B, hidden] updated in place; every layer's caches hold cache_type elements; own_keys: null, or a scaled pool's
// own-block keys (OwnKeySteps), gathered before each layer's attention and written to the open blocks after it. The
// same kernels in the same order as layer-by-layer calls, so the same bits, without the interpreter between layers.
void ss_decode_layers(float* x, int64_t batch, int64_t hidden, int64_t num_layers, const DecodeLayer* layers,
                      int cache_type, float eps, const int64_t* positions, const float* cos, const float* sin_signed,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                      const int64_t* slot_mapping, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, const OwnKeySteps* own_keys, int64_t block_size, float scale,
                      int threads) {
  const int64_t q_width = num_heads * head_dim;
  const int64_t width = q_width + 2 * num_kv_heads * head_dim;
  std::unique_ptr<float[]> qkv(new float[batch * width]), q(new float[batch * q_width]);
  std::unique_ptr<float[]> attn(new float[batch * q_width]);
  std::vector<uint16_t> own(own_keys != nullptr ? batch * block_size * num_kv_heads * head_dim : 0);
  for (int64_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& w = layers[l];
    ss_attention_input(x, batch, hidden, w.input_norm, eps, w.qkv, static_cast<int>(w.qkv_format), w.qkv_bias,
                       qkv.get(), positions, cos, sin_signed, num_heads, num_kv_heads, head_dim, w.q_norm, w.k_norm,
                       w.k_cache, w.v_cache, cache_type, slot_mapping, threads);
    for (int64_t b = 0; b < batch; ++b) memcpy(q.get() + b * q_width, qkv.get() + b * width, sizeof(float) * q_width);
    OpenKeys open{};
    if (own_keys != nullptr) {
      with_cache_type(cache_type, [&](auto ct) {
        open = open_keys_of<ct>(w.k_cache, w.v_cache, block_size, num_kv_heads, head_dim);
      });
      gather_own_keys(*own_keys, open, qkv.get() + q_width, width, batch, block_size, own.data());
    }
    ss_paged_decode_attention(q.get(), w.k_cache, w.v_cache, cache_type, block_tables, table_stride, seq_lens,
                              own_keys != nullptr ? own.data() : nullptr, batch, num_heads, num_kv_heads, head_dim,
                              block_size, scale, attn.get(), threads);
    if (own_keys != nullptr) write_open_keys(*own_keys, open, qkv.get() + q_width, width, block_size);
    ss_attention_output_and_mlp(x, batch, hidden, attn.get(), q_width, w.o, static_cast<int>(w.o_format),
                                w.post_attn_norm, eps, w.gate_up, static_cast<int>(w.gate_up_format), w.down,
                                static_cast<int>(w.down_format), inter, threads);
  }
}

}  // extern "C"

// ---- ABI: what the Python side checks before it calls anything -------------------------------------------------

namespace {

constexpr int kAbiVersion = 7;  // ABI_VERSION in engine/kernels/abi.py: bump both when an entry point changes

// An argument's type as one letter (_TYPE_CODES in engine/kernels/abi.py): p pointer, q int64, i int, f float.
template <typename T>
constexpr char type_code() {
  if constexpr (std::is_pointer_v<T>) {
    return 'p';
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return 'q';
  } else if constexpr (std::is_same_v<T, int>) {
    return 'i';
  } else {
    static_assert(std::is_same_v<T, float>, "an entry point takes a type the ABI table cannot spell");
    return 'f';
  }
}

template <typename R, typename... Args>
struct ArgTypes {
  static constexpr char codes[sizeof...(Args) + 1] = {type_code<Args>()..., '\0'};
};

// The argument types of an entry point, from its own signature: the table below cannot drift from the definitions.
template <typename R, typename... Args>
constexpr const char* arg_types(R (*)(Args...)) {
  return ArgTypes<R, Args...>::codes;
}

}  // namespace

extern "C" {

struct AbiEntry {  // _AbiEntry in engine/kernels/abi.py
  const char* name;
  const char* arg_types;
};

#define SS_ABI_ENTRY(fn) \
  AbiEntry { #fn, arg_types(fn) }

static const AbiEntry kAbiTable[] = {
    SS_ABI_ENTRY(ss_vector_bits),
    SS_ABI_ENTRY(ss_linear),
    SS_ABI_ENTRY(ss_quant_linear),
    SS_ABI_ENTRY(ss_quant_rows),
    SS_ABI_ENTRY(ss_paged_decode_attention),
    SS_ABI_ENTRY(ss_prefill_attention),
    SS_ABI_ENTRY(ss_attention_input),
    SS_ABI_ENTRY(ss_attention_output_and_mlp),
    SS_ABI_ENTRY(ss_decode_layers),
    SS_ABI_ENTRY(ss_bf16_isa_ready),
    SS_ABI_ENTRY(ss_bf16_linear),
    SS_ABI_ENTRY(ss_bf16_attention_input),
    SS_ABI_ENTRY(ss_bf16_prefill_attention),
    SS_ABI_ENTRY(ss_bf16_output_and_mlp),
};

int ss_abi_version() { return kAbiVersion; }

// Sets *entries to the table of entry points the Python side calls; returns how many there are.
int64_t ss_abi_table(const AbiEntry** entries) {
  *entries = kAbiTable;
  return sizeof(kAbiTable) / sizeof(kAbiTable[0]);
}

}  // extern "C"
