// One token of the gated delta rule for one head, the step gdn_recurrent.cpp and gdn_decode.cpp
// both take (kernels/gdn/recurrent.py `_decode_in_place` is the math):
//   ks = k^T S, qs = q^T S                  (S before this token, at src)
//   u  = beta (v - a ks)
//   o  = a qs + (k . q) u
//   S <- a S + k u^T                        written to dst (which may be src: each element of S is
//                                           read before it is written)
// Each of S's columns [dk] is its own problem given k, q, a, beta and (k . q): its ks, qs, u and o
// and its update read no other column. So S [dk, dv] is taken a block of columns at a time: the
// block's sums stay in registers over the dk rows (no load and store of partial sums a row), and
// the block (dk rows of a few vectors: 16 KB at dk 128, AVX2) is updated and written while it is
// still in L1, instead of a second pass over the whole head from L2. The sums add the rows in the
// same order as a whole-row pass would.
// k, q [dk], v, o [dv] float32; dv a multiple of 16 up to MAX_DV.
#pragma once
#include <stdint.h>

#include <vector>

#include "native/simd.h"

namespace delta_rule {

constexpr int MAX_DV = 512;

// The columns [j0, j0 + NV W) of one token's step.
template <int NV>
inline void column_block(const float* k, const float* q, simd::F a, simd::F beta, simd::F kdotq, const float* v,
                         const float* src, float* dst, float* o, int dk, int dv, int j0) {
  simd::F ks[NV], qs[NV], u[NV];
  for (int n = 0; n < NV; n++) ks[n] = qs[n] = simd::zero();
  for (int i = 0; i < dk; i++) {
    const simd::F ki = simd::set1(k[i]), qi = simd::set1(q[i]);
    const float* row = src + (int64_t)i * dv + j0;
    if (dst != src)          // the block's rows of dst, asked for while its sums are taken
      for (int c = 0; c < NV * simd::W; c += 16) _mm_prefetch((const char*)(dst + (int64_t)i * dv + j0 + c), _MM_HINT_T0);
    for (int n = 0; n < NV; n++) {
      const simd::F s = simd::load(row + n * simd::W);
      ks[n] = simd::fmadd(ki, s, ks[n]);
      qs[n] = simd::fmadd(qi, s, qs[n]);
    }
  }
  for (int n = 0; n < NV; n++) {
    const int j = j0 + n * simd::W;
    u[n] = simd::mul(beta, simd::sub(simd::load(v + j), simd::mul(a, ks[n])));
    simd::store(o + j, simd::fmadd(kdotq, u[n], simd::mul(a, qs[n])));
  }
  for (int i = 0; i < dk; i++) {
    const simd::F ki = simd::set1(k[i]);
    const float* row = src + (int64_t)i * dv + j0;
    float* out = dst + (int64_t)i * dv + j0;
    for (int n = 0; n < NV; n++)
      simd::store(out + n * simd::W, simd::fmadd(ki, u[n], simd::mul(a, simd::load(row + n * simd::W))));
  }
}

inline void token(const float* k, const float* q, float a, float beta, const float* v, const float* src,
                  float* dst, float* o, int dk, int dv) {
  float kdotq = 0.f;
  for (int i = 0; i < dk; i++) kdotq += k[i] * q[i];
  const simd::F av = simd::set1(a), bv = simd::set1(beta), kq = simd::set1(kdotq);
  // blocks of 4 vectors (the sums and a loaded row fit AVX2's 16 registers), then of 2, then 1
  int j = 0;
  for (; j + 4 * simd::W <= dv; j += 4 * simd::W) column_block<4>(k, q, av, bv, kq, v, src, dst, o, dk, dv, j);
  for (; j + 2 * simd::W <= dv; j += 2 * simd::W) column_block<2>(k, q, av, bv, kq, v, src, dst, o, dk, dv, j);
  for (; j < dv; j += simd::W) column_block<1>(k, q, av, bv, kq, v, src, dst, o, dk, dv, j);
}

// The slots of B rows of T tokens: 0 when every read slot is in [0, R) and every write slot below
// S (a negative write slot is a skipped write), 2 otherwise (the kernels' "slot outside its pool").
inline int check_slots(const int64_t* read_slots, int64_t R, const int64_t* write_slots, int64_t S, int B, int T) {
  for (int b = 0; b < B; b++) {
    if (read_slots[b] < 0 || read_slots[b] >= R) return 2;
    for (int t = 0; t < T; t++)
      if (write_slots[(int64_t)b * T + t] >= S) return 2;
  }
  return 0;
}

// Where a token's state goes: head h of its write slot in pool [S, H, dk, dv], or for a skipped
// write (slot < 0, a padding row) a scratch state of the work item's own (allocated on first use;
// the token's src may be that scratch too: the step runs in place).
inline float* state_to_write(float* pool, int64_t slot, int H, int h, int64_t head_stride, std::vector<float>& scratch) {
  if (slot >= 0) return pool + (slot * H + h) * head_stride;
  if (scratch.empty()) scratch.resize(head_stride);
  return scratch.data();
}

}  // namespace delta_rule
