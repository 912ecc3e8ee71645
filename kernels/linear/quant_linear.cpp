// y[M, N] = x[M, K] @ W^T for W quantized in groups along k: int8 or int4 values and one float16
// scale per column and group (W[n][k] = q[n][k] * scale[n][k / group]).
//
// Why this form: decode reads every weight once per token, so its speed is the weights' bytes
// (int8 half of bf16's, int4 a quarter) over the memory bandwidth, as long as the arithmetic keeps
// up. Each weight vector is widened in registers to float32 and multiplied by its group's scale,
// which gives W's exact dequantized value (a small integer times a float16 scale is exact in
// float32), and the float32 FMAs then run in k order as blocked_linear.cpp's float32 tiles do:
// the outputs equal the float32 blocked product on the dequantized weights bitwise, so a
// quantized model is checked against its dequantized float run exactly, and x stays float (no
// activation rounding). Whether integer dot products on x quantized per row are faster is for
// measurement (benchmarks/RESULTS.md, issue 39).
//
// Layouts (kernels/linear/quantized.py packs them), in 16-column blocks as the float kernels:
//   int8: q [N/16][K][16] int8, one 16-byte run per block and k;
//   int4: q [N/16][K/2][16] uint8, byte (k2, c) holding column c's k = 2 k2 in its low nibble
//         and k = 2 k2 + 1 in its high one, each stored as q + 8 (0..15);
//   scales [N/16][K/group][16] float16.
// group divides K (and is even for int4); N is a multiple of 16.
//
// Few rows (decode, MTP verify: up to REGISTER_ROWS) run register tiles that widen W as they go.
// More rows (prefill, big batches) widen each thread's group of blocks into a float32 buffer once
// per call and run blocked_tiles.h's float32 tiles over every panel of x on it, as the bf16
// widened form does (the widening is O(N K), the product O(M N K)): the same FMAs in the same
// order, so the same values as the register tiles.
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "linear/blocked_tiles.h"
#include "native/kernels.h"
#include "native/simd.h"

namespace {

#if defined(__AVX512F__)
inline simd::F widen_i8(const int8_t* p) {                 // 16 int8 -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline simd::I widen_u8(const uint8_t* p) {                // 16 uint8 -> 16 int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
inline simd::F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline simd::F low_nibble(simd::I b) {                     // b & 15, as floats
  return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
}
inline simd::F high_nibble(simd::I b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }   // b >> 4
#else
inline simd::F widen_i8(const int8_t* p) {                 // 8 int8 -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline simd::I widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline simd::F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline simd::F low_nibble(simd::I b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
inline simd::F high_nibble(simd::I b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
#endif

// The register form up to this many rows of x: one panel. AVX2's 16 registers hold the int4
// tile's accumulators, scales and widened pairs for at most 4 rows of one block.
constexpr int REGISTER_ROWS = simd::W == 16 ? 8 : 4;
constexpr int PREFETCH_BYTES = 1024;                       // ahead in each block's stream of q

// Blocks per register tile for M rows: the tile holds M x NR x VB accumulators and as many for
// the group in progress, NR x VB widened vectors of W (twice that for int4) and the broadcasts.
template <int BITS>
int quant_blocks_per_tile(int M) {
  if (simd::W == 16) return M <= 2 ? 4 : M <= 4 ? 2 : 1;
  return M == 1 && BITS == 8 ? 2 : 1;
}

// Bytes of q per block for K and BITS.
inline size_t block_bytes(int K, int BITS) { return (size_t)K * 16 * BITS / 8; }

// One register tile: rows [0, rows) of the panel xp ([K][PANEL] floats) times NR blocks of q
// (q: the first block's first byte, blocks qstride bytes apart) with their scales (sc: the first
// block's, blocks sstride halves apart) -> y rows (row stride N) from column n0. Each group of k
// sums x q in float32 on its own and is then scaled once (one FMA per group, not a multiply per
// weight: the product is bound by these ops at int4). int4 sums x (q + 8), the stored nibble, and
// takes 8 times the group's sum of x (xsum [rows][K / group]) off before scaling.
template <int MR, int NR, int BITS, typename T>
inline void quant_tile(const float* xp, const float* xsum, const uint8_t* q, size_t qstride, const uint16_t* sc,
                       size_t sstride, int K, int group, typename T::Y* y, int N, int n0, int rows) {
  simd::F acc[MR][NR * VB];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR * VB; j++) acc[r][j] = simd::zero();
  const int groups = K / group;
  for (int gi = 0; gi < groups; gi++) {
    const int g0 = gi * group;
    simd::F part[MR][NR * VB];
    for (int r = 0; r < MR; r++)
      for (int j = 0; j < NR * VB; j++) part[r][j] = simd::zero();
    if constexpr (BITS == 8) {
      for (int k = g0; k < g0 + group; k++) {
        simd::F w[NR * VB];
        for (int j = 0; j < NR; j++) {
          const int8_t* p = (const int8_t*)(q + j * qstride) + (size_t)k * 16;
          for (int v = 0; v < VB; v++) w[j * VB + v] = widen_i8(p + v * simd::W);
          if ((k & 3) == 0) _mm_prefetch((const char*)p + PREFETCH_BYTES, _MM_HINT_T0);
        }
        for (int r = 0; r < MR; r++) {
          const simd::F xb = simd::set1(xp[(size_t)k * PANEL + r]);
          for (int j = 0; j < NR * VB; j++) part[r][j] = simd::fmadd(xb, w[j], part[r][j]);
        }
      }
    } else {
      for (int k = g0; k < g0 + group; k += 2) {
        simd::F lo[NR * VB], hi[NR * VB];
        for (int j = 0; j < NR; j++) {
          const uint8_t* p = q + j * qstride + (size_t)(k / 2) * 16;
          for (int v = 0; v < VB; v++) {
            const simd::I b = widen_u8(p + v * simd::W);
            lo[j * VB + v] = low_nibble(b);
            hi[j * VB + v] = high_nibble(b);
          }
          if ((k & 7) == 0) _mm_prefetch((const char*)p + PREFETCH_BYTES, _MM_HINT_T0);
        }
        for (int r = 0; r < MR; r++) {
          const simd::F x0 = simd::set1(xp[(size_t)k * PANEL + r]), x1 = simd::set1(xp[(size_t)(k + 1) * PANEL + r]);
          for (int j = 0; j < NR * VB; j++) part[r][j] = simd::fmadd(x1, hi[j], simd::fmadd(x0, lo[j], part[r][j]));
        }
      }
    }
    for (int j = 0; j < NR; j++)
      for (int v = 0; v < VB; v++) {
        const simd::F s = load_f16(sc + j * sstride + (size_t)gi * 16 + v * simd::W);
        for (int r = 0; r < MR; r++) {
          simd::F p = part[r][j * VB + v];
          if constexpr (BITS == 4) p = simd::sub(p, simd::set1(8.0f * xsum[(size_t)r * groups + gi]));
          acc[r][j * VB + v] = simd::fmadd(p, s, acc[r][j * VB + v]);
        }
      }
  }
  for (int r = 0; r < MR && r < rows; r++)
    for (int j = 0; j < NR * VB; j++) T::store(y + (size_t)r * N + n0 + j * simd::W, acc[r][j]);
}

template <int NR, int BITS, typename T>
inline void quant_tile_rows(int rows, const float* xp, const float* xsum, const uint8_t* q, size_t qstride, const uint16_t* sc,
                            size_t sstride, int K, int group, typename T::Y* y, int N, int n0) {
  switch (rows) {
    case 1: return quant_tile<1, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
    case 2: return quant_tile<2, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
    case 3: return quant_tile<3, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
    case 4: return quant_tile<4, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
  }
  if constexpr (REGISTER_ROWS > 4) {
    switch (rows) {
      case 5: return quant_tile<5, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
      case 6: return quant_tile<6, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
      case 7: return quant_tile<7, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
    }
    quant_tile<REGISTER_ROWS, NR, BITS, T>(xp, xsum, q, qstride, sc, sstride, K, group, y, N, n0, rows);
  }
}

template <int BITS, typename T>
void quant_register_form(const typename T::Y* x, const uint8_t* q, const uint16_t* sc, typename T::Y* y, int M,
                         int N, int K, int group, int threads) {
  const Scratch xs(SCRATCH_X, panels_bytes<T>(M, K) + (size_t)M * (K / group) * sizeof(float));
  const float* xp = pack_panels<T>(x, M, K, K, xs);
  // each row's sum of x over each group (int4's offset), after the panel in the same buffer
  float* xsum = (float*)((char*)xs.as<char>() + panels_bytes<T>(M, K));
  if (BITS == 4)
    for (int r = 0; r < M; r++)
      for (int gi = 0; gi < K / group; gi++) {
        float sum = 0.0f;
        for (int k = gi * group; k < (gi + 1) * group; k++) sum += xp[(size_t)k * PANEL + r];
        xsum[(size_t)r * (K / group) + gi] = sum;
      }
  const int blocks = N / 16, NR = quant_blocks_per_tile<BITS>(M);
  const int groups = (blocks + NR - 1) / NR;
  const size_t qstride = block_bytes(K, BITS), sstride = (size_t)(K / group) * 16;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int g = 0; g < groups; g++) {
    const int b0 = g * NR, nb = blocks - b0 < NR ? blocks - b0 : NR;
    const uint8_t* qg = q + (size_t)b0 * qstride;
    const uint16_t* sg = sc + (size_t)b0 * sstride;
    if (nb == 4) quant_tile_rows<4, BITS, T>(M, xp, xsum, qg, qstride, sg, sstride, K, group, y, N, b0 * 16);
    else if (nb == 3) quant_tile_rows<3, BITS, T>(M, xp, xsum, qg, qstride, sg, sstride, K, group, y, N, b0 * 16);
    else if (nb == 2) quant_tile_rows<2, BITS, T>(M, xp, xsum, qg, qstride, sg, sstride, K, group, y, N, b0 * 16);
    else quant_tile_rows<1, BITS, T>(M, xp, xsum, qg, qstride, sg, sstride, K, group, y, N, b0 * 16);
  }
}

// nb blocks of q with their scales -> float32 [nb][K][16], each value q * scale exactly.
template <int BITS>
void dequantize_blocks(const uint8_t* q, const uint16_t* sc, float* out, int nb, int K, int group) {
  const size_t qstride = block_bytes(K, BITS), sstride = (size_t)(K / group) * 16;
  for (int j = 0; j < nb; j++) {
    const uint8_t* qb = q + j * qstride;
    float* ob = out + (size_t)j * K * 16;
    for (int g0 = 0, gi = 0; g0 < K; g0 += group, gi++) {
      simd::F s[VB];
      for (int v = 0; v < VB; v++) s[v] = load_f16(sc + j * sstride + (size_t)gi * 16 + v * simd::W);
      for (int k = g0; k < g0 + group; k += BITS == 8 ? 1 : 2)
        for (int v = 0; v < VB; v++) {
          if constexpr (BITS == 8) {
            simd::store(ob + (size_t)k * 16 + v * simd::W, simd::mul(widen_i8((const int8_t*)qb + (size_t)k * 16 + v * simd::W), s[v]));
          } else {
            const simd::I b = widen_u8(qb + (size_t)(k / 2) * 16 + v * simd::W);
            const simd::F eight = simd::set1(8.0f);       // the stored nibble is q + 8
            simd::store(ob + (size_t)k * 16 + v * simd::W, simd::mul(simd::sub(low_nibble(b), eight), s[v]));
            simd::store(ob + (size_t)(k + 1) * 16 + v * simd::W, simd::mul(simd::sub(high_nibble(b), eight), s[v]));
          }
        }
    }
  }
}

template <int BITS, typename T>
void quant_widened_form(const typename T::Y* x, const uint8_t* q, const uint16_t* sc, typename T::Y* y, int M, int N,
                        int K, int group, int threads) {
  const Scratch xs(SCRATCH_X, panels_bytes<T>(M, K));
  const float* xp = pack_panels<T>(x, M, K, K, xs);
  const int blocks = N / 16, NR = blocks_per_tile<T>(M);
  const int groups = (blocks + NR - 1) / NR;
  const size_t qstride = block_bytes(K, BITS), sstride = (size_t)(K / group) * 16;
#pragma omp parallel num_threads(threads)
  {
    float* wf = (float*)aligned_alloc(64, ((size_t)NR * K * 16 * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
      const int b0 = g * NR, nb = blocks - b0 < NR ? blocks - b0 : NR;
      dequantize_blocks<BITS>(q + (size_t)b0 * qstride, sc + (size_t)b0 * sstride, wf, nb, K, group);
      group_product<T>(nb, xp, wf, K, y, M, N, b0 * 16);
    }
    free(wf);
  }
}

template <typename T>
int quant_linear(const typename T::Y* x, const uint8_t* q, const uint16_t* sc, typename T::Y* y, int M, int N, int K,
                 int bits, int group, int threads) {
  if ((bits != 8 && bits != 4) || group < 2 || K % group || (bits == 4 && group % 2) || N % 16) return 1;
  if (M <= REGISTER_ROWS) {
    if (bits == 8) quant_register_form<8, T>(x, q, sc, y, M, N, K, group, threads);
    else quant_register_form<4, T>(x, q, sc, y, M, N, K, group, threads);
  } else {
    if (bits == 8) quant_widened_form<8, T>(x, q, sc, y, M, N, K, group, threads);
    else quant_widened_form<4, T>(x, q, sc, y, M, N, K, group, threads);
  }
  return 0;
}

}  // namespace

extern "C" {
int quant_linear_f32(const float* x, const uint8_t* q, const uint16_t* scales, float* y, int M, int N, int K, int bits,
                     int group, int threads) {
  return quant_linear<F32>(x, q, scales, y, M, N, K, bits, group, threads);
}
int quant_linear_bf16(const uint16_t* x, const uint8_t* q, const uint16_t* scales, uint16_t* y, int M, int N, int K,
                      int bits, int group, int threads) {
  return quant_linear<WidenedBF16>(x, q, scales, y, M, N, K, bits, group, threads);
}
}
