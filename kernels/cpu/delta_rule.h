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

#include "simd.h"

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

}  // namespace delta_rule
