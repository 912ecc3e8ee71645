// int4 weights' group scales by search: for each group of `group` consecutive values, the scale
// among 21 candidates around llama.cpp's Q4_0 rule (m / -8 for the value m of largest magnitude)
// whose rounded codes reconstruct the group with the least squared error, as llama.cpp's K-quants
// search theirs (make_qx_quants). Q4_0's rule alone spends the code -8 on the one extreme value;
// a slightly larger or smaller step fits the other 31 better, and which one is a per-group matter.
//
// The torch form is kernels/linear/quantized.py `_int4_search_torch`, step for step: each
// candidate's scale is rounded to float16 first, codes are round-half-even(w * (1 / scale))
// clamped to [-8, 7] in float32, and the error is summed in float64 (w - code * scale is exact
// there), so the two forms choose alike except where two candidates' errors tie to the last bits
// of a double. Loading quantizes a model's weights once: the torch form's 21 passes over every
// weight are memory-bound there, here each group stays in registers.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <omp.h>

#include "native/kernels.h"

namespace {

constexpr int CANDIDATES = 21;

// the candidate divisors -9.0, -8.9, ..., -7.0 in float32, in the order searched (ties keep the first)
inline float divisor(int i) { return (float)(-8.0 + (i - 10) / 10.0); }
inline uint16_t to_half(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
inline float from_half(uint16_t h) { return _cvtsh_ss(h); }

// codes of 8 values for scale s: round-half-even(w * (1 / s)) clamped to [-8, 7]
inline __m256 codes(__m256 w, __m256 inverse) {
  const __m256 c = _mm256_round_ps(_mm256_mul_ps(w, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_ps(_mm256_max_ps(c, _mm256_set1_ps(-8.0f)), _mm256_set1_ps(7.0f));
}

// sum over the group of (w - code * s)^2 in float64 (code * s is exact in float32: 4 bits x 11)
inline double squared_error(const float* w, int group, float s, float inverse) {
  const __m256 sv = _mm256_set1_ps(s), iv = _mm256_set1_ps(inverse);
  __m256d acc = _mm256_setzero_pd();
  for (int j = 0; j < group; j += 8) {
    const __m256 x = _mm256_loadu_ps(w + j), r = _mm256_mul_ps(codes(x, iv), sv);
    const __m256d e0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
    const __m256d e1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_mul_pd(e0, e0), _mm256_mul_pd(e1, e1)));
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, acc);
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

void search_group(const float* w, int group, int8_t* q, uint16_t* scale) {
  float extreme = 0.0f;                               // the first value of largest magnitude
  for (int j = 0; j < group; j++)
    if (fabsf(w[j]) > fabsf(extreme)) extreme = w[j];
  double best_error = 0.0;
  uint16_t best = 0;
  for (int i = 0; i < CANDIDATES; i++) {
    const uint16_t h = to_half(extreme / divisor(i));
    const float s = from_half(h);
    const double error = squared_error(w, group, s, s != 0.0f ? 1.0f / s : 0.0f);
    if (i == 0 || error < best_error) best_error = error, best = h;
  }
  const float s = from_half(best);
  const __m256 iv = _mm256_set1_ps(s != 0.0f ? 1.0f / s : 0.0f);
  for (int j = 0; j < group; j += 8) {
    float v[8];
    _mm256_storeu_ps(v, codes(_mm256_loadu_ps(w + j), iv));
    for (int t = 0; t < 8; t++) q[j + t] = (int8_t)v[t];
  }
  *scale = best;
}

}  // namespace

extern "C" int quantize_int4_search(const float* w, int64_t groups, int group, int8_t* q, uint16_t* scales,
                                    int threads) {
  if (group % 8) return 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < groups; g++) search_group(w + g * group, group, q + g * group, scales + g);
  return 0;
}
