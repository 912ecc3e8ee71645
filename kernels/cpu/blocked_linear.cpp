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
// float32: W_blocked [N/16][K][16], x and y float32, FMAs on broadcast floats of x.
// bfloat16: W in pairs of k, [N/16][ceil(K/2)][16][2] (odd K padded with a zero column), the
// layout AVX512-BF16's dot product reads: one vdpbf16ps multiplies 16 columns by two k at once,
// accumulating in float32; x is repacked into pairs, y rounded to bf16 (nearest even) at the
// end. Faster than oneDNN's AMX kernel at 1-4 rows (26-28 vs 18-20 GB/s at 0.8B shapes), slower
// from 8-16 rows on, so callers keep oneDNN for more rows.
// Built at run time by blocked.py with the compiler's native flags; needs AVX-512F (and
// AVX512-BF16 for bfloat16; the loader checks and falls back otherwise).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_DISTANCE 32   // in k steps, i.e. 32 cache lines ahead in each W stream

static inline void store_bf16(uint16_t* y, __m512 v, __mmask16 mask) {
  // float32 -> bfloat16, round to nearest even (NaN is not expected from finite weights).
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// The float32 and bfloat16 forms of one k step, on one 64-byte vector of W per block:
// float32 holds 16 columns at one k, bfloat16 16 columns at two k.
struct F32 {
  using W = float;
  using X = float;
  static constexpr int K_PER_STEP = 1;
  static inline __m512 load(const float* p) { return _mm512_load_ps(p); }
  static inline __m512 fma(__m512 acc, X x, __m512 w) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
  static inline void store(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
  static inline X pack_x(const float* row, int K, int k) { return row[k]; }
};
#ifdef __AVX512BF16__
struct BF16 {
  using W = uint16_t;
  using X = uint32_t;                       // two bf16 of x: k (low half) and k+1
  static constexpr int K_PER_STEP = 2;
  static inline __m512 load(const uint16_t* p) { return _mm512_castsi512_ps(_mm512_load_si512((const void*)p)); }
  static inline __m512 fma(__m512 acc, X x, __m512 w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x), (__m512bh)_mm512_castps_si512(w));
  }
  static inline void store(uint16_t* y, __m512 v, __mmask16 mask) { store_bf16(y, v, mask); }
  static inline X pack_x(const uint16_t* row, int K, int k2) {
    uint32_t lo = row[2 * k2], hi = 2 * k2 + 1 < K ? row[2 * k2 + 1] : 0;
    return lo | (hi << 16);
  }
};
#endif

// One tile: rows [0, rows) of the 8-row panel xp ([steps][8]) against NR blocks of W starting
// at w ([NR][steps][64 bytes]); writes y rows (row stride N) from column n0, masking the end.
template <int MR, int NR, typename T>
static inline void tile(const typename T::X* xp, const typename T::W* w, int steps,
                        typename T::W* y, int N, int n0, int rows) {
  constexpr int LANE = 16 * T::K_PER_STEP;   // elements of W per block and step
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();
  for (int k = 0; k < steps; k++) {
    __m512 wv[NR];
    for (int j = 0; j < NR; j++) {
      const typename T::W* p = w + ((size_t)j * steps + k) * LANE;
      wv[j] = T::load(p);
      _mm_prefetch((const char*)(p + PREFETCH_DISTANCE * LANE), _MM_HINT_T0);
    }
    for (int r = 0; r < MR; r++) {
      const typename T::X xv = xp[(size_t)k * 8 + r];
      for (int j = 0; j < NR; j++) acc[r][j] = T::fma(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < MR && r < rows; r++)
    for (int j = 0; j < NR; j++) {
      int n = n0 + j * 16;
      if (n >= N) break;
      int left = N - n;
      __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      T::store(y + (size_t)r * N + n, acc[r][j], mask);
    }
}

template <int NR, typename T>
static inline void tile_rows(int rows, const typename T::X* xp, const typename T::W* w, int steps,
                             typename T::W* y, int N, int n0) {
  switch (rows) {
    case 1: tile<1, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 2: tile<2, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 3: tile<3, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 4: tile<4, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 5: tile<5, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 6: tile<6, NR, T>(xp, w, steps, y, N, n0, rows); break;
    case 7: tile<7, NR, T>(xp, w, steps, y, N, n0, rows); break;
    default: tile<8, NR, T>(xp, w, steps, y, N, n0, rows); break;
  }
}

template <typename T>
static void blocked_linear(const typename T::W* x, const typename T::W* w, typename T::W* y,
                           int M, int N, int K, int num_threads) {
  using X = typename T::X;
  const int steps = (K + T::K_PER_STEP - 1) / T::K_PER_STEP;
  const int panels = (M + 7) / 8;
  X* xp = (X*)aligned_alloc(64, ((size_t)panels * steps * 8 * sizeof(X) + 63) / 64 * 64);
  for (int p = 0; p < panels; p++)
    for (int k = 0; k < steps; k++)
      for (int r = 0; r < 8; r++) {
        int m = p * 8 + r;
        xp[((size_t)p * steps + k) * 8 + r] = m < M ? T::pack_x(x + (size_t)m * K, K, k) : X(0);
      }
  const int blocks = (N + 15) / 16;
  const int NR = M <= 2 ? 4 : (M <= 8 ? 2 : 3);
  const int groups = (blocks + NR - 1) / NR;
  constexpr int LANE = 16 * T::K_PER_STEP;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int g = 0; g < groups; g++) {
    const int b0 = g * NR;
    const int nb = blocks - b0 < NR ? blocks - b0 : NR;
    const typename T::W* wg = w + (size_t)b0 * steps * LANE;
    for (int p = 0; p < panels; p++) {
      const int rows = M - p * 8 < 8 ? M - p * 8 : 8;
      const X* xs = xp + (size_t)p * steps * 8;
      typename T::W* ys = y + (size_t)p * 8 * N;
      if (nb == 4) tile_rows<4, T>(rows, xs, wg, steps, ys, N, b0 * 16);
      else if (nb == 3) tile_rows<3, T>(rows, xs, wg, steps, ys, N, b0 * 16);
      else if (nb == 2) tile_rows<2, T>(rows, xs, wg, steps, ys, N, b0 * 16);
      else tile_rows<1, T>(rows, xs, wg, steps, ys, N, b0 * 16);
    }
  }
  free(xp);
}

extern "C" {
int blocked_linear_f32(const float* x, const float* w, float* y, int M, int N, int K, int threads) {
  blocked_linear<F32>(x, w, y, M, N, K, threads);
  return 0;
}
int blocked_linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K, int threads) {
#ifdef __AVX512BF16__
  blocked_linear<BF16>(x, w, y, M, N, K, threads);
  return 0;
#else
  return 1;                                 // not built for bf16: the caller never blocks bf16 here
#endif
}
int has_bf16(void) {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}
}
