// Causal attention of decode and verify queries (Q new tokens per sequence, Q small) read
// straight from the paged KV cache through the block table: no gathered copy of K and V.
//
// Why: the torch form gathers every cached key and value of the step into a new tensor in
// every attention layer (kv_cache[blocks, :, offsets]), then sdpa reads that copy again: at
// 8k tokens of context that is 32 MB written and read twice per layer per sequence at
// Qwen3.5-0.8B dims. Here each key and value row is read once from its block, in place.
//
// Work item: one (sequence n, kv head g). Its rows are the Q queries x (nh / nkv) query heads
// that share kv head g (GQA), so every key chunk is loaded from memory once for all of them
// and re-read from L1/L2 per row. Keys are walked in chunks of CHUNK positions with an online
// softmax per row (running max m, running sum l, accumulator acc, rescaled by exp(m_old - m)).
//
// Visibility: query i of sequence n sits at position L - Q + i (L = seq_lens[n]) and sees
// keys at positions <= its own. Only positions < L are ever read, so block-table entries
// past ceil(L / block_size) and unwritten slots (NaN) are never touched.
//
// q: [N * Q, nh, hd] float32 (already brought to float32); cache: [num_blocks, 2, bs, nkv, hd]
// float32 or bf16, contiguous; block_tables: [N, width] int64; seq_lens: [N] int64;
// o: [N * Q, nh, hd] float32. Returns 0, 1 for an unsupported shape (hd, rows), 2 for a
// sequence shorter than Q or longer than its table, 3 for a block id outside the cache
// (nothing is computed then). One source for every level: rows are walked in simd::W floats.
#include <math.h>
#include <stdint.h>

#include <vector>

#include "native/kernels.h"
#include "native/simd.h"

namespace {

constexpr int CHUNK = 32;        // key positions per online-softmax step (a multiple of simd::W)
constexpr int MAX_HD = 512;
constexpr int MAX_ROWS = 128;    // Q * nh / nkv

inline simd::F load_row(const float* p) { return simd::load(p); }
inline simd::F load_row(const uint16_t* p) { return simd::load_bf16(p); }

template <typename T>
inline float dot(const float* q, const T* k, int hd) {
  simd::F a0 = simd::zero(), a1 = simd::zero();
  int d = 0;
  for (; d + 2 * simd::W <= hd; d += 2 * simd::W) {
    a0 = simd::fmadd(simd::load(q + d), load_row(k + d), a0);
    a1 = simd::fmadd(simd::load(q + d + simd::W), load_row(k + d + simd::W), a1);
  }
  for (; d < hd; d += simd::W) a0 = simd::fmadd(simd::load(q + d), load_row(k + d), a0);
  return simd::reduce_add(simd::fmadd(simd::set1(1.f), a0, a1));
}

// acc[0:hd] = alpha * acc + sum_j p[j] * v[j][0:hd], four vectors of acc held in registers.
template <typename T>
inline void accumulate(float* acc, float alpha, const float* p, const T* const* v, int count, int hd) {
  const simd::F a = simd::set1(alpha);
  int d = 0;
  for (; d + 4 * simd::W <= hd; d += 4 * simd::W) {
    simd::F r0 = simd::mul(a, simd::load(acc + d)), r1 = simd::mul(a, simd::load(acc + d + simd::W));
    simd::F r2 = simd::mul(a, simd::load(acc + d + 2 * simd::W)), r3 = simd::mul(a, simd::load(acc + d + 3 * simd::W));
    for (int j = 0; j < count; j++) {
      const simd::F pj = simd::set1(p[j]);
      const T* vj = v[j] + d;
      r0 = simd::fmadd(pj, load_row(vj), r0);
      r1 = simd::fmadd(pj, load_row(vj + simd::W), r1);
      r2 = simd::fmadd(pj, load_row(vj + 2 * simd::W), r2);
      r3 = simd::fmadd(pj, load_row(vj + 3 * simd::W), r3);
    }
    simd::store(acc + d, r0);
    simd::store(acc + d + simd::W, r1);
    simd::store(acc + d + 2 * simd::W, r2);
    simd::store(acc + d + 3 * simd::W, r3);
  }
  for (; d < hd; d += simd::W) {
    simd::F r = simd::mul(a, simd::load(acc + d));
    for (int j = 0; j < count; j++) r = simd::fmadd(simd::set1(p[j]), load_row(v[j] + d), r);
    simd::store(acc + d, r);
  }
}

template <typename T>
int attend(const float* q, const T* cache, const int64_t* block_tables, const int64_t* seq_lens, float* o,
           int64_t num_blocks, int N, int Q, int nh, int nkv, int hd, int bs, int width, float scale,
           int threads) {
  if (hd % 16 || hd > MAX_HD || nkv <= 0 || nh % nkv || Q <= 0 || Q * (nh / nkv) > MAX_ROWS) return 1;
  for (int n = 0; n < N; n++) {
    const int64_t L = seq_lens[n];
    if (L < Q || (L + bs - 1) / bs > width) return 2;
    for (int64_t b = 0; b < (L + bs - 1) / bs; b++) {
      const int64_t id = block_tables[(int64_t)n * width + b];
      if (id < 0 || id >= num_blocks) return 3;
    }
  }
  const int group = nh / nkv, rows = Q * group;
  const int64_t pos_stride = (int64_t)nkv * hd, block_stride = 2 * (int64_t)bs * pos_stride;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int item = 0; item < N * nkv; item++) {
    const int n = item / nkv, g = item % nkv;
    const int64_t L = seq_lens[n];
    std::vector<float> acc((size_t)rows * hd, 0.f), m(rows, -INFINITY), l(rows, 0.f), p((size_t)rows * CHUNK);
    const T* kp[CHUNK];
    const T* vp[CHUNK];
    for (int64_t j0 = 0; j0 < L; j0 += CHUNK) {
      const int c = (int)(L - j0 < CHUNK ? L - j0 : CHUNK);
      for (int j = 0; j < c; j++) {
        const int64_t pos = j0 + j;
        const int64_t id = block_tables[(int64_t)n * width + pos / bs];
        kp[j] = cache + id * block_stride + (pos % bs) * pos_stride + (int64_t)g * hd;
        vp[j] = kp[j] + bs * pos_stride;
      }
      for (int r = 0; r < rows; r++) {
        const int qi = r / group, h = g * group + r % group;
        const int64_t last = L - Q + qi;                 // the query's own position
        const int visible = (int)(last - j0 + 1 < c ? last - j0 + 1 : c);
        if (visible <= 0) continue;
        const float* qr = q + (((int64_t)n * Q + qi) * nh + h) * hd;
        float* pr = p.data() + (size_t)r * CHUNK;
        float top = -INFINITY;
        for (int j = 0; j < visible; j++) {
          pr[j] = dot(qr, kp[j], hd) * scale;
          top = pr[j] > top ? pr[j] : top;
        }
        const float m_new = m[r] > top ? m[r] : top;
        const float alpha = expf(m[r] - m_new);          // 0 on the first chunk (m = -inf)
        // The chunk's exponentials a vector at a time (simd::exp), the lanes past the visible
        // keys at -inf (e^-inf = 0): a scalar expf a key cost more than its dot product (a k=4
        // verify of the default model, 10 rows x 400 keys: 34.7 -> 16.9 us a call; 0.8B dims,
        // one query at 2048 keys: 216 -> 162 us). Each row on its own, in the same order
        // whatever Q: a decode and a verify give a query the same output.
        for (int j = visible; j < (visible + simd::W - 1) / simd::W * simd::W; j++) pr[j] = -INFINITY;
        const simd::F shift = simd::set1(m_new);
        simd::F sums = simd::zero();
        for (int j = 0; j < visible; j += simd::W) {
          const simd::F e = simd::exp(simd::sub(simd::load(pr + j), shift));
          simd::store(pr + j, e);
          sums = simd::add(sums, e);
        }
        l[r] = l[r] * alpha + simd::reduce_add(sums);
        m[r] = m_new;
        accumulate(acc.data() + (size_t)r * hd, alpha, pr, vp, visible, hd);
      }
    }
    for (int r = 0; r < rows; r++) {
      const int qi = r / group, h = g * group + r % group;
      float* out = o + (((int64_t)n * Q + qi) * nh + h) * hd;
      const float inv = 1.f / l[r];
      const float* a = acc.data() + (size_t)r * hd;
      for (int d = 0; d < hd; d++) out[d] = a[d] * inv;
    }
  }
  return 0;
}

}  // namespace

extern "C" int paged_attention_f32(const float* q, const float* cache, const int64_t* block_tables,
                                   const int64_t* seq_lens, float* o, int64_t num_blocks, int N, int Q, int nh,
                                   int nkv, int hd, int bs, int width, float scale, int threads) {
  return attend(q, cache, block_tables, seq_lens, o, num_blocks, N, Q, nh, nkv, hd, bs, width, scale, threads);
}

extern "C" int paged_attention_bf16(const float* q, const uint16_t* cache, const int64_t* block_tables,
                                    const int64_t* seq_lens, float* o, int64_t num_blocks, int N, int Q, int nh,
                                    int nkv, int hd, int bs, int width, float scale, int threads) {
  return attend(q, cache, block_tables, seq_lens, o, num_blocks, N, Q, nh, nkv, hd, bs, width, scale, threads);
}
