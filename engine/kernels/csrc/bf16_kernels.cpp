// splitserve's bf16 prefill kernels: a decoder layer's prompt rows computed with bf16 products (bf16_tiles.h: one
// tiling for every row, on AVX2 FMAs, avx512_bf16 or AMX tiles) and float32 sums, activations crossing memory as
// bf16 between the products.
//
// Built into the same library as cpu_kernels.cpp (engine/kernels/build.py), called through ctypes
// (engine/kernels/bf16_kernels.py, engine/model/bf16_prefill.py). A layer's prompt rows take three calls:
//  - ss_bf16_attention_input: h = RMSNorm(x) rounded to bf16; qkv = h Wqkv^T (+ bias) in float32; q and k rotated
//    and k, v written to the cache by the float32 path's own ss_rope_and_cache (so the cache holds what it would);
//  - ss_bf16_prefill_attention, per sequence: its queries over its keys (cached prefix and new tokens) read through
//    its block table, causal: K and V packed once as bf16 panels per KV head, then per (query head, 32 rows): scores
//    = q K^T (a bf16 product), a float32 softmax whose weights are rounded to bf16, out = p V (a bf16 product),
//    normalized and rounded to bf16, the output product's input;
//  - ss_bf16_output_and_mlp: x += attn Wo^T; h = RMSNorm(x) in bf16; act = silu(gate) * up rounded to bf16, straight
//    from the gate/up product's tiles (its panels interleaved gate, up, gate, up, ...); x += act Wdown^T.
// Every step is a function of its own row (a query row's attention of its own keys: the weights of keys it does not
// see are exact zeros), so a prompt position's bits do not depend on its chunk, its batch or the thread count.
// ss_bf16_linear is one product alone (tests, benchmarks); ss_bf16_isa_ready says whether an ISA runs here.
// Every entry point returns 0, or -1 when asked for an ISA that does not run on this CPU (nothing is computed).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "bf16_kernels.h"
#include "bf16_tiles.h"
#include "cache_elems.h"
#include "vector_math.h"

extern "C" void ss_rope_and_cache(float* qkv, int64_t tokens, const int64_t* positions, const float* cos,
                                  const float* sin_signed, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, const float* q_norm, const float* k_norm, float eps,
                                  void* k_cache, void* v_cache, int cache_type, const int64_t* slot_mapping,
                                  int threads);  // cpu_kernels.cpp

namespace {

using bf16::kKStep;
using bf16::kPanel;
using bf16::Operands;
using bf16::round_up;

// Panels of a weight with `out` outputs.
inline int64_t panels_of(int64_t out) { return (out + kPanel - 1) / kPanel; }

// out[r][0:dim] = RMSNorm(x[r]) * weight rounded to bf16 (the float32 path's norm, ss_add_rms_norm), then zeros up to
// ldo: the rows of a product's activations.
void rms_norm_bf16(const float* x, const float* weight, float eps, int64_t rows, int64_t dim, uint16_t* out,
                   int64_t ldo, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    uint16_t* o = out + r * ldo;
    const float inv = 1.0f / sqrtf(sum_of_squares(xr, dim) / static_cast<float>(dim) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv);
      store_bf16x8(o + i, _mm256_mul_ps(normed, _mm256_loadu_ps(weight + i)));
    }
    for (; i < dim; ++i) o[i] = float_to_bf16(xr[i] * inv * weight[i]);
    std::fill(o + dim, o + ldo, 0);
  }
}

// ---- what a product does with its float32 sums (bf16::product's epilogues) ---------------------------------------

// y[r][col] = sum (+ bias[col]) for the first `out` columns.
struct StoreF32 {
  float* y;
  int64_t ldy;
  int64_t out;
  const float* bias;
  void operator()(int64_t r0, int rows, int64_t p0, int np, const float* c, int64_t ldc) const {
    const int64_t col0 = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, out - col0);
    for (int r = 0; r < rows; ++r) {
      float* yr = y + (r0 + r) * ldy + col0;
      const float* cr = c + r * ldc;
      if (bias == nullptr) {
        memcpy(yr, cr, sizeof(float) * cols);
      } else {
        for (int64_t j = 0; j < cols; ++j) yr[j] = cr[j] + bias[col0 + j];
      }
    }
  }
};

// y[r][col] += sum: a residual stream's update.
struct AddF32 {
  float* y;
  int64_t ldy;
  int64_t out;
  void operator()(int64_t r0, int rows, int64_t p0, int np, const float* c, int64_t ldc) const {
    const int64_t col0 = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, out - col0);
    for (int r = 0; r < rows; ++r) {
      float* yr = y + (r0 + r) * ldy + col0;
      const float* cr = c + r * ldc;
      int64_t j = 0;
      for (; j + 8 <= cols; j += 8) {
        _mm256_storeu_ps(yr + j, _mm256_add_ps(_mm256_loadu_ps(yr + j), _mm256_loadu_ps(cr + j)));
      }
      for (; j < cols; ++j) yr[j] += cr[j];
    }
  }
};

// act[r][i] = silu(gate_i) * up_i rounded to bf16, from a gate/up product whose panels alternate gate, up (each item
// holds whole pairs: every ISA's panel group is even).
struct SiluMulBf16 {
  uint16_t* act;
  int64_t lda;
  int64_t inter;
  void operator()(int64_t r0, int rows, int64_t p0, int np, const float* c, int64_t ldc) const {
    for (int r = 0; r < rows; ++r) {
      for (int pair = 0; pair < np / 2; ++pair) {
        const float* gate = c + r * ldc + 2 * pair * kPanel;
        const float* up = gate + kPanel;
        const int64_t col0 = (p0 / 2 + pair) * kPanel;
        uint16_t* out = act + (r0 + r) * lda + col0;
        if (col0 + kPanel <= inter) {
          for (int h = 0; h < kPanel; h += 8) {
            const __m256 g = _mm256_loadu_ps(gate + h);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            store_bf16x8(out + h, _mm256_mul_ps(silu, _mm256_loadu_ps(up + h)));
          }
        } else {
          for (int64_t j = 0; col0 + j < inter; ++j) {
            out[j] = float_to_bf16(gate[j] / (1.0f + expf(-gate[j])) * up[j]);
          }
        }
      }
    }
  }
};

// out[r][d] = sum * inv_sum[r] rounded to bf16, for the first `dims` columns: a query head's attention output.
struct AttentionOut {
  uint16_t* out;
  int64_t ldo;
  int64_t dims;
  const float* inv_sum;
  void operator()(int64_t r0, int rows, int64_t p0, int np, const float* c, int64_t ldc) const {
    const int64_t col0 = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, dims - col0);
    for (int r = 0; r < rows; ++r) {
      uint16_t* o = out + (r0 + r) * ldo + col0;
      for (int64_t j = 0; j < cols; ++j) o[j] = float_to_bf16(c[r * ldc + j] * inv_sum[r0 + r]);
    }
  }
};

// ---- the prefill attention ------------------------------------------------------------------------------------------

constexpr int64_t kQueryRows = 32;  // query rows per work item

// One sequence's n new queries (positions prefix .. prefix + n - 1; query r of head hq at q + r * ldq + hq * D,
// float32) over its keys 0 .. prefix + n - 1, read through its block table from caches of type CT, causal ->
// out[r][hq * D + d] in bf16.
template <int CT>
void prefill_attention(bf16::Isa isa, const float* q, int64_t ldq, const typename CacheElem<CT>::T* k_cache,
                       const typename CacheElem<CT>::T* v_cache, const int64_t* blocks, int64_t n, int64_t prefix,
                       const uint16_t* own_keys, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, uint16_t* out, int64_t ldo, int threads) {
  const int64_t own_start = prefix / block_size * block_size;
  const int64_t keys = prefix + n;
  const int64_t dp = round_up(head_dim, kKStep);  // a head's inputs to q K^T, zero padded
  const int64_t keys_p = round_up(keys, kKStep);  // the inputs to p V, zero padded
  const int64_t key_panels = panels_of(keys), dim_panels = dp / kPanel;
  // Per KV head: K as panels of 16 keys [key_panels][dp / 2][16][2] (q K^T's weight), V as panels of 16 dimensions
  // [dim_panels][keys_p / 2][16][2] (p V's weight), both bf16, zero padded.
  const int64_t k_head = key_panels * dp * kPanel, v_head = dim_panels * keys_p * kPanel;
  std::vector<uint16_t> k_packed(num_kv_heads * k_head, 0), v_packed(num_kv_heads * v_head, 0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < num_kv_heads * keys; ++item) {
    const int64_t h = item / keys, j = item % keys;
    const int64_t at = ((blocks[j / block_size] * block_size + j % block_size) * num_kv_heads + h) *
                       row_elems<CT>(head_dim);
    alignas(32) float k[512], v[512];
    load_row<CT>(k_cache + at, head_dim, k);
    load_row<CT>(v_cache + at, head_dim, v);
    uint16_t* kp = k_packed.data() + h * k_head + j / kPanel * dp * kPanel + j % kPanel * 2;
    uint16_t* vp = v_packed.data() + h * v_head + j / 2 * 2 * kPanel + j % 2;
    for (int64_t d = 0; d < head_dim; ++d) {
      kp[d / 2 * 2 * kPanel + d % 2] = float_to_bf16(k[d]);
      vp[d / kPanel * keys_p * kPanel + d % kPanel * 2] = float_to_bf16(v[d]);
    }
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_blocks = (n + kQueryRows - 1) / kQueryRows;
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint16_t> queries(kQueryRows * dp, 0), weights(kQueryRows * keys_p);
    std::vector<float> scores(kQueryRows * keys_p);
    float inv_sum[kQueryRows];
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < num_heads * row_blocks; ++item) {
      const int64_t block = row_blocks - 1 - item / num_heads;  // the longest rows first, for balance
      const int64_t hq = item % num_heads, h = hq / group;
      const int64_t r0 = block * kQueryRows, rows = std::min(kQueryRows, n - r0);
      const int64_t seen = prefix + r0 + rows;  // keys the block's last row sees
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + (r0 + r) * ldq + hq * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) queries[r * dp + d] = float_to_bf16(qr[d]);
      }
      const Operands qk{queries.data(), dp, rows, k_packed.data() + h * k_head, dp * kPanel, panels_of(seen), dp};
      bf16::product_items(isa, qk, 0, bf16::product_item_count(isa, qk),
                          StoreF32{scores.data(), keys_p, panels_of(seen) * kPanel, nullptr});
      const int64_t seen_p = round_up(seen, kKStep);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * keys_p;
        uint16_t* p = weights.data() + r * keys_p;
        const int64_t valid = prefix + r0 + r + 1;
        for (int64_t j = own_keys == nullptr ? valid : (valid - 1) / block_size * block_size; j < valid; ++j) {
          s[j] = dot_float16(q + (r0 + r) * ldq + hq * head_dim,
                             own_keys + ((j - own_start) * num_kv_heads + h) * head_dim, head_dim);
        }
        for (int64_t j = 0; j < valid; ++j) s[j] *= scale;
        float sum;
        exp_shifted(s, valid, &sum);
        int64_t j = 0;
        for (; j + 8 <= valid; j += 8) store_bf16x8(p + j, _mm256_loadu_ps(s + j));
        for (; j < valid; ++j) p[j] = float_to_bf16(s[j]);
        std::fill(p + valid, p + seen_p, 0);  // keys this row does not see weigh exactly zero
        inv_sum[r] = 1.0f / sum;
      }
      const Operands pv{weights.data(), keys_p, rows, v_packed.data() + h * v_head, keys_p * kPanel, dim_panels,
                        seen_p};
      bf16::product_items(isa, pv, 0, bf16::product_item_count(isa, pv),
                          AttentionOut{out + r0 * ldo + hq * head_dim, ldo, head_dim, inv_sum});
    }
  }
}

}  // namespace

extern "C" {

// 1 when `isa` (a bf16::Isa) runs on this CPU (AMX: and this process was granted its tiles), else 0.
int ss_bf16_isa_ready(int isa) { return bf16::isa_ready(isa) ? 1 : 0; }

// y[rows, out] (row stride ldy) = x[rows, kp] (bf16, row stride ldx) W^T + bias, W packed (bf16_tiles.h) with kp
// inputs; float32 out.
int ss_bf16_linear(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t out, int64_t kp,
                   const float* bias, float* y, int64_t ldy, int threads, int isa) {
  if (!bf16::isa_ready(isa)) return -1;
  const Operands op{x, ldx, rows, packed, kp * kPanel, panels_of(out), kp};
  bf16::product(static_cast<bf16::Isa>(isa), op, StoreF32{y, ldy, out, bias}, threads);
  return 0;
}

// A layer's prompt rows up to their attention: qkv [T, (Hq + 2 Hkv) D] = bf16(RMSNorm(x)) Wqkv^T (+ bias), q and k
// heads normalized (q_norm, k_norm, or null) and rotated in place, k and v written to the caches at slot_mapping
// (cpu_kernels.cpp's ss_rope_and_cache).
int ss_bf16_attention_input(const float* x, int64_t tokens, int64_t hidden, const float* norm_weight, float eps,
                            const uint16_t* qkv_packed, const float* qkv_bias, float* qkv, const int64_t* positions,
                            const float* cos, const float* sin_signed, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, const float* q_norm, const float* k_norm, void* k_cache, void* v_cache,
                            int cache_type, const int64_t* slot_mapping, int threads, int isa) {
  if (!bf16::isa_ready(isa)) return -1;
  const int64_t kp = round_up(hidden, kKStep);
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  std::vector<uint16_t> h(tokens * kp);
  rms_norm_bf16(x, norm_weight, eps, tokens, hidden, h.data(), kp, threads);
  const Operands op{h.data(), kp, tokens, qkv_packed, kp * kPanel, panels_of(width), kp};
  bf16::product(static_cast<bf16::Isa>(isa), op, StoreF32{qkv, width, width, qkv_bias}, threads);
  ss_rope_and_cache(qkv, tokens, positions, cos, sin_signed, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps,
                    k_cache, v_cache, cache_type, slot_mapping, threads);
  return 0;
}

// One sequence's prompt rows' attention (prefill_attention above), caches of cache_type, out bf16 [n][ldo].
int ss_bf16_prefill_attention(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, int cache_type,
                              const int64_t* blocks, int64_t n, int64_t prefix, const uint16_t* own_keys,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              float scale, uint16_t* out, int64_t ldo, int threads, int isa) {
  if (!bf16::isa_ready(isa)) return -1;
  with_cache_type(cache_type, [&](auto ct) {
    using T = typename CacheElem<ct>::T;
    prefill_attention<ct>(static_cast<bf16::Isa>(isa), q, ldq, static_cast<const T*>(k_cache),
                          static_cast<const T*>(v_cache), blocks, n, prefix, own_keys, num_heads, num_kv_heads,
                          head_dim, block_size, scale, out, ldo, threads);
  });
  return 0;
}

// The rest of a layer's prompt rows, in place on the residual stream x [T, hidden]: x += attn Wo^T (attn bf16
// [T][round_up(attn_width, 32)]); x += down(silu(gate) * up) of bf16(RMSNorm(x)), gate/up panels interleaved.
int ss_bf16_output_and_mlp(float* x, int64_t tokens, int64_t hidden, const uint16_t* attn, int64_t attn_width,
                           const uint16_t* o_packed, const float* norm_weight, float eps,
                           const uint16_t* gate_up_packed, const uint16_t* down_packed, int64_t inter, int threads,
                           int isa) {
  if (!bf16::isa_ready(isa)) return -1;
  const auto at = static_cast<bf16::Isa>(isa);
  const int64_t attn_kp = round_up(attn_width, kKStep), hidden_kp = round_up(hidden, kKStep);
  const int64_t inter_kp = round_up(inter, kKStep);
  bf16::product(at, Operands{attn, attn_kp, tokens, o_packed, attn_kp * kPanel, panels_of(hidden), attn_kp},
                AddF32{x, hidden, hidden}, threads);
  std::vector<uint16_t> h(tokens * hidden_kp), act(tokens * inter_kp, 0);
  rms_norm_bf16(x, norm_weight, eps, tokens, hidden, h.data(), hidden_kp, threads);
  bf16::product(at, Operands{h.data(), hidden_kp, tokens, gate_up_packed, hidden_kp * kPanel, 2 * panels_of(inter),
                             hidden_kp},
                SiluMulBf16{act.data(), inter_kp, inter}, threads);
  bf16::product(at, Operands{act.data(), inter_kp, tokens, down_packed, inter_kp * kPanel, panels_of(hidden), inter_kp},
                AddF32{x, hidden, hidden}, threads);
  return 0;
}

}  // extern "C"
