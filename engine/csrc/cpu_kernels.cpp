// splitserve's CPU kernels for the memory-bound half of inference: the decode step.
//
// Built at first use by engine/cpu_kernels.py (g++ -O3 -march=native -fopenmp) and called through ctypes with
// raw pointers; nothing here knows about torch. OpenMP resolves to the libgomp torch already loaded, so these
// kernels share torch's thread pool, and the caller passes torch's thread count explicitly.
//
// The entry points (extern "C", below the helpers):
//  - ss_linear: y[R, out] = x[R, in] W^T (+ bias) with W stored in panels of 16 outputs, [P, in, 16]. Each panel
//    is one contiguous stream, so a 1-row product reads W at the memory's speed, and for more rows a 6 x 16 tile of
//    accumulators reuses every loaded W vector six times (a GEMM micro-kernel). The accumulation order of an output
//    depends only on `in`, never on R: a row gets the same bits alone or in a batch.
//  - ss_paged_decode_attention: one new query per sequence attends over its K/V read in place through its block
//    table (no gather copy), in 256-key chunks merged in order, every head of a key row while it is in cache.
//  - ss_attention_input / ss_attention_output_and_mlp: a decoder layer's two halves around its attention (norm,
//    QKV, rotary, cache write; output product, residual, norm, SwiGLU MLP, residual), built from ss_add_rms_norm,
//    ss_linear, ss_rope_and_cache and ss_silu_mul.
//  - ss_decode_layers: every layer of a decode-only step in one call.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace {

constexpr int kPanel = 16;   // outputs per panel: two AVX2 vectors
constexpr int kRowTile = 6;  // rows per micro-kernel tile: 12 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kChunkKeys = 256;  // keys per work item of the decode attention
constexpr int64_t kPrefetchRows = 8;  // how far ahead the decode attention asks for K/V rows

// Rows [0, R) of x (row stride ldx) times one panel [in, 16] -> y rows (stride ldy), `valid` outputs kept.
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* panel, int64_t in, const float* bias, float* y,
                       int64_t ldy, int valid) {
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

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr,         panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                         panel_tile<4>,   panel_tile<5>, panel_tile<6>};

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// [sum a0, sum a1, sum a2, sum a3]: four dot products' accumulators reduced together.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// e^x within ~2 float ulps: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n put
// into the exponent bits. Below -87 the result is 0, above 88 it is inf.
inline __m256 exp256(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2, high part
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);  // ln2, low part
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
  return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), overflow);
}

// Asks for rows[begin:end] (each `floats` long) ahead of their use: a context's blocks lie anywhere in the pool,
// which the hardware prefetcher cannot follow across blocks.
inline void prefetch_rows(const float* const* rows, int64_t begin, int64_t end, int64_t floats) {
  for (int64_t s = begin; s < end; ++s) {
    for (int64_t i = 0; i < floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(rows[s] + i), _MM_HINT_T0);
  }
}

// In place: x[0:n] <- e^(x - max x); returns max x and stores the sum of the exponentials in *sum.
// x has room for n rounded up to 8.
inline float exp_shifted(float* x, int64_t n, float* sum) {
  const int64_t full = n / 8 * 8;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < full; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float max = hmax(m);
  for (int64_t i = full; i < n; ++i) max = std::max(max, x[i]);
  for (int64_t i = n; i < (n + 7) / 8 * 8; ++i) x[i] = -INFINITY;  // the last vector's padding: e^-inf = 0
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(x + i, e);
    total = _mm256_add_ps(total, e);
  }
  *sum = hsum(total);
  return max;
}

}  // namespace

extern "C" {

// y[rows, out] (row stride ldy) = x[rows, in] (row stride ldx) W^T + bias; W in panels [P, in, 16], the last
// panel's padding outputs zero (engine/model.py's Linear packs them).
void ss_linear(const float* x, int64_t rows, int64_t ldx, const float* packed, int64_t out, int64_t in,
               const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t panels = (out + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = packed + p * in * kPanel;
    const int valid = static_cast<int>(std::min<int64_t>(kPanel, out - p * kPanel));
    const float* panel_bias = nullptr;
    alignas(32) float bias_tmp[kPanel] = {0};
    if (bias != nullptr) {
      memcpy(bias_tmp, bias + p * kPanel, sizeof(float) * valid);
      panel_bias = bias_tmp;
    }
    for (int64_t r = 0; r < rows; r += kRowTile) {
      const int n = static_cast<int>(std::min<int64_t>(kRowTile, rows - r));
      kTiles[n](x + r * ldx, ldx, panel, in, panel_bias, y + r * ldy + p * kPanel, ldy, valid);
    }
  }
}

// out[b, hq, :] = softmax(q[b, hq] . K[b]^T * scale) V[b] for one new query per sequence.
// q, out: [B, Hq, D] contiguous, D a multiple of 8; k_cache, v_cache: [num_blocks, block_size, Hkv, D] contiguous;
// block_tables: [B, table_stride] int64; seq_lens: [B] int64, the keys each sequence attends to.
//
// Work items are chunks of kChunkKeys keys of one sequence, all heads (flash-decoding's split over keys): a
// single sequence still keeps every thread busy, and each block is read front to back, which the hardware
// prefetcher follows. Each chunk leaves its max score, exp-sum and unnormalized output per head; a sequence's
// chunks are then merged in order. The split depends on the sequence alone, never on the batch, so a sequence
// gets the same bits whatever runs beside it.
void ss_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                               const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                               int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, float scale, float* out, int threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive slots of a block
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
    std::vector<const float*> key_rows(chunk_keys), value_rows(chunk_keys);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t chunk = item - first_item[b];
      const int64_t start = chunk * chunk_keys, len = std::min(chunk_keys, seq_lens[b] - start);
      const int64_t* table = block_tables + b * table_stride + chunk * chunk_blocks;
      for (int64_t s0 = 0, i = 0; s0 < len; s0 += block_size, ++i) {
        for (int64_t j = 0, n = std::min(block_size, len - s0); j < n; ++j) {
          const int64_t offset = table[i] * block_stride + j * row_stride;
          key_rows[s0 + j] = k_cache + offset;
          value_rows[s0 + j] = v_cache + offset;
        }
      }
      const float* qb = q + b * num_heads * head_dim;
      // Pass 1: the scaled scores, four keys at a time, every head of those keys while they are in cache.
      int64_t s = 0;
      for (; s + 4 <= len; s += 4) {
        prefetch_rows(key_rows.data(), s + kPrefetchRows, std::min(len, s + kPrefetchRows + 4), row_stride);
        for (int64_t r = 0; r < num_heads; ++r) {
          const float* qr = qb + r * head_dim;
          const int64_t h = r / group * head_dim;
          const float *k0 = key_rows[s] + h, *k1 = key_rows[s + 1] + h, *k2 = key_rows[s + 2] + h,
                      *k3 = key_rows[s + 3] + h;
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t d = 0; d < head_dim; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qr + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
          }
          _mm_storeu_ps(scores.data() + r * score_stride + s, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_set1_ps(scale)));
        }
      }
      for (; s < len; ++s) {
        for (int64_t r = 0; r < num_heads; ++r) {
          const float* qr = qb + r * head_dim;
          const float* key = key_rows[s] + r / group * head_dim;
          __m256 a0 = _mm256_setzero_ps();
          for (int64_t d = 0; d < head_dim; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(key + d), a0);
          scores[r * score_stride + s] = hsum(a0) * scale;
        }
      }
      for (int64_t r = 0; r < num_heads; ++r) {
        part_max[item * num_heads + r] = exp_shifted(scores.data() + r * score_stride, len, &part_sum[item * num_heads + r]);
      }
      // Pass 2: the weighted sum of the values, four value rows at a time, every head of those rows.
      float* acc = part_out.data() + item * num_heads * head_dim;
      std::fill(acc, acc + num_heads * head_dim, 0.0f);
      for (s = 0; s < len; s += 4) {
        const int64_t n = std::min<int64_t>(4, len - s);
        prefetch_rows(value_rows.data(), s + kPrefetchRows, std::min(len, s + kPrefetchRows + 4), row_stride);
        for (int64_t r = 0; r < num_heads; ++r) {
          const float* sr = scores.data() + r * score_stride + s;
          const int64_t h = r / group * head_dim;
          float* ar = acc + r * head_dim;
          if (n == 4) {
            const __m256 p0 = _mm256_set1_ps(sr[0]), p1 = _mm256_set1_ps(sr[1]), p2 = _mm256_set1_ps(sr[2]),
                         p3 = _mm256_set1_ps(sr[3]);
            const float *v0 = value_rows[s] + h, *v1 = value_rows[s + 1] + h, *v2 = value_rows[s + 2] + h,
                        *v3 = value_rows[s + 3] + h;
            for (int64_t d = 0; d < head_dim; d += 8) {
              __m256 a = _mm256_loadu_ps(ar + d);
              a = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + d), a);
              a = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + d), a);
              a = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v2 + d), a);
              a = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v3 + d), a);
              _mm256_storeu_ps(ar + d, a);
            }
          } else {
            for (int64_t i = 0; i < n; ++i) {
              const __m256 p = _mm256_set1_ps(sr[i]);
              const float* v = value_rows[s + i] + h;
              for (int64_t d = 0; d < head_dim; d += 8) {
                _mm256_storeu_ps(ar + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), _mm256_loadu_ps(ar + d)));
              }
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

// x[r] += delta[r] when delta is given, then out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight; x, delta, out:
// [rows, dim] contiguous. The residual add and the norm of every decoder layer in one pass.
void ss_add_rms_norm(float* x, const float* delta, const float* weight, float eps, float* out, int64_t rows,
                     int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    float* outr = out + r * dim;
    float sum = 0.0f;
    if (delta != nullptr) {
      const float* dr = delta + r * dim;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        xr[i] += dr[i];
        sum += xr[i] * xr[i];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += xr[i] * xr[i];
    }
    const float inv = 1.0f / sqrtf(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * inv * weight[i];
  }
}

// Rotary embedding in place on the q and k heads of qkv [T, (Hq + 2 Hkv) D] (HF's rotate-half layout): each head
// x becomes x * cos + swap_halves(x) * sin_signed at its token's position, cos and sin_signed being [P, D] tables.
// Then, with caches given, the step's k and v go to the caches [num_blocks * block_size, Hkv, D] at slot_mapping.
void ss_rope_and_cache(float* qkv, int64_t tokens, const int64_t* positions, const float* cos,
                       const float* sin_signed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       float* k_cache, float* v_cache, const int64_t* slot_mapping, int threads) {
  const int64_t half = head_dim / 2;
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_width = num_kv_heads * head_dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 64)
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = qkv + t * width;
    const float* c = cos + positions[t] * head_dim;
    const float* sn = sin_signed + positions[t] * head_dim;
    float rotated[512];  // head_dim <= 512, checked by the caller
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* x = row + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        rotated[i] = x[i] * c[i] + x[i + half] * sn[i];
        rotated[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
      }
      memcpy(x, rotated, sizeof(float) * head_dim);
    }
    if (k_cache != nullptr) {
      const int64_t slot = slot_mapping[t];
      memcpy(k_cache + slot * kv_width, row + num_heads * head_dim, sizeof(float) * kv_width);
      memcpy(v_cache + slot * kv_width, row + (num_heads + num_kv_heads) * head_dim, sizeof(float) * kv_width);
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
// qkv [T, (Hq + 2 Hkv) D] = h Wqkv^T (+ bias); q and k rotated in place; k and v written to the caches at slots.
void ss_attention_input(const float* x, int64_t tokens, int64_t hidden, const float* norm_weight, float eps,
                        const float* qkv_weight, const float* qkv_bias, float* qkv, const int64_t* positions,
                        const float* cos, const float* sin_signed, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, float* k_cache, float* v_cache, const int64_t* slot_mapping, int threads) {
  std::unique_ptr<float[]> h(new float[tokens * hidden]);
  ss_add_rms_norm(const_cast<float*>(x), nullptr, norm_weight, eps, h.get(), tokens, hidden, threads);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  ss_linear(h.get(), tokens, hidden, qkv_weight, width, hidden, qkv_bias, qkv, width, threads);
  ss_rope_and_cache(qkv, tokens, positions, cos, sin_signed, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                    slot_mapping, threads);
}

// The second half of a decoder layer, from its attention's output attn [T, attn_width] on: x += attn Wo^T;
// h = RMSNorm(x); x += down(silu(gate) * up) with [gate, up] = h Wgate_up^T. x: the residual stream [T, hidden].
void ss_attention_output_and_mlp(float* x, int64_t tokens, int64_t hidden, const float* attn, int64_t attn_width,
                                 const float* o_weight, const float* norm_weight, float eps,
                                 const float* gate_up_weight, const float* down_weight, int64_t inter, int threads) {
  std::unique_ptr<float[]> o(new float[tokens * hidden]), h(new float[tokens * hidden]);
  std::unique_ptr<float[]> gate_up(new float[tokens * 2 * inter]), act(new float[tokens * inter]);
  ss_linear(attn, tokens, attn_width, o_weight, hidden, attn_width, nullptr, o.get(), hidden, threads);
  ss_add_rms_norm(x, o.get(), norm_weight, eps, h.get(), tokens, hidden, threads);
  ss_linear(h.get(), tokens, hidden, gate_up_weight, 2 * inter, hidden, nullptr, gate_up.get(), 2 * inter, threads);
  ss_silu_mul(gate_up.get(), act.get(), tokens, inter, threads);
  ss_linear(act.get(), tokens, inter, down_weight, hidden, inter, nullptr, o.get(), hidden, threads);
  const int64_t n = tokens * hidden;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) x[i] += o[i];
}

// One decoder layer's weights (packed linear weights, norm weights, optional QKV bias) and its KV caches.
struct DecodeLayer {
  const float* input_norm;
  const float* qkv;
  const float* qkv_bias;
  const float* o;
  const float* post_attn_norm;
  const float* gate_up;
  const float* down;
  float* k_cache;
  float* v_cache;
};

// A whole decode step's layers: one new token per sequence (token b is sequence b), every layer run as
// ss_attention_input, ss_paged_decode_attention and ss_attention_output_and_mlp in turn, the residual stream
// x [B, hidden] updated in place. The same kernels in the same order as layer-by-layer calls, so the same bits,
// without the interpreter between layers.
void ss_decode_layers(float* x, int64_t batch, int64_t hidden, int64_t num_layers, const DecodeLayer* layers,
                      float eps, const int64_t* positions, const float* cos, const float* sin_signed,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                      const int64_t* slot_mapping, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t block_size, float scale, int threads) {
  const int64_t q_width = num_heads * head_dim;
  const int64_t width = q_width + 2 * num_kv_heads * head_dim;
  std::unique_ptr<float[]> qkv(new float[batch * width]), q(new float[batch * q_width]);
  std::unique_ptr<float[]> attn(new float[batch * q_width]);
  for (int64_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& w = layers[l];
    ss_attention_input(x, batch, hidden, w.input_norm, eps, w.qkv, w.qkv_bias, qkv.get(), positions, cos,
                       sin_signed, num_heads, num_kv_heads, head_dim, w.k_cache, w.v_cache, slot_mapping, threads);
    for (int64_t b = 0; b < batch; ++b) memcpy(q.get() + b * q_width, qkv.get() + b * width, sizeof(float) * q_width);
    ss_paged_decode_attention(q.get(), w.k_cache, w.v_cache, block_tables, table_stride, seq_lens, batch, num_heads,
                              num_kv_heads, head_dim, block_size, scale, attn.get(), threads);
    ss_attention_output_and_mlp(x, batch, hidden, attn.get(), q_width, w.o, w.post_attn_norm, eps, w.gate_up,
                                w.down, inter, threads);
  }
}

}  // extern "C"
