// y[M, N] = x[M, K] @ W^T for a few rows of x, with W stored in 16-column blocks.
//
// Why: batch-1 and small-batch decode on a CPU is a stream of every weight once per step. In a
// blocked layout W_blocked[N/16][K][16] each thread reads one contiguous run of memory, and a
// 16-wide vector of W feeds the FMAs of every row of x at once, so 4-32 rows cost little more
// than one (MKL's GEMM at 4-16 rows streams at about half the rate of its GEMV). Software
// prefetch keeps a few KB of each stream in flight: without it the 16-row case ran at 60% of
// this speed.
//
// Register tiles: MR rows of x (broadcast one float at a time) times NR blocks of W (one
// 16-float vector each), MR * NR accumulators: 1x4 and 2x4 for one or two rows (four
// independent chains hide the FMA latency), up to 8x2, and 8x3 passes for more rows. x is first
// repacked into 8-row panels [ceil(M/8)][K][8] so a pass reads it contiguously.
//
// Weights are float32 or bfloat16 (widened to float32 by a 16-bit shift; accumulation is
// float32 either way); x and y have the weight's dtype. Built at run time by blocked.py
// with the compiler's native flags; needs AVX-512F (the loader checks and falls back otherwise).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_DISTANCE 32   // in k steps, i.e. 32 cache lines ahead in each W stream

static inline __m512 load_w(const float* p) { return _mm512_load_ps(p); }
static inline __m512 load_w(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline float to_float(float v) { return v; }
static inline float to_float(uint16_t v) {
  uint32_t bits = (uint32_t)v << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
static inline void store_row(uint16_t* y, __m512 v, __mmask16 mask) {
  // float32 -> bfloat16, round to nearest even (NaN is not expected from finite weights).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// One tile: rows [0, rows) of the 8-row panel xp ([K][8] floats) against NR blocks of W
// starting at w ([NR][K][16]); writes y rows (row stride N) from column n0, masking the end.
template <int MR, int NR, typename T>
static inline void tile(const float* xp, const T* w, int K, T* y, int N, int n0, int rows) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; k++) {
    __m512 wv[NR];
    for (int j = 0; j < NR; j++) {
      const T* p = w + ((size_t)j * K + k) * 16;
      wv[j] = load_w(p);
      _mm_prefetch((const char*)(p + PREFETCH_DISTANCE * 16), _MM_HINT_T0);
    }
    for (int r = 0; r < MR; r++) {
      __m512 xv = _mm512_set1_ps(xp[(size_t)k * 8 + r]);
      for (int j = 0; j < NR; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR && r < rows; r++)
    for (int j = 0; j < NR; j++) {
      int n = n0 + j * 16;
      if (n >= N) break;
      int left = N - n;
      __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      store_row(y + (size_t)r * N + n, acc[r][j], mask);
    }
}

template <int NR, typename T>
static inline void tile_rows(int rows, const float* xp, const T* w, int K, T* y, int N, int n0) {
  switch (rows) {
    case 1: tile<1, NR>(xp, w, K, y, N, n0, rows); break;
    case 2: tile<2, NR>(xp, w, K, y, N, n0, rows); break;
    case 3: tile<3, NR>(xp, w, K, y, N, n0, rows); break;
    case 4: tile<4, NR>(xp, w, K, y, N, n0, rows); break;
    case 5: tile<5, NR>(xp, w, K, y, N, n0, rows); break;
    case 6: tile<6, NR>(xp, w, K, y, N, n0, rows); break;
    case 7: tile<7, NR>(xp, w, K, y, N, n0, rows); break;
    default: tile<8, NR>(xp, w, K, y, N, n0, rows); break;
  }
}

template <typename T>
static void blocked_linear(const T* x, const T* w, T* y, int M, int N, int K, int num_threads) {
  const int panels = (M + 7) / 8;
  float* xp = (float*)aligned_alloc(64, ((size_t)panels * K * 8 * sizeof(float) + 63) / 64 * 64);
  for (int p = 0; p < panels; p++)
    for (int k = 0; k < K; k++)
      for (int r = 0; r < 8; r++) {
        int m = p * 8 + r;
        xp[((size_t)p * K + k) * 8 + r] = m < M ? to_float(x[(size_t)m * K + k]) : 0.0f;
      }
  const int blocks = (N + 15) / 16;
  const int NR = M <= 2 ? 4 : (M <= 8 ? 2 : 3);
  const int groups = (blocks + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int g = 0; g < groups; g++) {
    const int b0 = g * NR;
    const int nb = blocks - b0 < NR ? blocks - b0 : NR;
    const T* wg = w + (size_t)b0 * K * 16;
    for (int p = 0; p < panels; p++) {
      const int rows = M - p * 8 < 8 ? M - p * 8 : 8;
      const float* xs = xp + (size_t)p * K * 8;
      T* ys = y + (size_t)p * 8 * N;
      if (nb == 4) tile_rows<4>(rows, xs, wg, K, ys, N, b0 * 16);
      else if (nb == 3) tile_rows<3>(rows, xs, wg, K, ys, N, b0 * 16);
      else if (nb == 2) tile_rows<2>(rows, xs, wg, K, ys, N, b0 * 16);
      else tile_rows<1>(rows, xs, wg, K, ys, N, b0 * 16);
    }
  }
  free(xp);
}

extern "C" {
int blocked_linear_f32(const float* x, const float* w, float* y, int M, int N, int K, int threads) {
  blocked_linear<float>(x, w, y, M, N, K, threads);
  return 0;
}
int blocked_linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K, int threads) {
  blocked_linear<uint16_t>(x, w, y, M, N, K, threads);
  return 0;
}
}
