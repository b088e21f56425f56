// Float32 vector math on AVX2 vectors, in one fixed order whatever the build's vector width (so that every build
// gets the same bits): horizontal sums and maxima, e^x, a softmax's exponentials, a norm's sum of squares; and the
// conversions between float32 and bfloat16 (torch's rounding). Shared by the float32 kernels (cpu_kernels.cpp), the
// KV cache's element types (cache_elems.h) and the bf16 prefill (bf16_tiles.h, bf16_kernels.cpp).
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace {

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// x[0]^2 + ... + x[n-1]^2 in one fixed order whatever vector width the build targets: sixteen lanes (two 8-lane
// halves), added half to half, then across. An `omp simd` reduction summed in 16 lanes under AVX-512 and 8 under
// AVX2, so the two builds' norms differed in the last bits; this is the AVX-512 build's order, for both.
inline float sum_of_squares(const float* x, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  float sum = hsum(_mm256_add_ps(lo, hi));
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
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

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Rounded to nearest, ties to even, as torch rounds to bfloat16; a NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Eight floats rounded to bf16 (float_to_bf16's rounding) and stored.
inline void store_bf16x8(uint16_t* p, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..r3 twice | r4..r7 twice
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

}  // namespace
