// The vector width of the native kernels as one compile-time parameter: each kernel is written
// once against these few operations, and kernels/native/build.py compiles it for one level of
// kernels/native/isa.py: 16-float AVX-512 vectors (32 registers) or 8-float AVX2 ones (16).
//
// bfloat16 is the top half of a float32, so widening is a 16-bit shift (the low element of a
// 32-bit pair) or a mask (the high one): AVX2 and plain AVX-512 read bf16 weights at half the
// bytes of float32 with no conversion instruction. Rounding back is to nearest even.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace simd {

#if defined(__AVX512F__)
constexpr int W = 16;            // floats per vector
constexpr int REGISTERS = 32;
using F = __m512;
using I = __m512i;
inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F min(F a, F b) { return _mm512_min_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F round_nearest(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F pow2i(F n) {            // 2^n for integral n in [-126, 127], built in the exponent field
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline F select_gt(F a, F b, F if_gt, F otherwise) {     // a > b ? if_gt : otherwise, per lane
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), otherwise, if_gt);
}
inline F permute2(F a, F b, I lanes) {   // lane l <- (a ++ b)[lanes[l]], lanes in [0, 2W)
  return _mm512_permutex2var_ps(a, lanes, b);
}
inline F round_bf16(F v) {        // v rounded to the nearest bf16, nearest even, kept as float
  I bits = _mm512_castps_si512(v);
  I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000u)));
}
inline I load_bits(const void* p) { return _mm512_loadu_si512(p); }
inline F low_bf16(I pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline F high_bf16(I pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}
inline F load_bf16(const uint16_t* p) {       // W consecutive bf16 -> W floats
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
inline void store_bf16(uint16_t* p, F v) {    // W floats -> W bf16, nearest even
  I bits = _mm512_castps_si512(v);
  I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int REGISTERS = 16;
using F = __m256;
using I = __m256i;
inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F min(F a, F b) { return _mm256_min_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F round_nearest(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F pow2i(F n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F select_gt(F a, F b, F if_gt, F otherwise) {
  return _mm256_blendv_ps(otherwise, if_gt, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
inline F permute2(F a, F b, I lanes) {   // each permute reads the low 3 bits; bit 3 picks b
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a, lanes), _mm256_permutevar8x32_ps(b, lanes),
                          _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 28)));
}
inline F round_bf16(F v) {
  I bits = _mm256_castps_si256(v);
  I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFFF0000u)));
}
inline I load_bits(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline F low_bf16(I pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline F high_bf16(I pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}
inline F load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float reduce_add(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline void store_bf16(uint16_t* p, F v) {
  I bits = _mm256_castps_si256(v);
  I lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works within 128-bit lanes: [0-3 | 0-3 | 4-7 | 4-7]; gather quads 0 and 2
  I packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
#else
#error "simd.h needs AVX2+FMA or AVX-512 (kernels/native/build.py passes a level's flags)"
#endif

// An empty asm the compiler must assume reads and rewrites v: v stays the value computed before
// it, in a register (not fused into a later FMA, not reassociated with later adds).
template <typename V>
inline void opaque(V& v) { asm("" : "+v"(v)); }

// a * b rounded on its own: the compiler may not fuse it into a later add (GCC contracts vector
// mul + add into FMA by default). For sums that must round every product as torch's do.
inline F mul_rounded(F a, F b) {
  F p = mul(a, b);
  opaque(p);
  return p;
}

// e^x to one ulp, in the steps of SLEEF's expf_u10 (which torch's vectorized exp calls), so
// that SiLU here rounds as torch's does: x = q ln2 + s with q = rint(x / ln2) and ln2 in two
// parts, e^s = 1 + s + s^2 p(s) with a degree-5 p, times 2^q in two halves (2^q alone would
// overflow the exponent at the ends of the range). 0 below -104, +inf above 100 (and past
// ~88.72 by overflow).
inline F exp(F x) {
  const F q = round_nearest(mul(x, set1(1.442695040888963407359924681001892137f)));
  F s = fmadd(q, set1(-0.693145751953125f), x);
  s = fmadd(q, set1(-1.428606765330187045e-06f), s);
  F u = set1(0.000198527617612853646278381f);
  u = fmadd(u, s, set1(0.00139304355252534151077271f));
  u = fmadd(u, s, set1(0.00833336077630519866943359f));
  u = fmadd(u, s, set1(0.0416664853692054748535156f));
  u = fmadd(u, s, set1(0.166666671633720397949219f));
  u = fmadd(u, s, set1(0.5f));
  u = add(set1(1.f), fmadd(mul(s, s), u, s));
  const F half = round_nearest(mul(q, set1(0.5f)));      // any split: each product is exact
  const F clamp = set1(120.f);            // keeps pow2i defined outside the range (NaN: not NaN out)
  u = mul(mul(u, pow2i(max(min(half, clamp), sub(zero(), clamp)))),
          pow2i(max(min(sub(q, half), clamp), sub(zero(), clamp))));
  u = select_gt(set1(-104.f), x, zero(), u);
  return select_gt(x, set1(100.f), set1(__builtin_inff()), u);
}

// x / (1 + e^-x), torch's SiLU formula
inline F silu(F x) { return div(x, add(set1(1.f), exp(sub(zero(), x)))); }

inline float bits_to_float(uint32_t bits) {
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// One bf16 value (its bits) as a float, and a float to the nearest bf16 (nearest even, as
// torch's casts).
inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// n <= W values at p, as a vector with zeros past them (a row's tail), and back.
inline F load_n(const float* p, int n) {
  if (n == W) return load(p);
  float t[W] = {};
  __builtin_memcpy(t, p, n * sizeof(float));
  return load(t);
}
inline F load_n(const uint16_t* p, int n) {
  if (n == W) return load_bf16(p);
  uint16_t t[W] = {};
  __builtin_memcpy(t, p, n * sizeof(uint16_t));
  return load_bf16(t);
}
inline void store_n(float* p, F v, int n) {
  if (n == W) return store(p, v);
  float t[W];
  store(t, v);
  __builtin_memcpy(p, t, n * sizeof(float));
}
inline void store_n(uint16_t* p, F v, int n) {
  if (n == W) return store_bf16(p, v);
  uint16_t t[W];
  store_bf16(t, v);
  __builtin_memcpy(p, t, n * sizeof(uint16_t));
}
// v rounded to the precision of the element type p points to, kept as float (float32: as is)
inline F round_to(F v, const float*) { return v; }
inline F round_to(F v, const uint16_t*) { return round_bf16(v); }

}  // namespace simd
