// One gated-delta-rule decode token per request, each head's state updated where it lives.
//
// Why: at batch 16 of Qwen3.5-0.8B the states are 16 x 18 layers x 1 MB per step, and the torch
// form (a bmm for the two reads, mul_ for the decay, baddbmm_ for the rank-1 update: three
// ops per request and layer) passes over each state five times. Here each head's S [dk, dv]
// is read once for both reads (k^T S, q^T S) and then decayed, updated and written in a second
// pass while it is still in L2: two passes from memory, read and write.
//
// Per request b and head h (the math of kernels/gdn/recurrent.py `_decode_in_place`):
//   ks = k^T S, qs = q^T S                  (S as stored, before the decay)
//   u  = beta (v - a ks)
//   o  = a qs + (k . q) u
//   S <- a S + k u^T
// kq: [B, H, 2, dk] (k, then the scaled q), decay/beta: [B, H], v: [B, H, dv] float32;
// pool: [S, H, dk, dv] float32; slots: [B] int64 (distinct); o: [B, H, dv] float32.
#include <immintrin.h>
#include <stdint.h>

extern "C" int gdn_decode_in_place(const float* kq, const float* decay, const float* beta,
                                   const float* v, float* pool, const int64_t* slots, float* o,
                                   int B, int H, int dk, int dv, int threads) {
  if (dv % 16) return 1;
  const int64_t head_stride = (int64_t)dk * dv;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H;
    float* S = pool + (slots[b] * H + h) * head_stride;
    const float* k = kq + (int64_t)bh * 2 * dk;
    const float* q = k + dk;
    const float a = decay[bh], be = beta[bh];
    float ks[512], qs[512], u[512];          // dv <= 512 (checked by the caller)
    for (int j = 0; j < dv; j++) ks[j] = qs[j] = 0.f;
    for (int i = 0; i < dk; i++) {           // row by row: S streams in order
      const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
      const float* row = S + (int64_t)i * dv;
      for (int j = 0; j < dv; j += 16) {
        __m512 s = _mm512_loadu_ps(row + j);
        _mm512_storeu_ps(ks + j, _mm512_fmadd_ps(ki, s, _mm512_loadu_ps(ks + j)));
        _mm512_storeu_ps(qs + j, _mm512_fmadd_ps(qi, s, _mm512_loadu_ps(qs + j)));
      }
    }
    float kdotq = 0.f;
    for (int i = 0; i < dk; i++) kdotq += k[i] * q[i];
    const float* vb = v + (int64_t)bh * dv;
    float* ob = o + (int64_t)bh * dv;
    for (int j = 0; j < dv; j++) {
      u[j] = be * (vb[j] - a * ks[j]);
      ob[j] = a * qs[j] + kdotq * u[j];
    }
    const __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < dk; i++) {
      const __m512 ki = _mm512_set1_ps(k[i]);
      float* row = S + (int64_t)i * dv;
      for (int j = 0; j < dv; j += 16) {
        __m512 s = _mm512_loadu_ps(row + j);
        _mm512_storeu_ps(row + j, _mm512_fmadd_ps(ki, _mm512_loadu_ps(u + j), _mm512_mul_ps(av, s)));
      }
    }
  }
  return 0;
}
