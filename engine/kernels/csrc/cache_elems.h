// The KV cache's element types, as the native kernels read and write them: float32; 16-bit bfloat16 / float16 values
// widened to float32 as they are loaded (and rounded to nearest, ties to even, as they are stored); or int8 codes
// with a float16 scale per 16 channels of a (token, head) row. The attention's arithmetic is float32 whatever the
// cache holds. Shared by the float32 kernels (cpu_kernels.cpp) and the bf16 prefill (bf16_kernels.cpp), which read
// the same caches.
//
// A pool row is one (token, head)'s K or V: head_dim elements, then, for a scaled type, its groups' scales
// (scale_elems(head_dim) elements of T, two bytes holding a float16 per group). engine/kv_formats/rows.py is the
// Python side of the same layout and must agree bit for bit.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "vector_math.h"

namespace {

// What the KV cache holds (CACHE_TYPES in engine/kernels/checks.py).
enum CacheType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3 };

// With AVX-512 (F and DQ) the decode attention holds 16 consecutive elements of a row in one 512-bit register, each
// lane summing in the order the AVX2 code's lanes do (cpu_kernels.cpp, "score_tile512", "value_tile512"): load16
// loads and widens them (load8(p) in lanes 0-7, load8(p + 8) in 8-15).
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SS_ATTENTION_512 1
#endif

template <int CT>
struct CacheElem;

template <>
struct CacheElem<kFloat32> {
  using T = float;
  static constexpr bool kScaled = false;
  static constexpr int64_t scale_elems(int64_t) { return 0; }
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
#ifdef SS_ATTENTION_512
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif
};

template <>
struct CacheElem<kBFloat16> {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  static constexpr int64_t scale_elems(int64_t) { return 0; }
  static __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store8(uint16_t* p, __m256 x) { store_bf16x8(p, x); }  // torch's rounding
#ifdef SS_ATTENTION_512
  static __m512 load16(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
#endif
};

template <>
struct CacheElem<kFloat16> {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  static constexpr int64_t scale_elems(int64_t) { return 0; }
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#ifdef SS_ATTENTION_512
  static __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
  static void store8(uint16_t* p, __m256 x) {  // rounded to nearest, ties to even, as torch rounds to float16
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

// Symmetric int8, a scale per group of kGroup (16) consecutive channels (a last group of 8 where head_dim is not a
// multiple of 16): a group's codes are round(x / s) in [-127, 127] (ties to even), s = the group's amax / 127
// rounded up to a float16 (saturating at float16's largest; an all-zero group gets s = 0 and zero codes): the int8
// KV codec's scheme (kvtransfer/codecs/symmetric.py), so a pool's rows are that codec's payload and scales as they
// lie. The scales follow the codes, a float16 per group in order.
template <>
struct CacheElem<kInt8> {
  using T = int8_t;
  static constexpr bool kScaled = true;
  static constexpr int64_t kGroup = 16;  // channels per scale (SCALE_GROUP in rows.py)
  static constexpr int64_t scale_elems(int64_t head_dim) { return 2 * ((head_dim + kGroup - 1) / kGroup); }
  static __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#ifdef SS_ATTENTION_512
  static __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#endif
  // The scale of dimension d's group.
  static float scale(const int8_t* row, int64_t head_dim, int64_t d) {
    uint16_t half;
    memcpy(&half, row + head_dim + 2 * (d / kGroup), sizeof(half));
    return _cvtsh_ss(half);
  }
  static void store_row(int8_t* row, const float* x, int64_t head_dim) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t d0 = 0; d0 < head_dim; d0 += kGroup) {
      const int64_t end = d0 + kGroup < head_dim ? d0 + kGroup : head_dim;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = d0; i < end; i += 8) {
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
      }
      const float wanted = hmax(amax) / 127.0f;
      const uint16_t half =
          wanted > 65504.0f ? 0x7bff : _cvtss_sh(wanted, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
      const float s = _cvtsh_ss(half);
      const __m256 divisor = _mm256_set1_ps(s > 0.0f ? s : 1.0f);
      for (int64_t i = d0; i < end; i += 8) {
        const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), divisor),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i codes = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi));
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(row + i), _mm_packs_epi16(words, words));
      }
      memcpy(row + head_dim + 2 * (d0 / kGroup), &half, sizeof(half));
    }
  }
};

// Elements of T a row takes: its head_dim values and, for a scaled type, its scales.
template <int CT>
constexpr int64_t row_elems(int64_t head_dim) {
  return head_dim + CacheElem<CT>::scale_elems(head_dim);
}

// x times s in every lane.
inline __m256 times(__m256 x, float s) { return _mm256_mul_ps(x, _mm256_set1_ps(s)); }
#ifdef SS_ATTENTION_512
inline __m512 times(__m512 x, float s) { return _mm512_mul_ps(x, _mm512_set1_ps(s)); }
#endif

// x, a row's elements from dimension d on (of one scale group) widened to float32, as their values: a scaled type's
// codes times their group's scale (exact in float32: an 8-bit code times an 11-bit mantissa); an unscaled type's as
// they are.
template <int CT, typename V>
inline V scaled(V x, const typename CacheElem<CT>::T* row, int64_t d, int64_t head_dim) {
  if constexpr (CacheElem<CT>::kScaled) {
    return times(x, CacheElem<CT>::scale(row, head_dim, d));
  } else {
    return x;
  }
}

// Dimensions d .. d + 7 of a row (d a multiple of 8) as float32 values.
template <int CT>
inline __m256 values8(const typename CacheElem<CT>::T* row, int64_t d, int64_t head_dim) {
  return scaled<CT>(CacheElem<CT>::load8(row + d), row, d, head_dim);
}

#ifdef SS_ATTENTION_512
// Dimensions d .. d + 15 (d a multiple of 16: one scale group) as float32 values, in one register.
template <int CT>
inline __m512 values16(const typename CacheElem<CT>::T* row, int64_t d, int64_t head_dim) {
  return scaled<CT>(CacheElem<CT>::load16(row + d), row, d, head_dim);
}
#endif

// A row's head_dim values, as float32, into out.
template <int CT>
inline void load_row(const typename CacheElem<CT>::T* row, int64_t head_dim, float* out) {
  for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(out + d, values8<CT>(row, d, head_dim));
}

// head_dim float32 values stored as a row of CT.
template <int CT>
inline void store_row(typename CacheElem<CT>::T* row, const float* x, int64_t head_dim) {
  if constexpr (CacheElem<CT>::kScaled) {
    CacheElem<CT>::store_row(row, x, head_dim);
  } else {
    for (int64_t d = 0; d < head_dim; d += 8) CacheElem<CT>::store8(row + d, _mm256_loadu_ps(x + d));
  }
}

// Calls f(std::integral_constant<int, CT>) for the cache type the caller named (checked there).
template <typename F>
void with_cache_type(int cache_type, F&& f) {
  switch (cache_type) {
    case kBFloat16:
      f(std::integral_constant<int, kBFloat16>{});
      break;
    case kFloat16:
      f(std::integral_constant<int, kFloat16>{});
      break;
    case kInt8:
      f(std::integral_constant<int, kInt8>{});
      break;
    default:
      f(std::integral_constant<int, kFloat32>{});
  }
}

// One token's new K and V (num_kv_heads rows of head_dim floats each, head_dim a multiple of 8) into the caches at
// `slot`, as rows of CT.
template <int CT>
void write_cache_row(void* k_cache, void* v_cache, int64_t slot, const float* k_new, const float* v_new,
                     int64_t num_kv_heads, int64_t head_dim) {
  using T = typename CacheElem<CT>::T;
  const int64_t width = row_elems<CT>(head_dim);
  T* k = static_cast<T*>(k_cache) + slot * num_kv_heads * width;
  T* v = static_cast<T*>(v_cache) + slot * num_kv_heads * width;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    store_row<CT>(k + h * width, k_new + h * head_dim, head_dim);
    store_row<CT>(v + h * width, v_new + h * head_dim, head_dim);
  }
}

using WriteKVFn = void (*)(void*, void*, int64_t, const float*, const float*, int64_t, int64_t);

// A scaled pool's open blocks (engine/kv_formats/open_keys.py): the float16 keys of the block a sequence is filling,
// in a block of the pool it holds for them. Token t's keys (num_kv_heads * head_dim float16, head after head) lie at
// the start of the block's K storage for t < B / 2, of its V storage for the others (a layer's pools, that layer's).
struct OpenKeys {
  uint8_t* k_cache;  // the layer's pools, as bytes
  uint8_t* v_cache;
  int64_t block_bytes;  // one block of a pool
  int64_t half;  // block_size / 2
  int64_t row;  // num_kv_heads * head_dim: one token's keys

  uint16_t* keys(int64_t block, int64_t offset) const {
    uint8_t* base = (offset < half ? k_cache : v_cache) + block * block_bytes;
    return reinterpret_cast<uint16_t*>(base) + (offset % half) * row;
  }
};

template <int CT>
OpenKeys open_keys_of(void* k_cache, void* v_cache, int64_t block_size, int64_t num_kv_heads, int64_t head_dim) {
  return OpenKeys{static_cast<uint8_t*>(k_cache), static_cast<uint8_t*>(v_cache),
                  block_size * num_kv_heads * row_elems<CT>(head_dim) *
                      static_cast<int64_t>(sizeof(typename CacheElem<CT>::T)),
                  block_size / 2, num_kv_heads * head_dim};
}

// q . k over head_dim dimensions (a multiple of 8), q float32, k float16: lane l sums dimensions l, l + 8, ... in
// turn, then hsum. The prefill attentions' scores of a query's own block (both builds, the same bits).
inline float dot_float16(const float* q, const uint16_t* k, int64_t head_dim) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), CacheElem<kFloat16>::load8(k + d), acc);
  }
  return hsum(acc);
}

}  // namespace
