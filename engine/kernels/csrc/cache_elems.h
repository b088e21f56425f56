// The KV cache's element types, as the native kernels read and write them: float32, or 16-bit bfloat16 / float16
// values widened to float32 as they are loaded (and rounded to nearest, ties to even, as they are stored), so the
// attention's arithmetic is float32 whatever the cache holds. Shared by the float32 kernels (cpu_kernels.cpp) and the
// bf16 prefill (bf16_kernels.cpp), which read the same caches.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <type_traits>

#include "vector_math.h"

namespace {

// What the KV cache holds (CACHE_TYPES in engine/kernels/checks.py): float32, or 16-bit bfloat16 / float16 values
// widened to float32 as they are loaded, so the attention's arithmetic is float32 whatever the cache stores.
enum CacheType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// With AVX-512 (F and DQ) the decode attention holds two keys' (or two 8-dimension chunks') 8 lanes in one 512-bit
// register, each lane doing exactly what the AVX2 code's does (cpu_kernels.cpp, "score_tile512"): load8x2 loads two
// 8-element rows at once.
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SS_ATTENTION_512 1
// 8 16-bit elements at lo in the low half, 8 at hi in the high half.
inline __m256i pair128(const uint16_t* lo, const uint16_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}
#endif

template <int CT>
struct CacheElem;

template <>
struct CacheElem<kFloat32> {
  using T = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
#ifdef SS_ATTENTION_512
  static __m512 load8x2(const float* lo, const float* hi) {  // load8(lo) in lanes 0-7, load8(hi) in 8-15
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1);
  }
#endif
};

template <>
struct CacheElem<kBFloat16> {
  using T = uint16_t;
  static __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store8(uint16_t* p, __m256 x) { store_bf16x8(p, x); }  // torch's rounding
#ifdef SS_ATTENTION_512
  static __m512 load8x2(const uint16_t* lo, const uint16_t* hi) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pair128(lo, hi)), 16));
  }
#endif
};

template <>
struct CacheElem<kFloat16> {
  using T = uint16_t;
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
#ifdef SS_ATTENTION_512
  static __m512 load8x2(const uint16_t* lo, const uint16_t* hi) { return _mm512_cvtph_ps(pair128(lo, hi)); }
#endif
  static void store8(uint16_t* p, __m256 x) {  // rounded to nearest, ties to even, as torch rounds to float16
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

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
    default:
      f(std::integral_constant<int, kFloat32>{});
  }
}

// One token's new K and V (n floats each, n a multiple of 8) into the caches at element `offset`, as CT elements.
template <int CT>
void write_cache_row(void* k_cache, void* v_cache, int64_t offset, const float* k_new, const float* v_new,
                     int64_t n) {
  using T = typename CacheElem<CT>::T;
  T* k = static_cast<T*>(k_cache) + offset;
  T* v = static_cast<T*>(v_cache) + offset;
  for (int64_t i = 0; i < n; i += 8) {
    CacheElem<CT>::store8(k + i, _mm256_loadu_ps(k_new + i));
    CacheElem<CT>::store8(v + i, _mm256_loadu_ps(v_new + i));
  }
}

using WriteKVFn = void (*)(void*, void*, int64_t, const float*, const float*, int64_t);

}  // namespace
