// Qwen3.5's RMSNorms on CPU, one call each: the zero-centred norm (optionally after the residual
// add before it), the GDN output's gated norm, and the attention q/k norm with its partial RoPE.
//
// Why: each torch form (kernels/norm/reference.py, the references) is 8 to 25 small ops
// (casts to float32 and back, square, sum, rsqrt, multiplies, cats), ~73 calls in an eager
// decode step at 0.8B: their dispatch costs far more than the arithmetic on a few rows.
//
// Every row is independent and computed in float32 with the references' rounding points
// (bf16 values rounded to nearest even where the torch ops round), so a row's output does not
// depend on how many rows a call has or on the thread count. Only the sum of squares differs
// from torch's: its order (and the fused multiply-adds in it) are this kernel's own, so results
// match the references to an ulp of float32, not bitwise.
//
// Rows are addressed as (i, j) with i < n0 and j < n1, row (i, j) at base + i * s0 + j * s1
// elements (a token and a head of a strided projection slice), the last dim contiguous;
// outputs are contiguous [n0 * n1, D].
#include <math.h>
#include <stdint.h>

#include "native/kernels.h"
#include "native/simd.h"

namespace {

constexpr int V = simd::W;
// Elements per thread below which a call runs on one thread: at decode sizes the whole call
// is a microsecond or two, less than waking a second thread (torch's own grain size).
constexpr int64_t GRAIN = 32768;
constexpr int MAX_HEAD_DIM = 1024;      // the q/k row buffer; kernels/norm/cpu.py checks it

using simd::load_n;
using simd::round_to;
using simd::store_n;

inline int width(int D, int i) { return D - i < V ? D - i : V; }

template <typename T>
float sum_squares(const T* x, int D) {
  simd::F acc[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  int i = 0;
  for (; i + 4 * V <= D; i += 4 * V)
    for (int k = 0; k < 4; k++) {
      const simd::F v = load_n(x + i + k * V, V);
      acc[k] = simd::fmadd(v, v, acc[k]);
    }
  for (; i < D; i += V) {
    const simd::F v = load_n(x + i, width(D, i));
    acc[0] = simd::fmadd(v, v, acc[0]);
  }
  return simd::reduce_add(simd::add(simd::add(acc[0], acc[1]), simd::add(acc[2], acc[3])));
}

// rsqrt(mean(x^2) + eps) as the reference: eps + sum / D, then a rounded square root and a
// rounded division (torch's rsqrt on CPU is 1 / sqrt)
inline float inv_rms(float sum, int D, float eps) { return 1.f / sqrtf(eps + sum / (float)D); }

// y = round(x * r * (1 + w)): the zero-centred norm of one row whose sum of squares is known
template <typename T, typename TW>
void scale_row(const T* x, const TW* w, T* y, int D, float r) {
  const simd::F rv = simd::set1(r), one = simd::set1(1.f);
  for (int i = 0; i < D; i += V) {
    const int n = width(D, i);
    const simd::F h = simd::mul(load_n(x + i, n), rv);
    store_n(y + i, simd::mul(h, simd::add(load_n(w + i, n), one)), n);
  }
}

// row(r) for every row, on up to `threads` threads by the grain; on the calling thread alone
// without entering OpenMP at all (as torch's parallel_for does) for a small call.
template <typename F>
void for_each_row(int64_t rows, int64_t elements, int threads, const F& row) {
  if (elements / GRAIN < threads) threads = elements < 2 * GRAIN ? 1 : (int)(elements / GRAIN);
  if (threads <= 1) {
    for (int64_t r = 0; r < rows; r++) row(r);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) row(r);
}

template <typename T, typename TW>
void rms_norm(const T* x, const TW* w, T* y, int n0, int n1, int D, int64_t s0, int64_t s1, float eps,
              int threads) {
  const int64_t rows = (int64_t)n0 * n1;
  for_each_row(rows, rows * D, threads, [&](int64_t r) {
    const T* row = x + (r / n1) * s0 + (r % n1) * s1;
    scale_row(row, w, y + r * D, D, inv_rms(sum_squares(row, D), D, eps));
  });
}

// sum = round(x + h) (the residual stream after the block), y = the norm of sum
template <typename T, typename TW>
void add_rms_norm(const T* x, const T* h, const TW* w, T* sum, T* y, int rows, int D, int64_t sx,
                  int64_t sh, float eps, int threads) {
  for_each_row(rows, (int64_t)rows * D, threads, [&](int64_t r) {
    T* s = sum + r * D;
    for (int i = 0; i < D; i += V) {
      const int n = width(D, i);
      store_n(s + i, simd::add(load_n(x + r * sx + i, n), load_n(h + r * sh + i, n)), n);
    }
    scale_row(s, w, y + r * D, D, inv_rms(sum_squares(s, D), D, eps));
  });
}

// y = round(round_mid(w * round(x * r)) * silu(z)), PLAIN weight: the reference rounds the
// normalised x to T, and w times it to torch's promotion of (TW, T) (bf16 only when both are)
template <typename T, typename TW>
void gated_rms_norm(const T* x, const T* z, const TW* w, T* y, int n0, int n1, int D, int64_t sx0,
                    int64_t sx1, int64_t sz0, int64_t sz1, float eps, int threads) {
  constexpr bool mid_bf16 = sizeof(T) == 2 && sizeof(TW) == 2;
  const int64_t rows = (int64_t)n0 * n1;
  for_each_row(rows, rows * D, threads, [&](int64_t r) {
    const T* xr = x + (r / n1) * sx0 + (r % n1) * sx1;
    const T* zr = z + (r / n1) * sz0 + (r % n1) * sz1;
    T* yr = y + r * D;
    const simd::F rv = simd::set1(inv_rms(sum_squares(xr, D), D, eps));
    for (int i = 0; i < D; i += V) {
      const int n = width(D, i);
      simd::F m = simd::mul(load_n(w + i, n), round_to(simd::mul(load_n(xr + i, n), rv), yr));
      if (mid_bf16) m = simd::round_bf16(m);
      store_n(yr + i, simd::mul(m, simd::silu(load_n(zr + i, n))), n);
    }
  });
}

// q and k heads of T tokens -> out [T, nh + nkv, hd]: each head normed over hd (zero-centred,
// its own weight), rounded to T, then NeoX RoPE on its first `rot` dims with the token's cos and
// sin (in T): round(round(x * cos) + round(rotate_half(x) * sin)), each product rounded alone
template <typename T, typename TW>
void qk_norm_rope(const T* q, const T* k, const TW* qw, const TW* kw, const T* cos, const T* sin, T* out,
                  int tokens, int nh, int nkv, int hd, int rot, int64_t sq0, int64_t sq1, int64_t sk0,
                  int64_t sk1, int64_t scs, float eps, int threads) {
  const int heads = nh + nkv, half = rot / 2;
  const int64_t rows = (int64_t)tokens * heads;
  for_each_row(rows, rows * hd, threads, [&](int64_t r) {
    const int64_t t = r / heads;
    const int head = (int)(r % heads);
    const bool is_q = head < nh;
    const T* x = is_q ? q + t * sq0 + head * sq1 : k + t * sk0 + (head - nh) * sk1;
    T* y = out + r * hd;
    float normed[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
    const simd::F rv = simd::set1(inv_rms(sum_squares(x, hd), hd, eps)), one = simd::set1(1.f);
    for (int i = 0; i < hd; i += V) {
      const int n = width(hd, i);
      const simd::F h = simd::mul(load_n(x + i, n), rv);
      const simd::F wv = simd::add(is_q ? load_n(qw + i, n) : load_n(kw + i, n), one);
      store_n(normed + i, round_to(simd::mul(h, wv), y), n);
    }
    for (int j = 0; j < half; j++) {
      rotated[j] = -normed[j + half];
      rotated[j + half] = normed[j];
    }
    const T* c = cos + t * scs;
    const T* s = sin + t * scs;
    for (int i = 0; i < rot; i += V) {
      const int n = width(rot, i);
      const simd::F a = round_to(simd::mul_rounded(load_n(normed + i, n), load_n(c + i, n)), y);
      const simd::F b = round_to(simd::mul_rounded(load_n(rotated + i, n), load_n(s + i, n)), y);
      store_n(y + i, simd::add(a, b), n);
    }
    // the pass-through dims: already rounded to T, so their store is exact
    for (int i = rot; i < hd; i += V) store_n(y + i, load_n(normed + i, width(hd, i)), width(hd, i));
  });
}

}  // namespace

// One set of entries per (activation dtype, weight dtype): f32 = float32, bf16 = bfloat16 bits,
// declared extern "C" in kernels.h.
#define ENTRIES(xn, wn, T, TW)                                                                        \
  void rms_norm_##xn##_##wn(const T* x, const TW* w, T* y, int n0, int n1, int D, int64_t s0, \
                                       int64_t s1, float eps, int threads) {                          \
    rms_norm(x, w, y, n0, n1, D, s0, s1, eps, threads);                                             \
  }                                                                                                  \
  void add_rms_norm_##xn##_##wn(const T* x, const T* h, const TW* w, T* sum, T* y, int rows, \
                                           int D, int64_t sx, int64_t sh, float eps, int threads) {   \
    add_rms_norm(x, h, w, sum, y, rows, D, sx, sh, eps, threads);                                   \
  }                                                                                                  \
  void gated_rms_norm_##xn##_##wn(const T* x, const T* z, const TW* w, T* y, int n0, int n1, \
                                             int D, int64_t sx0, int64_t sx1, int64_t sz0, int64_t sz1, \
                                             float eps, int threads) {                                \
    gated_rms_norm(x, z, w, y, n0, n1, D, sx0, sx1, sz0, sz1, eps, threads);                        \
  }                                                                                                  \
  void qk_norm_rope_##xn##_##wn(const T* q, const T* k, const TW* qw, const TW* kw,       \
                                           const T* cos, const T* sin, T* out, int tokens, int nh,    \
                                           int nkv, int hd, int rot, int64_t sq0, int64_t sq1,        \
                                           int64_t sk0, int64_t sk1, int64_t scs, float eps, int threads) { \
    qk_norm_rope(q, k, qw, kw, cos, sin, out, tokens, nh, nkv, hd, rot, sq0, sq1, sk0, sk1, scs, eps, threads); \
  }
ENTRIES(f32, f32, float, float)
ENTRIES(bf16, bf16, uint16_t, uint16_t)
ENTRIES(bf16, f32, uint16_t, float)
ENTRIES(f32, bf16, float, uint16_t)
