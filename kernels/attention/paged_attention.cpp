// Causal attention of decode and verify queries (Q new tokens per sequence, Q small) read
// straight from the paged KV cache through the block table: no gathered copy of K and V.
//
// Why: the torch form gathers every cached key and value of the step into a new tensor in
// every attention layer (kv_cache[blocks, :, offsets]), then sdpa reads that copy again: at
// 8k tokens of context that is 32 MB written and read twice per layer per sequence at
// Qwen3.5-0.8B dims. Here each key and value row is read once from its block, in place.
//
// Work item: one (sequence n, kv head g). Its rows are the Q queries x (nh / nkv) query heads
// that share kv head g (GQA), so every key chunk is loaded from memory once for all of them.
// A query's heads are taken up to 4 at a time: each key and value row is loaded (and widened
// from bf16) once for the 4, not once a head. Keys are walked in chunks of CHUNK positions with
// an online softmax per row (running max m, running sum l, accumulator acc, rescaled by
// exp(m_old - m)); each row's arithmetic is the same whatever the number of heads or queries.
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

// The scores of RT query rows (heads sharing the kv head) against keys k[0, count): p[t][j] =
// (q_t . k_j) scale. Each key row is loaded (and widened from bf16) once for the RT rows; each
// row's sum is taken in the same order whatever RT (two accumulators over hd, then added).
template <int RT, typename T>
inline void scores(const float* const* q, const T* const* k, int count, int hd, float scale, float* const* p) {
  for (int j = 0; j < count; j++) {
    simd::F a0[RT], a1[RT];
    for (int t = 0; t < RT; t++) a0[t] = a1[t] = simd::zero();
    int d = 0;
    for (; d + 2 * simd::W <= hd; d += 2 * simd::W) {
      const simd::F k0 = load_row(k[j] + d), k1 = load_row(k[j] + d + simd::W);
      for (int t = 0; t < RT; t++) {
        a0[t] = simd::fmadd(simd::load(q[t] + d), k0, a0[t]);
        a1[t] = simd::fmadd(simd::load(q[t] + d + simd::W), k1, a1[t]);
      }
    }
    for (; d < hd; d += simd::W) {
      const simd::F k0 = load_row(k[j] + d);
      for (int t = 0; t < RT; t++) a0[t] = simd::fmadd(simd::load(q[t] + d), k0, a0[t]);
    }
    for (int t = 0; t < RT; t++) p[t][j] = simd::reduce_add(simd::fmadd(simd::set1(1.f), a0[t], a1[t])) * scale;
  }
}

// acc_t[0:hd] = alpha_t acc_t + sum_j p_t[j] v[j][0:hd] for RT rows, each value row loaded once for
// all of them; two vectors of each row's acc held in registers (with RT 4, 8 of AVX2's 16).
template <int RT, typename T>
inline void accumulate(float* const* acc, const float* alpha, const float* const* p, const T* const* v, int count,
                       int hd) {
  int d = 0;
  for (; d + 2 * simd::W <= hd; d += 2 * simd::W) {
    simd::F r0[RT], r1[RT];
    for (int t = 0; t < RT; t++) {
      const simd::F a = simd::set1(alpha[t]);
      r0[t] = simd::mul(a, simd::load(acc[t] + d));
      r1[t] = simd::mul(a, simd::load(acc[t] + d + simd::W));
    }
    for (int j = 0; j < count; j++) {
      const simd::F v0 = load_row(v[j] + d), v1 = load_row(v[j] + d + simd::W);
      for (int t = 0; t < RT; t++) {
        const simd::F pj = simd::set1(p[t][j]);
        r0[t] = simd::fmadd(pj, v0, r0[t]);
        r1[t] = simd::fmadd(pj, v1, r1[t]);
      }
    }
    for (int t = 0; t < RT; t++) {
      simd::store(acc[t] + d, r0[t]);
      simd::store(acc[t] + d + simd::W, r1[t]);
    }
  }
  for (; d < hd; d += simd::W) {
    simd::F r[RT];
    for (int t = 0; t < RT; t++) r[t] = simd::mul(simd::set1(alpha[t]), simd::load(acc[t] + d));
    for (int j = 0; j < count; j++) {
      const simd::F v0 = load_row(v[j] + d);
      for (int t = 0; t < RT; t++) r[t] = simd::fmadd(simd::set1(p[t][j]), v0, r[t]);
    }
    for (int t = 0; t < RT; t++) simd::store(acc[t] + d, r[t]);
  }
}

// Asks for a row of hd values a cache line at a time.
template <typename T>
inline void prefetch_row(const T* row, int hd) {
  for (int i = 0; i < hd * (int)sizeof(T); i += 64) _mm_prefetch((const char*)row + i, _MM_HINT_T0);
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
    auto key_row = [&](int64_t pos) {
      const int64_t id = block_tables[(int64_t)n * width + pos / bs];
      return cache + id * block_stride + (pos % bs) * pos_stride + (int64_t)g * hd;
    };
    for (int64_t j0 = 0; j0 < L; j0 += CHUNK) {
      const int c = (int)(L - j0 < CHUNK ? L - j0 : CHUNK);
      for (int j = 0; j < c; j++) {
        kp[j] = key_row(j0 + j);
        vp[j] = kp[j] + bs * pos_stride;
      }
      // The rows come from memory (a step's weights have pushed them out of the caches) a kv
      // head's few hundred bytes at a time, strided: asked for ahead, this chunk's values arrive
      // while its scores are computed, the next chunk's keys while its values are summed.
      for (int j = 0; j < c; j++) prefetch_row(vp[j], hd);
      for (int64_t pos = j0 + CHUNK; pos < L && pos < j0 + 2 * CHUNK; pos++) prefetch_row(key_row(pos), hd);
      for (int qi = 0; qi < Q; qi++) {
        const int64_t last = L - Q + qi;                 // the query's own position
        const int visible = (int)(last - j0 + 1 < c ? last - j0 + 1 : c);
        if (visible <= 0) continue;
        // the query's heads of this kv head, up to 4 at a time (RT rows of scores and sums)
        for (int h0 = 0; h0 < group;) {
          const int rt = group - h0 >= 4 ? 4 : group - h0 >= 2 ? 2 : 1, r0 = qi * group + h0;
          const float* qrows[4];
          float* prows[4];
          float* accs[4];
          float alphas[4];
          for (int t = 0; t < rt; t++) {
            qrows[t] = q + (((int64_t)n * Q + qi) * nh + g * group + h0 + t) * hd;
            prows[t] = p.data() + (size_t)(r0 + t) * CHUNK;
            accs[t] = acc.data() + (size_t)(r0 + t) * hd;
          }
          if (rt == 4) scores<4>(qrows, kp, visible, hd, scale, prows);
          else if (rt == 2) scores<2>(qrows, kp, visible, hd, scale, prows);
          else scores<1>(qrows, kp, visible, hd, scale, prows);
          for (int t = 0; t < rt; t++) {
            const int r = r0 + t;
            float* pr = prows[t];
            float top = -INFINITY;
            for (int j = 0; j < visible; j++) top = pr[j] > top ? pr[j] : top;
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
            alphas[t] = alpha;
          }
          if (rt == 4) accumulate<4>(accs, alphas, prows, vp, visible, hd);
          else if (rt == 2) accumulate<2>(accs, alphas, prows, vp, visible, hd);
          else accumulate<1>(accs, alphas, prows, vp, visible, hd);
          h0 += rt;
        }
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
