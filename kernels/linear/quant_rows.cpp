// Single rows of a packed quantized weight (quant_linear.cpp's layout), read where a product is
// not wanted:
//   quant_rows:        W[ids] dequantized to float32 (a tied embedding's lookups).
//   quant_rescore_top: in each row of y = x W'^T (a product at other bits, here int4), its
//                      `count` largest outputs replaced by x . W[id] from this table (int8), in
//                      place (kernels/linear/quantized.py `QuantizedLinearMethod._rescore`).
//
// Why native: in torch the selection was a topk over the whole vocabulary (about 0.9 ms a row
// at 248k outputs) and the gather split each id's whole block of 16 rows, together about as
// long as a small model's whole decode step. Here one pass over y keeps the `count` best so far
// and looks at a vector of outputs only where one of them beats the worst kept (rarely, past
// the first few thousand), and a row is read from its 16-row block byte by byte.
//
// Selection order: larger value first, equal values by smaller index; NaN never selected. The
// order is total, so splitting a row's outputs between threads selects the same ids.
// Rescored sums: every product x[k] * w[k] is exact in double (24 + 19 bits) and is summed in
// double in 8 lanes (k mod 8), the lanes added in a fixed tree, then rounded to float (and to
// y's bf16, nearest even): the same bits in any batch and at every vector level.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "linear/quant_layout.h"
#include "native/kernels.h"
#include "native/simd.h"

namespace {

using quant_layout::BLOCK;               // rows of W a block holds (the product's columns)
using quant_layout::SCALE_BYTES;
using quant_layout::STEP_BYTES;

struct Packed {
  const uint8_t* q;
  const int8_t* zeros;                 // [N/16][groups][16] or nullptr
  int K, bits, group;
  int64_t block_bytes;
};

// Row `id` of the weight, dequantized: (code - middle - zero) * scale, as kernels/linear/
// quantized.py `unpack` computes it (every step exact in float32: the same values).
void dequantize_row(const Packed& w, int64_t id, float* out) {
  const int64_t b = id / BLOCK;
  const int c = (int)(id % BLOCK), groups = w.K / w.group;
  const int code_bytes = (int)quant_layout::group_code_bytes(w.group, w.bits), unit = SCALE_BYTES + 2 * code_bytes;
  const int middle = quant_layout::middle(w.bits);
  const uint8_t* block = w.q + b * w.block_bytes;
  for (int g = 0; g < groups; g++) {
    const uint8_t* u = block + (int64_t)(g / 2) * unit;
    uint16_t half;
    memcpy(&half, u + ((g % 2) * BLOCK + c) * 2, 2);
    const float scale = _cvtsh_ss(half);
    const int offset = middle + (w.zeros ? w.zeros[(b * groups + g) * BLOCK + c] : 0);
    const uint8_t* codes = u + SCALE_BYTES + (g % 2) * code_bytes + c * 4;    // a column's lane of each step
    float* o = out + (int64_t)g * w.group;
    if (w.bits == 8) {
      for (int s = 0; s < w.group / 4; s++)
        for (int j = 0; j < 4; j++) o[4 * s + j] = (float)(codes[s * STEP_BYTES + j] - offset) * scale;
    } else {
      for (int s = 0; s < w.group / 8; s++)
        for (int j = 0; j < 4; j++) {
          const int byte = codes[s * STEP_BYTES + j];
          o[8 * s + j] = (float)((byte & 15) - offset) * scale;
          o[8 * s + 4 + j] = (float)((byte >> 4) - offset) * scale;
        }
    }
  }
}

// sum x[k] * w[k] (module comment: exact products, 8 double lanes, a fixed tree)
float exact_dot(const float* x, const float* w, int K) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < K; k += 8)
    for (int j = 0; j < 8; j++) lane[j] += (double)x[k + j] * (double)w[k + j];
  return (float)(((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])));
}

struct Kept {
  float value;
  int64_t id;
};

inline bool before(const Kept& a, const Kept& b) {          // the selection order
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// The `count` best outputs seen so far, best first.
struct Best {
  Kept* kept;
  int count, have = 0;

  void offer(float v, int64_t id) {
    if (v != v) return;                                    // NaN
    if (have == count && !(v > kept[count - 1].value)) return;     // ties lose: ids rise
    int at = have < count ? have++ : count - 1;
    for (; at > 0 && !before(kept[at - 1], Kept{v, id}); at--) kept[at] = kept[at - 1];
    kept[at] = Kept{v, id};
  }
  float threshold() const { return have == count ? kept[count - 1].value : -INFINITY; }
};

inline float load_one(const float* p) { return *p; }
inline float load_one(const uint16_t* p) { return simd::bf16_to_float(*p); }
inline simd::F load_vector(const float* p) { return simd::load(p); }
inline simd::F load_vector(const uint16_t* p) { return simd::load_bf16(p); }
inline void store_one(float* p, float v) { *p = v; }
inline void store_one(uint16_t* p, float v) { *p = simd::float_to_bf16(v); }

// Whether any of v[0..3] exceeds t (compares with NaN are false).
inline bool any_above(simd::F v0, simd::F v1, simd::F v2, simd::F v3, simd::F t) {
#if defined(__AVX512F__)
  return (_mm512_cmp_ps_mask(v0, t, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v1, t, _CMP_GT_OQ) |
          _mm512_cmp_ps_mask(v2, t, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v3, t, _CMP_GT_OQ)) != 0;
#else
  const __m256 any = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, t, _CMP_GT_OQ), _mm256_cmp_ps(v1, t, _CMP_GT_OQ)),
                                  _mm256_or_ps(_mm256_cmp_ps(v2, t, _CMP_GT_OQ), _mm256_cmp_ps(v3, t, _CMP_GT_OQ)));
  return _mm256_movemask_ps(any) != 0;
#endif
}

// Offers y[begin, end) to `best`: one element at a time until it is full, then 4 vectors at a
// time, each group looked into only where some output beats the worst kept.
template <typename T>
void select(const T* y, int64_t begin, int64_t end, Best& best) {
  constexpr int64_t STEP = 4 * simd::W;
  int64_t i = begin;
  for (; i < end && best.have < best.count; i++) best.offer(load_one(y + i), i);
  for (; i + STEP <= end; i += STEP) {
    const simd::F t = simd::set1(best.threshold());
    if (!any_above(load_vector(y + i), load_vector(y + i + simd::W), load_vector(y + i + 2 * simd::W),
                   load_vector(y + i + 3 * simd::W), t))
      continue;
    for (int64_t j = i; j < i + STEP; j++) best.offer(load_one(y + j), j);
  }
  for (; i < end; i++) best.offer(load_one(y + i), i);
}

template <typename T>
int rescore_top(const T* x, T* y, int64_t sy, const Packed& w, int M, int64_t n, int count, int threads) {
  if (count <= 0 || n <= 0 || M <= 0) return 0;
  count = (int)std::min<int64_t>(count, n);
  // Few rows: each row's outputs split between the threads (a decode step has one row);
  // many: whole rows a thread.
  const int parts = M >= threads ? 1 : std::max(1, threads / M);
  const int64_t span = (n + parts - 1) / parts;
  std::vector<Kept> kept((size_t)M * parts * count);
  std::vector<int> have((size_t)M * parts);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < (int64_t)M * parts; task++) {
    const int64_t r = task / parts, p = task % parts;
    Best best{kept.data() + task * count, count};
    select(y + r * sy, std::min(n, p * span), std::min(n, (p + 1) * span), best);
    have[task] = best.have;
  }
#pragma omp parallel num_threads(std::min(threads, M))
  {
    std::vector<float> xf(w.K), row(w.K);
    std::vector<Kept> merged;
#pragma omp for schedule(static)
    for (int r = 0; r < M; r++) {
      merged.clear();
      for (int p = 0; p < parts; p++) {
        const Kept* k = kept.data() + ((int64_t)r * parts + p) * count;
        merged.insert(merged.end(), k, k + have[(int64_t)r * parts + p]);
      }
      std::sort(merged.begin(), merged.end(), before);
      if ((int)merged.size() > count) merged.resize(count);
      for (int k = 0; k < w.K; k++) xf[k] = load_one(x + (int64_t)r * w.K + k);
      for (const Kept& k : merged) {
        dequantize_row(w, k.id, row.data());
        store_one(y + r * sy + k.id, exact_dot(xf.data(), row.data(), w.K));
      }
    }
  }
  return 0;
}

bool fits(int K, int bits, int group) {
  return (bits == 8 || bits == 4) && group > 0 && group % 8 == 0 && K % group == 0;
}

}  // namespace

int quant_rows_f32(const uint8_t* q, const int8_t* zeros, const int64_t* ids, float* out, int n, int K, int64_t N,
                   int bits, int group) {
  if (!fits(K, bits, group)) return 2;
  for (int i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= N) return 1;
  const Packed w{q, zeros, K, bits, group, quant_linear_block_bytes(K, group, bits)};
  for (int i = 0; i < n; i++) dequantize_row(w, ids[i], out + (int64_t)i * K);
  return 0;
}

int quant_rescore_top_f32(const float* x, float* y, int64_t sy, const uint8_t* q, const int8_t* zeros, int M,
                          int64_t n, int K, int bits, int group, int count, int threads) {
  if (!fits(K, bits, group)) return 2;
  return rescore_top(x, y, sy, Packed{q, zeros, K, bits, group, quant_linear_block_bytes(K, group, bits)}, M, n,
                     count, threads);
}

int quant_rescore_top_bf16(const uint16_t* x, uint16_t* y, int64_t sy, const uint8_t* q, const int8_t* zeros,
                           int M, int64_t n, int K, int bits, int group, int count, int threads) {
  if (!fits(K, bits, group)) return 2;
  return rescore_top(x, y, sy, Packed{q, zeros, K, bits, group, quant_linear_block_bytes(K, group, bits)}, M, n,
                     count, threads);
}
