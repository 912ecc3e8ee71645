// One token of the gated delta rule for one head, the step gdn_recurrent.cpp and gdn_decode.cpp
// both take (kernels/gdn/recurrent.py `_decode_in_place` is the math):
//   ks = k^T S, qs = q^T S                  (S before this token, at src)
//   u  = beta (v - a ks)
//   o  = a qs + (k . q) u
//   S <- a S + k u^T                        written to dst (which may be src: each row of S is
//                                           read before it is written)
// S [dk, dv] is read once for both reads, row by row so it streams in order, then decayed,
// updated and written in a second pass while it is still in L2: two passes per token.
// k, q [dk], v, o [dv] float32; dv a multiple of 16 up to MAX_DV.
#pragma once
#include <stdint.h>

#include <vector>

#include "native/simd.h"

namespace delta_rule {

constexpr int MAX_DV = 512;

inline void token(const float* k, const float* q, float a, float beta, const float* v, const float* src,
                  float* dst, float* o, int dk, int dv) {
  float ks[MAX_DV], qs[MAX_DV], u[MAX_DV];
  for (int j = 0; j < dv; j++) ks[j] = qs[j] = 0.f;
  for (int i = 0; i < dk; i++) {
    const simd::F ki = simd::set1(k[i]), qi = simd::set1(q[i]);
    const float* row = src + (int64_t)i * dv;
    for (int j = 0; j < dv; j += simd::W) {
      const simd::F s = simd::load(row + j);
      simd::store(ks + j, simd::fmadd(ki, s, simd::load(ks + j)));
      simd::store(qs + j, simd::fmadd(qi, s, simd::load(qs + j)));
    }
  }
  float kdotq = 0.f;
  for (int i = 0; i < dk; i++) kdotq += k[i] * q[i];
  for (int j = 0; j < dv; j++) {
    u[j] = beta * (v[j] - a * ks[j]);
    o[j] = a * qs[j] + kdotq * u[j];
  }
  const simd::F av = simd::set1(a);
  for (int i = 0; i < dk; i++) {
    const simd::F ki = simd::set1(k[i]);
    const float* row = src + (int64_t)i * dv;
    float* out = dst + (int64_t)i * dv;
    for (int j = 0; j < dv; j += simd::W)
      simd::store(out + j, simd::fmadd(ki, simd::load(u + j), simd::mul(av, simd::load(row + j))));
  }
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
