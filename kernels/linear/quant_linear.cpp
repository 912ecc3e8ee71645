// y[M, N] = x[M, K] @ W^T for W quantized in groups along k: int8 or int4 values and one float16
// scale per column and group (W[n][k] = q[n][k] * scale[n][k / group]), or for asymmetric
// formats a zero point per column and group as well (W[n][k] = (q[n][k] - zero[n][k / group]) *
// scale[n][k / group]), with x quantized per row in blocks of 32 k to int8 (llama.cpp's Q8_0
// rule for activations: scale max|x| / 127, values rounded to nearest even) and the products
// summed as integers.
//
// Why integer dot products: decode reads every weight once per token, so it runs at the weights'
// bytes over the memory bandwidth only while the arithmetic keeps up, and widening each weight
// to float32 for an FMA did not (measured at 0.8B shapes, AVX-512: int8 at 0.7x bf16's time
// instead of 0.5x, int4 at 0.6x instead of 0.25x; benchmarks/RESULTS.md, issue 39). One
// AVX512-VNNI vpdpbusd multiplies and sums 64 weight bytes against x; AVX2 and plain AVX-512 do
// the same in two (vpmaddubsw, vpmaddwd). The price is x's rounding to 8 bits per 32 values,
// which llama.cpp's quantized products pay too; the torch reference (kernels/linear/quantized.py
// `quant_linear_reference(..., int8_activations=True)`) rounds x the same way and takes the same
// float steps: each output is, per block of x, an exact integer sum times the weights' and x's
// scales, added in block order; the same bits as the reference, whichever batch the row is in.
//
// Layout (kernels/linear/quantized.py packs it): one stream of bytes per block of 16 columns,
// [N/16][block_bytes], in units of two groups: the units' 64 bytes of float16 scales ([2][16]:
// both groups' 16 columns), then the two groups' codes. The codes have 4 consecutive k of one
// column in each 32-bit lane, as vpdpbusd reads them:
//   int8: [group/4][16][4] uint8 a group, each value q + 128;
//   int4: [group/8][16][4] uint8 a group, lane byte j holding k = 8 s + j in its low nibble and
//         k = 8 s + 4 + j in its high one, each q + 8.
// An odd last group makes a unit of its own (its scales' second half unused). Why the scales sit
// inside the codes' stream: held apart (a short stream of scales beside each block's codes) they
// cost an AVX-512 decode more than their share of the bytes (benchmarks/RESULTS.md, issue 39).
//   zeros [N/16][K/group][16] int8 (asymmetric weights only, a tensor of their own), each z less
//         the same middle (128 or 8) as q, so that q - z is the code's own difference.
// group and K are multiples of 32; N is a multiple of 16.
//
// Sums: vpdpbusd takes one operand unsigned, so the weights are stored with their offset (128 or
// 8) and the sum of a block of x times the offset is taken off afterwards. Without VNNI,
// vpmaddubsw's 16-bit pair sums would overflow on 255 x 127: int8 there multiplies the signed
// weight (offset removed) by x's sign and |x| (at most 2 x 127 x 127, which fits), int4's 15 x 127
// fits as it is.
//
// Zero points: sum (q - z) x over a block is sum q x - z sumx, so the zero-point forms subtract
// each column's (offset + z) times the block's sum of x where the symmetric ones subtract the
// constant offset times it: one vector multiply per block and column vector, in the epilogue;
// the sums are the same exact integers, so the float steps and the reference's bits are too.
// Asymmetric int8 values reach -128, which the symmetric forms without VNNI cannot negate: the
// zero-point forms give x the weight's sign instead and read |w| (128 too) unsigned (at most
// 2 x 128 x 127, which fits); symmetric int8 weights holding -128 are loaded with zero points 0
// for that reason (QuantizedLinearMethod.load_quantized). The symmetric forms are a template of
// their own (ZP = false), so zero points cost them nothing.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "linear/blocked_tiles.h"
#include "linear/quant_layout.h"
#include "native/kernels.h"
#include "native/simd.h"
#include "native/stealing_ranges.h"

namespace {

constexpr int QK = 32;                 // k per block of x: one scale of x each

#if defined(__AVX512F__)
inline simd::I set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline simd::I zero_i() { return _mm512_setzero_si512(); }
inline simd::I add_i32(simd::I a, simd::I b) { return _mm512_add_epi32(a, b); }
inline simd::I sub_i32(simd::I a, simd::I b) { return _mm512_sub_epi32(a, b); }
inline simd::I and_i(simd::I a, simd::I b) { return _mm512_and_si512(a, b); }
inline simd::I xor_i(simd::I a, simd::I b) { return _mm512_xor_si512(a, b); }
inline simd::I srli16(simd::I a, int n) { return _mm512_srli_epi16(a, n); }
inline simd::I mullo_i32(simd::I a, simd::I b) { return _mm512_mullo_epi32(a, b); }
inline simd::I load_i8_as_i32(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline simd::F to_float(simd::I a) { return _mm512_cvtepi32_ps(a); }
inline simd::F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline simd::I maddubs(simd::I a_u8, simd::I b_s8) { return _mm512_maddubs_epi16(a_u8, b_s8); }  // pairs, int16
inline simd::I add_i16(simd::I a, simd::I b) { return _mm512_add_epi16(a, b); }
inline simd::I widen_pairs(simd::I a_i16) { return _mm512_madd_epi16(a_i16, _mm512_set1_epi16(1)); }
inline simd::I madd_pairs(simd::I a_u8, simd::I b_s8) {       // 4 products of a lane summed, int32
  return widen_pairs(maddubs(a_u8, b_s8));
}
inline simd::I abs8(simd::I a) { return _mm512_abs_epi8(a); }
inline simd::I sign8(simd::I w, simd::I x) {                  // w where x > 0, -w where x < 0, 0 at 0
  const __mmask64 neg = _mm512_movepi8_mask(x), zero = _mm512_cmpeq_epi8_mask(x, _mm512_setzero_si512());
  return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(w, neg, _mm512_setzero_si512(), w));
}
#else
inline simd::I set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline simd::I zero_i() { return _mm256_setzero_si256(); }
inline simd::I add_i32(simd::I a, simd::I b) { return _mm256_add_epi32(a, b); }
inline simd::I sub_i32(simd::I a, simd::I b) { return _mm256_sub_epi32(a, b); }
inline simd::I and_i(simd::I a, simd::I b) { return _mm256_and_si256(a, b); }
inline simd::I xor_i(simd::I a, simd::I b) { return _mm256_xor_si256(a, b); }
inline simd::I srli16(simd::I a, int n) { return _mm256_srli_epi16(a, n); }
inline simd::I mullo_i32(simd::I a, simd::I b) { return _mm256_mullo_epi32(a, b); }
inline simd::I load_i8_as_i32(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline simd::F to_float(simd::I a) { return _mm256_cvtepi32_ps(a); }
inline simd::F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline simd::I maddubs(simd::I a_u8, simd::I b_s8) { return _mm256_maddubs_epi16(a_u8, b_s8); }
inline simd::I add_i16(simd::I a, simd::I b) { return _mm256_add_epi16(a, b); }
inline simd::I widen_pairs(simd::I a_i16) { return _mm256_madd_epi16(a_i16, _mm256_set1_epi16(1)); }
inline simd::I madd_pairs(simd::I a_u8, simd::I b_s8) {
  return widen_pairs(maddubs(a_u8, b_s8));
}
inline simd::I abs8(simd::I a) { return _mm256_abs_epi8(a); }
inline simd::I sign8(simd::I w, simd::I x) { return _mm256_sign_epi8(w, x); }
#endif

#if defined(__AVX512VNNI__)
constexpr bool VNNI = true;
inline simd::I dot_u8s8(simd::I acc, simd::I a_u8, simd::I b_s8) { return _mm512_dpbusd_epi32(acc, a_u8, b_s8); }
#else
constexpr bool VNNI = false;
inline simd::I dot_u8s8(simd::I acc, simd::I a_u8, simd::I b_s8) { return add_i32(acc, madd_pairs(a_u8, b_s8)); }
#endif

// Rows of x per tile, and blocks of W per tile for a panel of `rows` rows: the tile holds
// MR x NR x VB int32 sums, NR x VB weight vectors (twice that for int4) and the broadcasts of x
// within the level's registers; its float32 accumulators (as many as the sums), touched once a
// block, may live in memory (at AVX2 they do).
constexpr int QMR = 4;
inline int quant_blocks_per_tile(int rows) { return simd::W == 16 ? (rows <= 2 ? 4 : 2) : 1; }
constexpr int PREFETCH_BYTES = 2048;    // ahead in each block's stream of q (PREFETCH_HINT: into L2)

// What to prefetch at `offset` bytes into a block's stream `p` of a tile of NR blocks, qstride
// bytes each: PREFETCH_BYTES ahead, or past the stream's end as far into the same block of the
// next group of NR blocks (within a thread's run of groups its next tile), whose streams
// would otherwise start cold: at 1,024 input columns a stream is only 16 KB (int8) or 8 KB
// (int4), so each tile would start on a few cold lines (benchmarks/RESULTS.md, issue 39).
template <int NR>
inline const char* prefetch_at(const uint8_t* p, size_t offset, size_t qstride) {
  return (const char*)p + PREFETCH_BYTES + (offset + PREFETCH_BYTES >= qstride ? (NR - 1) * qstride : 0);
}

using quant_layout::block_bytes;
using quant_layout::SCALE_BYTES;
using quant_layout::STEP_BYTES;

// The offset the tiles' integer sums carry per unit of x: int4's nibbles hold q + 8, int8's bytes
// q + 128, which vpdpbusd reads as they are and the tiles without VNNI flip back to signed first.
constexpr int sum_offset(int bits) { return bits == 4 ? 8 : (VNNI ? 128 : 0); }

// x quantized: per row, K int8 values (qx), and per block of QK its scale (sx) and the sum of
// its values (sumx), times the weights' offset for the symmetric forms (what comes off each
// block's sum, multiplied once here rather than per tile) and as it is for the zero-point forms
// (which multiply it by each column's offset and zero point).
struct QuantizedX {
  const int8_t* qx;
  const float* sx;
  const int32_t* sumx;
};

// Q8_0 on x: scale max|x| / 127, values round(x * (127 / max|x|)) to nearest even, as the torch
// reference computes them in float32 (kernels/linear/quantized.py quantize_activations): one
// block of QK values in QK / W vectors (the conversion rounds to nearest even under the default
// MXCSR, as nearbyintf does; |x| * (127 / max|x|) never rounds past 127).
inline simd::F load_x(const float* p) { return simd::load(p); }
inline simd::F load_x(const uint16_t* p) { return simd::load_bf16(p); }

#if defined(__AVX512F__)
inline simd::I round_to_i32(simd::F v) { return _mm512_cvtps_epi32(v); }
inline void store_i8(int8_t* p, const simd::I* v) {          // QK / W = 2 vectors
  _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(v[0]));
  _mm_storeu_si128((__m128i*)(p + 16), _mm512_cvtsepi32_epi8(v[1]));
}
inline int32_t reduce_add_i32(simd::I v) { return _mm512_reduce_add_epi32(v); }
inline float reduce_max(simd::F v) { return _mm512_reduce_max_ps(v); }
#else
inline simd::I round_to_i32(simd::F v) { return _mm256_cvtps_epi32(v); }
inline void store_i8(int8_t* p, const simd::I* v) {          // QK / W = 4 vectors
  // the packs interleave 128-bit lanes: 4-value groups a0 b0 c0 d0 a1 b1 c1 d1 -> a0 a1 b0 b1 ...
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i*)p, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
inline int32_t reduce_add_i32(simd::I v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
inline float reduce_max(simd::F v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
#endif

constexpr int QUANTIZE_X_PARALLEL_ROWS = 16;

template <typename XIn>
static void quantize_x(const XIn* x, int M, int K, int8_t* qx, float* sx, int32_t* sumx, int32_t sum_scale,
                       int threads) {
  static_assert(QK % simd::W == 0);
  constexpr int V = QK / simd::W;
  const int blocks = K / QK;
  // rows apart on the product's threads where there are many (a prefill's rounding on one thread
  // left the other idle: benchmarks/RESULTS.md, issue 39); decode's few rows stay on this one
  // (a fork costs more there)
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= QUANTIZE_X_PARALLEL_ROWS)
  for (int m = 0; m < M; m++)
    for (int b = 0; b < blocks; b++) {
      const size_t base = (size_t)m * K + (size_t)b * QK;
      simd::F v[V], amaxv = simd::zero();
      for (int i = 0; i < V; i++) {
        v[i] = load_x(x + base + i * simd::W);
        amaxv = simd::max(amaxv, simd::max(v[i], simd::sub(simd::zero(), v[i])));   // |x| (0 for -0)
      }
      const float amax = reduce_max(amaxv);
      const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
      simd::I q[V], sum = zero_i();
      for (int i = 0; i < V; i++) {
        q[i] = round_to_i32(simd::mul(v[i], simd::set1(inverse)));
        sum = add_i32(sum, q[i]);
      }
      store_i8(qx + base, q);
      sx[(size_t)m * blocks + b] = amax / 127.0f;
      sumx[(size_t)m * blocks + b] = sum_scale * reduce_add_i32(sum);
    }
}

// One tile: MR rows of quantized x (from row m0) times NR blocks of W (q: the first block's
// stream, blocks qstride bytes apart) and, with ZP, their zero points (zp, blocks zstride bytes
// apart) -> y rows m0.. (row stride N) from column n0.
//
// Without VNNI each running sum is made opaque after its add (simd::opaque): GCC otherwise turns
// the sums of a block's unrolled steps into trees of temporaries (integer adds reassociate),
// which at AVX2's 16 registers spill to the stack, a large share of a prefill's product
// (benchmarks/RESULTS.md, issue 39).
template <int MR, int NR, int BITS, bool ZP, typename Y, typename Store>
static inline void quant_tile(const QuantizedX& x, int m0, int K, const uint8_t* q, size_t qstride,
                              const int8_t* zp, size_t zstride, int group, Y* y, int N, int n0, Store store) {
  constexpr int LANE_BYTES = STEP_BYTES / VB;   // bytes of one weight vector: 16 / VB columns x 4 bytes
  const int blocks = K / QK;
  simd::F acc[MR][NR * VB];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR * VB; j++) acc[r][j] = simd::zero();
  const simd::I low4 = set1_i32(0x0F0F0F0F), flip = set1_i32((int32_t)0x80808080);
  // where the block's codes, its unit and its group's scales lie in each block's stream, advanced
  // block by block (a division per block cost a prefill at AVX2 a quarter of its time)
  const int blocks_per_group = group / QK;
  size_t unit = 0, codes = SCALE_BYTES;
  int gi = 0, in_group = 0;
  for (int b = 0; b < blocks; b++) {
    simd::I sums[MR][NR * VB];
    for (int r = 0; r < MR; r++)
      for (int j = 0; j < NR * VB; j++) sums[r][j] = zero_i();
    const int8_t* xb[MR];
    for (int r = 0; r < MR; r++) xb[r] = x.qx + (size_t)(m0 + r) * K + (size_t)b * QK;
    const size_t scales = unit + (gi % 2) * (SCALE_BYTES / 2);
    if constexpr (BITS == 8) {
      for (int s = 0; s < QK / 4; s++) {           // 4 k a step
        simd::I w[NR * VB];
        for (int j = 0; j < NR; j++) {
          const uint8_t* p = q + j * qstride + codes + s * STEP_BYTES;
          for (int v = 0; v < VB; v++) w[j * VB + v] = simd::load_bits(p + v * LANE_BYTES);
          _mm_prefetch(prefetch_at<NR>(p, codes + s * STEP_BYTES, qstride), PREFETCH_HINT);
        }
        for (int r = 0; r < MR; r++) {
          int32_t four;
          memcpy(&four, xb[r] + 4 * s, 4);
          const simd::I xv = set1_i32(four);
          if constexpr (VNNI) {
            for (int j = 0; j < NR * VB; j++) sums[r][j] = dot_u8s8(sums[r][j], w[j], xv);
          } else if constexpr (ZP) {
            // asymmetric weights reach -128, whose negation does not fit a byte: x takes the
            // weight's sign instead, and |w| (128 read unsigned) the place of |x|
            for (int j = 0; j < NR * VB; j++) {
              const simd::I sw = xor_i(w[j], flip);
              sums[r][j] = add_i32(sums[r][j], madd_pairs(abs8(sw), sign8(xv, sw)));
              simd::opaque(sums[r][j]);
            }
          } else {
            const simd::I ax = abs8(xv);
            for (int j = 0; j < NR * VB; j++) {
              sums[r][j] = add_i32(sums[r][j], madd_pairs(ax, sign8(xor_i(w[j], flip), xv)));
              simd::opaque(sums[r][j]);
            }
          }
        }
      }
    } else {
      // Without VNNI, int4's pair sums (vpmaddubsw: at most 2 x 15 x 127 = 3,810) are added in
      // 16 bits over the whole block (8 of them: 30,480, which fits), then widened once: a
      // third fewer instructions a step than widening each. The sums are the same integers.
      simd::I pairs[MR][NR * VB];
      if constexpr (!VNNI)
        for (int r = 0; r < MR; r++)
          for (int j = 0; j < NR * VB; j++) pairs[r][j] = zero_i();
      for (int s = 0; s < QK / 8; s++) {           // 8 k a step: low nibbles k 0-3, high k 4-7
        simd::I lo[NR * VB], hi[NR * VB];
        for (int j = 0; j < NR; j++) {
          const uint8_t* p = q + j * qstride + codes + s * STEP_BYTES;
          for (int v = 0; v < VB; v++) {
            const simd::I packed = simd::load_bits(p + v * LANE_BYTES);
            lo[j * VB + v] = and_i(packed, low4);
            hi[j * VB + v] = and_i(srli16(packed, 4), low4);
          }
          _mm_prefetch(prefetch_at<NR>(p, codes + s * STEP_BYTES, qstride), PREFETCH_HINT);
        }
        for (int r = 0; r < MR; r++) {
          int32_t four_lo, four_hi;
          memcpy(&four_lo, xb[r] + 8 * s, 4);
          memcpy(&four_hi, xb[r] + 8 * s + 4, 4);
          const simd::I xl = set1_i32(four_lo), xh = set1_i32(four_hi);
          for (int j = 0; j < NR * VB; j++) {
            if constexpr (VNNI) sums[r][j] = dot_u8s8(dot_u8s8(sums[r][j], lo[j], xl), hi[j], xh);
            else {
              pairs[r][j] = add_i16(pairs[r][j], add_i16(maddubs(lo[j], xl), maddubs(hi[j], xh)));
              simd::opaque(pairs[r][j]);
            }
          }
        }
      }
      if constexpr (!VNNI)
        for (int r = 0; r < MR; r++)
          for (int j = 0; j < NR * VB; j++) sums[r][j] = widen_pairs(pairs[r][j]);
    }
    // the block's sums, offset (and zero point) taken off, in float times the weights' and x's scales
    constexpr int OFFSET = sum_offset(BITS);
    for (int j = 0; j < NR; j++) {
      // the scales' line is the one in each unit that no step of codes prefetches
      _mm_prefetch(prefetch_at<NR>(q + j * qstride + unit, unit, qstride), PREFETCH_HINT);
      for (int v = 0; v < VB; v++) {
        const simd::F sw = load_f16((const uint16_t*)(q + j * qstride + scales) + v * simd::W);
        simd::I z = zero_i();                      // per column: what each unit of sumx takes off
        if constexpr (ZP)
          z = add_i32(load_i8_as_i32(zp + j * zstride + (size_t)gi * 16 + v * simd::W), set1_i32(OFFSET));
        for (int r = 0; r < MR; r++) {
          const size_t xi = (size_t)(m0 + r) * blocks + b;
          simd::I s = sums[r][j * VB + v];
          if constexpr (ZP) s = sub_i32(s, mullo_i32(z, set1_i32(x.sumx[xi])));
          else if constexpr (OFFSET != 0) s = sub_i32(s, set1_i32(x.sumx[xi]));
          // product and sum each rounded on their own (no FMA): the torch reference's steps
          acc[r][j * VB + v] = simd::add(acc[r][j * VB + v], simd::mul_rounded(to_float(s), simd::mul(sw, simd::set1(x.sx[xi]))));
        }
      }
    }
    codes += (size_t)QK * 16 * BITS / 8;
    if (++in_group == blocks_per_group) {          // the next group; every second one a new unit
      in_group = 0;
      if (++gi % 2 == 0) {
        unit = codes;
        codes += SCALE_BYTES;
      }
    }
  }
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR * VB; j++) store(y + (size_t)(m0 + r) * N + n0 + j * simd::W, acc[r][j]);
}

template <int NR, int BITS, bool ZP, typename Y, typename Store>
static inline void quant_tile_rows(int rows, const QuantizedX& x, int m0, int K, const uint8_t* q, size_t qstride,
                                   const int8_t* zp, size_t zstride, int group, Y* y, int N, int n0, Store store) {
  if (rows >= QMR) return quant_tile<QMR, NR, BITS, ZP>(x, m0, K, q, qstride, zp, zstride, group, y, N, n0, store);
  if constexpr (QMR > 2) {
    if (rows == 3) return quant_tile<3, NR, BITS, ZP>(x, m0, K, q, qstride, zp, zstride, group, y, N, n0, store);
  }
  if (rows == 2) return quant_tile<2, NR, BITS, ZP>(x, m0, K, q, qstride, zp, zstride, group, y, N, n0, store);
  quant_tile<1, NR, BITS, ZP>(x, m0, K, q, qstride, zp, zstride, group, y, N, n0, store);
}

// Every panel of QMR rows against each group of NR blocks: a group's weights (NR x K bytes or
// half that) stay in cache while the panels pass over them. The groups are shared out as
// stealing_ranges.h describes: each thread's run of them in order, the last few to whichever
// thread is free.
template <int BITS, bool ZP, typename Y, typename Store>
static void quant_product(const QuantizedX& x, const uint8_t* q, const int8_t* zp, Y* y, int M, int N, int K,
                          int group, int threads, Store store) {
  const int blocks = N / 16, NR = quant_blocks_per_tile(M < QMR ? M : QMR);
  const int groups = (blocks + NR - 1) / NR;
  const size_t qstride = block_bytes(K, group, BITS), zstride = (size_t)(K / group) * 16;
  native::StealingRanges work(groups, threads);
#pragma omp parallel num_threads(threads)
  for (native::StealingRanges::Cursor items(work, omp_get_thread_num()); items.next();) {
    const int g = items.item(), b0 = g * NR, nb = blocks - b0 < NR ? blocks - b0 : NR;
    const uint8_t* qg = q + (size_t)b0 * qstride;
    const int8_t* zg = ZP ? zp + (size_t)b0 * zstride : nullptr;
    for (int m0 = 0; m0 < M; m0 += QMR) {
      const int rows = M - m0 < QMR ? M - m0 : QMR;
      const int n0 = b0 * 16;
      const size_t zs = zstride;
      if (nb == 4) quant_tile_rows<4, BITS, ZP>(rows, x, m0, K, qg, qstride, zg, zs, group, y, N, n0, store);
      else if (nb == 3) quant_tile_rows<3, BITS, ZP>(rows, x, m0, K, qg, qstride, zg, zs, group, y, N, n0, store);
      else if (nb == 2) quant_tile_rows<2, BITS, ZP>(rows, x, m0, K, qg, qstride, zg, zs, group, y, N, n0, store);
      else quant_tile_rows<1, BITS, ZP>(rows, x, m0, K, qg, qstride, zg, zs, group, y, N, n0, store);
    }
  }
}

template <typename XY>
static int quant_linear(const XY* x, const uint8_t* q, const int8_t* zp, XY* y, int M, int N, int K, int bits,
                        int group, int threads) {
  if ((bits != 8 && bits != 4) || group % QK || K % group || N % 16) return 1;
  const int blocks = K / QK;
  // x's int8 values, then its block scales and sums, in one scratch buffer
  const size_t qx_bytes = ((size_t)M * K + 63) / 64 * 64, sx_bytes = ((size_t)M * blocks * 4 + 63) / 64 * 64;
  const Scratch xs(SCRATCH_X, qx_bytes + 2 * sx_bytes);
  int8_t* qx = xs.as<int8_t>();
  float* sx = (float*)(xs.as<char>() + qx_bytes);
  int32_t* sumx = (int32_t*)(xs.as<char>() + qx_bytes + sx_bytes);
  const int32_t sum_scale = zp ? 1 : sum_offset(bits);
  quantize_x(x, M, K, qx, sx, sumx, sum_scale, threads);
  const QuantizedX xq{qx, sx, sumx};
  auto store = [](XY* p, simd::F v) {
    if constexpr (sizeof(XY) == 4) simd::store((float*)p, v);
    else simd::store_bf16((uint16_t*)p, v);
  };
  // the symmetric forms stay as they were: zero points are a form of their own, not a zero vector
  if (bits == 8 && zp) quant_product<8, true>(xq, q, zp, y, M, N, K, group, threads, store);
  else if (bits == 8) quant_product<8, false>(xq, q, zp, y, M, N, K, group, threads, store);
  else if (zp) quant_product<4, true>(xq, q, zp, y, M, N, K, group, threads, store);
  else quant_product<4, false>(xq, q, zp, y, M, N, K, group, threads, store);
  return 0;
}

}  // namespace

extern "C" {
int64_t quant_linear_block_bytes(int K, int group, int bits) { return (int64_t)block_bytes(K, group, bits); }
int quant_linear_f32(const float* x, const uint8_t* q, const int8_t* zeros, float* y, int M, int N, int K, int bits,
                     int group, int threads) {
  return quant_linear(x, q, zeros, y, M, N, K, bits, group, threads);
}
int quant_linear_bf16(const uint16_t* x, const uint8_t* q, const int8_t* zeros, uint16_t* y, int M, int N, int K,
                      int bits, int group, int threads) {
  return quant_linear(x, q, zeros, y, M, N, K, bits, group, threads);
}
}
