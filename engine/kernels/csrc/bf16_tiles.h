// bf16 products with one tiling for every row: y[rows, out] = x[rows, kp] W^T, x and W in bfloat16, every output
// summed in float32 in one fixed order that depends on nothing but the weight, so that a row gets the same bits
// alone or in a batch, in any chunk of its prompt, at any thread count (the contract of docs/architecture.md,
// "Batch invariance"). oneDNN chooses its kernels and blockings by shape and thread count, and on a CPU with AMX a
// row's bits followed its chunk; here the tiling is ours.
//
// **Layout.** A weight is panels of 16 outputs (engine/kernels/bf16_kernels.py packs it at load), each panel
// [kp / 2][16][2]: for every pair of inputs (2j, 2j + 1), the 16 outputs' two weights side by side (64 bytes). That is
// the operand of avx512_bf16's vdpbf16ps (a register of 16 pairs) and an AMX B tile (16 rows of pairs, 64 bytes
// each) alike. kp, the inputs, is padded with zeros to a multiple of 32 (an AMX tile row), and so are the
// activations' rows, which are bf16 [rows][ldx] with ldx >= kp.
//
// **Arithmetic.** Each ISA's micro-kernel (``Isa``) sums an output's products in order of the input pairs:
//  - kAvx512Bf16: vdpbf16ps, which adds a pair's odd product, then its even one, to the float32 sum, each rounded
//    (Intel's definition; Zen 4 matches it bit for bit: tests/test_bf16_kernels.py);
//  - kFma: the same two fused multiply-adds per pair on AVX2 (a bf16 product is exact in float32), so a CPU without
//    bf16 instructions gets the avx512_bf16 CPUs' bits (up to vdpbf16ps flushing denormals);
//  - kAmx: TDPBF16PS on AMX tiles, 32 inputs at a time (the hardware's own summation, which is not the other two's:
//    an AMX CPU gets its own bits, the same for every row of it);
//  - kAmxEmulated: kAmx's tiling, loops and padding, with the tiles emulated in scalar code (Intel's pseudo-code):
//    how a CPU without AMX tests the AMX path's structure.
// **Tiling.** Work items are (a group of panels, a tile of rows), the tile and group sizes fixed per ISA (a partial
// last tile is computed row by row alike, or padded with zero rows on AMX); every item sums over all kp inputs, so
// threads split items, never a sum. A row's output is a function of that row and the weight only.

#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "vector_math.h"

namespace bf16 {

constexpr int kPanel = 16;  // outputs per panel
constexpr int kKStep = 32;  // inputs per AMX tile row: kp and every activation row are padded to a multiple of it

enum Isa : int { kFma = 0, kAvx512Bf16 = 1, kAmx = 2, kAmxEmulated = 3 };  // BF16_ISAS in bf16_kernels.py

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One product: rows of activations x [rows][ldx] times panels [panels] of a weight (panel p at w + p * pstride),
// over the first kp inputs (a multiple of kKStep).
struct Operands {
  const uint16_t* x;
  int64_t ldx;
  int64_t rows;
  const uint16_t* w;
  int64_t pstride;
  int64_t panels;
  int64_t kp;
};

// A micro-kernel: c[rows][np * 16] (row stride ldc) = rows of x times np panels from w, over kp inputs.
using TileFn = void (*)(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pstride, int64_t kp, float* c,
                        int64_t ldc);

// ---- kFma: vdpbf16ps's arithmetic on AVX2 -------------------------------------------------------------------------

template <int R, int NP>
__attribute__((target("avx2,fma"))) void fma_tile(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                  int64_t pstride, int64_t kp, float* c, int64_t ldc) {
  __m256 acc[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j = 0; j < kp / 2; ++j) {
    __m256 even[NP][2], odd[NP][2];  // 8 outputs' weights of the pair's even and odd input, per half panel
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * pstride + j * 32 + h * 16));
        even[p][h] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        odd[p][h] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      memcpy(&pair, x + r * ldx + 2 * j, 4);
      const __m256 xe = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair << 16)));
      const __m256 xo = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(pair & 0xffff0000u)));
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          acc[r][p][h] = _mm256_fmadd_ps(xo, odd[p][h], acc[r][p][h]);  // odd first, as vdpbf16ps
          acc[r][p][h] = _mm256_fmadd_ps(xe, even[p][h], acc[r][p][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(c + r * ldc + p * kPanel + h * 8, acc[r][p][h]);
}

// ---- kAvx512Bf16: vdpbf16ps, 6 rows x 4 panels of accumulators ----------------------------------------------------

template <int R, int NP>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void avx512_tile(const uint16_t* x, int64_t ldx,
                                                                        const uint16_t* w, int64_t pstride,
                                                                        int64_t kp, float* c, int64_t ldc) {
  __m512 acc[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kp / 2; ++j) {
    __m512bh wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(w + p * pstride + j * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      memcpy(&pair, x + r * ldx + 2 * j, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], wv[p], xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + r * ldc + p * kPanel, acc[r][p]);
}

// ---- kAmx and kAmxEmulated: 32 rows x 2 panels in four 16 x 16 float32 tiles --------------------------------------

// The tile configuration both use: palette 1, all eight tiles 16 rows of 64 bytes (tiles 0-3: C, 4-5: A, 6-7: B).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The hardware's tiles. GCC's tile intrinsics take a tile's number as a literal (it is pasted into the
// instruction's text), hence one branch per tile that amx_tile uses.
#define SS_TILE_CASES(op) \
  if constexpr (T == 0) op(0); else if constexpr (T == 1) op(1); else if constexpr (T == 2) op(2); \
  else if constexpr (T == 3) op(3); else if constexpr (T == 4) op(4); else if constexpr (T == 5) op(5); \
  else if constexpr (T == 6) op(6); else op(7)

struct AmxTiles {
  __attribute__((target("amx-tile"))) static void configure() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  __attribute__((target("amx-tile"))) static void release() { _tile_release(); }
  template <int T>
  __attribute__((target("amx-tile"), always_inline)) static inline void zero() {
#define SS_ZERO(t) _tile_zero(t)
    SS_TILE_CASES(SS_ZERO);
#undef SS_ZERO
  }
  template <int T>
  __attribute__((target("amx-tile"), always_inline)) static inline void load(const void* p, int64_t stride) {
#define SS_LOAD(t) _tile_loadd(t, p, stride)
    SS_TILE_CASES(SS_LOAD);
#undef SS_LOAD
  }
  template <int T>
  __attribute__((target("amx-tile"), always_inline)) static inline void store(void* p, int64_t stride) {
#define SS_STORE(t) _tile_stored(t, p, stride)
    SS_TILE_CASES(SS_STORE);
#undef SS_STORE
  }
  template <int C, int A, int B>  // the four products amx_tile makes
  __attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void dot() {
    static_assert((C == 0 || C == 1 || C == 2 || C == 3) && A == 4 + C % 2 && B == 6 + C / 2, "an unused product");
    if constexpr (C == 0) {
      _tile_dpbf16ps(0, 4, 6);
    } else if constexpr (C == 1) {
      _tile_dpbf16ps(1, 5, 6);
    } else if constexpr (C == 2) {
      _tile_dpbf16ps(2, 4, 7);
    } else {
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};
#undef SS_TILE_CASES

struct EmulatedTiles {  // Intel's pseudo-code for the same instructions, on this thread's eight tiles
  static inline thread_local uint8_t tiles[8][16][64];
  static void configure() {}
  static void release() {}
  template <int T>
  static void zero() {
    memset(tiles[T], 0, sizeof(tiles[T]));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(tiles[T][r], static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) memcpy(static_cast<uint8_t*>(p) + r * stride, tiles[T][r], 64);
  }
  template <int C, int A, int B>
  static void dot() {  // TDPBF16PS: C[m][n] += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1], k = 0..15
    for (int m = 0; m < 16; ++m) {
      float* c = reinterpret_cast<float*>(tiles[C][m]);
      const uint16_t* a = reinterpret_cast<const uint16_t*>(tiles[A][m]);
      for (int k = 0; k < 16; ++k) {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(tiles[B][k]);
        for (int n = 0; n < 16; ++n) {
          c[n] = fmaf(bf16_to_float(a[2 * k]), bf16_to_float(b[2 * n]), c[n]);
          c[n] = fmaf(bf16_to_float(a[2 * k + 1]), bf16_to_float(b[2 * n + 1]), c[n]);
        }
      }
    }
  }
};

constexpr int kAmxRows = 32;

// c[32][np * 16] = 32 rows of x (all readable) times np (1 or 2) panels, kp inputs, 32 at a time.
template <class Tiles, int NP>
__attribute__((target("amx-tile,amx-bf16"))) void amx_tile(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                                           int64_t pstride, int64_t kp, float* c, int64_t ldc) {
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  if constexpr (NP == 2) {
    Tiles::template zero<2>();
    Tiles::template zero<3>();
  }
  const int64_t row_bytes = ldx * 2;
  for (int64_t k = 0; k < kp; k += kKStep) {
    Tiles::template load<4>(x + k, row_bytes);             // rows 0-15, inputs k .. k + 31
    Tiles::template load<5>(x + 16 * ldx + k, row_bytes);  // rows 16-31
    Tiles::template load<6>(w + k * kPanel, 64);           // the panel's pairs k / 2 .. k / 2 + 15
    Tiles::template dot<0, 4, 6>();
    Tiles::template dot<1, 5, 6>();
    if constexpr (NP == 2) {
      Tiles::template load<7>(w + pstride + k * kPanel, 64);
      Tiles::template dot<2, 4, 7>();
      Tiles::template dot<3, 5, 7>();
    }
  }
  const int64_t c_bytes = ldc * 4;
  Tiles::template store<0>(c, c_bytes);
  Tiles::template store<1>(c + 16 * ldc, c_bytes);
  if constexpr (NP == 2) {
    Tiles::template store<2>(c + kPanel, c_bytes);
    Tiles::template store<3>(c + 16 * ldc + kPanel, c_bytes);
  }
}

// ---- the tiling -----------------------------------------------------------------------------------------------------

// An ISA's tile: rows x panels, and its micro-kernels by (rows, panels) (AMX: by panels; rows always 32).
struct Geometry {
  int rows;
  int panels;
};

inline Geometry geometry(Isa isa) {
  switch (isa) {
    case kAvx512Bf16:
      return {6, 4};
    case kAmx:
    case kAmxEmulated:
      return {kAmxRows, 2};
    default:
      return {2, 2};
  }
}

constexpr TileFn kFmaTiles[2][2] = {{fma_tile<1, 1>, fma_tile<1, 2>}, {fma_tile<2, 1>, fma_tile<2, 2>}};
constexpr TileFn kAvx512Tiles[6][4] = {
    {avx512_tile<1, 1>, avx512_tile<1, 2>, avx512_tile<1, 3>, avx512_tile<1, 4>},
    {avx512_tile<2, 1>, avx512_tile<2, 2>, avx512_tile<2, 3>, avx512_tile<2, 4>},
    {avx512_tile<3, 1>, avx512_tile<3, 2>, avx512_tile<3, 3>, avx512_tile<3, 4>},
    {avx512_tile<4, 1>, avx512_tile<4, 2>, avx512_tile<4, 3>, avx512_tile<4, 4>},
    {avx512_tile<5, 1>, avx512_tile<5, 2>, avx512_tile<5, 3>, avx512_tile<5, 4>},
    {avx512_tile<6, 1>, avx512_tile<6, 2>, avx512_tile<6, 3>, avx512_tile<6, 4>},
};
constexpr TileFn kAmxTiles[2] = {amx_tile<AmxTiles, 1>, amx_tile<AmxTiles, 2>};
constexpr TileFn kAmxEmulatedTiles[2] = {amx_tile<EmulatedTiles, 1>, amx_tile<EmulatedTiles, 2>};

// Whether this process may use AMX tiles: Linux hands them out on request (arch_prctl), once per process.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

// Whether `isa` runs on this CPU (and, for AMX, this process has its tiles).
inline bool isa_ready(int isa) {
  switch (isa) {
    case kFma:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512Bf16:
      return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
    case kAmx:
      return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") && amx_permitted();
    case kAmxEmulated:
      return true;
    default:
      return false;
  }
}

// Items [first, last) of a product (item i: group i / row_tiles of panels, tile i % row_tiles of rows) on the calling
// thread; `epilogue(r0, rows, p0, np, c, ldc)` receives each item's float32 sums c[rows][np * 16].
template <class Epilogue>
void product_items(Isa isa, const Operands& op, int64_t first, int64_t last, const Epilogue& epilogue) {
  const Geometry g = geometry(isa);
  const int64_t row_tiles = (op.rows + g.rows - 1) / g.rows;
  const bool amx = isa == kAmx || isa == kAmxEmulated;
  const int64_t ldc = g.panels * kPanel;
  alignas(64) float c[kAmxRows * 2 * kPanel];
  std::vector<uint16_t> padded;  // AMX: a partial last tile's rows, padded with zero rows
  if (amx) isa == kAmx ? AmxTiles::configure() : EmulatedTiles::configure();
  for (int64_t item = first; item < last; ++item) {
    const int64_t p0 = item / row_tiles * g.panels, r0 = item % row_tiles * g.rows;
    const int np = static_cast<int>(std::min<int64_t>(g.panels, op.panels - p0));
    const int rows = static_cast<int>(std::min<int64_t>(g.rows, op.rows - r0));
    const uint16_t* x = op.x + r0 * op.ldx;
    const uint16_t* w = op.w + p0 * op.pstride;
    if (amx) {
      int64_t ldx = op.ldx;
      if (rows < kAmxRows) {
        padded.assign(kAmxRows * op.kp, 0);
        for (int r = 0; r < rows; ++r) memcpy(padded.data() + r * op.kp, x + r * op.ldx, op.kp * 2);
        x = padded.data();
        ldx = op.kp;
      }
      (isa == kAmx ? kAmxTiles : kAmxEmulatedTiles)[np - 1](x, ldx, w, op.pstride, op.kp, c, ldc);
    } else if (isa == kAvx512Bf16) {
      kAvx512Tiles[rows - 1][np - 1](x, op.ldx, w, op.pstride, op.kp, c, ldc);
    } else {
      kFmaTiles[rows - 1][np - 1](x, op.ldx, w, op.pstride, op.kp, c, ldc);
    }
    epilogue(r0, rows, p0, np, c, ldc);
  }
  if (amx) isa == kAmx ? AmxTiles::release() : EmulatedTiles::release();
}

inline int64_t product_item_count(Isa isa, const Operands& op) {
  const Geometry g = geometry(isa);
  return (op.panels + g.panels - 1) / g.panels * ((op.rows + g.rows - 1) / g.rows);
}

// The whole product on `threads` threads, each taking a contiguous run of items (a group's row tiles share its
// panels in cache).
template <class Epilogue>
void product(Isa isa, const Operands& op, const Epilogue& epilogue, int threads) {
  const int64_t items = product_item_count(isa, op);
  if (items == 0) return;
  const int team = static_cast<int>(std::min<int64_t>(threads, items));
#pragma omp parallel num_threads(team)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    product_items(isa, op, items * t / n, items * (t + 1) / n, epilogue);
  }
}

}  // namespace bf16
