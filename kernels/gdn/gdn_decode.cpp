// The GDN layer's decode and verify step after its conv (native/ops.cpp runs conv/causal_conv1d_update.cpp
// first, into `u`): per request b, value head h and token t, from the layer's projections as
// they come (float32 or bf16, no casts before the call),
//   k, q   = the key head's rows of u, in float32, each scaled by 1 / sqrt(sum of squares + 1e-6)
//            and q by the attention scale too (kernels/gdn/qk_norm.py `normalize_kq`)
//   beta   = sigmoid(b), rounded to the activations' dtype (as the layer's torch form, and HF)
//   decay  = exp(-exp(A_log) * softplus(a + dt_bias)), in float32 (neg_decay = -exp(A_log))
//   o, S'  = the step of delta_rule.h on the v head's rows of u, o rounded to the dtype
// Value head h reads key head h / (H / Hk) (consecutive value heads share a key head).
//
// Why: the torch form around the two kernels is ~25 ops per layer (the gates' casts, softplus,
// exp, sigmoid; the q/k norm's stack, square, sum, rsqrt, multiplies; v's and beta's casts to
// float32 and o's back), each a dispatch and an allocation on a few hundred floats: at decode
// sizes they cost more than the state update. Here they are one pass over each head's rows,
// inside the work item that updates the head's state.
//
// The states, slots and rows as gdn_recurrent.cpp's (read_pool is the pool, or a copy of the
// rows' first states where rows depend on each other). u: [B, T, D] contiguous, D = 2 Hk dk +
// H dv ([q | k | v], head-major); b, a: [B, T, H] at row strides (sb0, sb1), (sa0, sa1), heads
// contiguous; dt_bias, neg_decay: [H] float32; o: [B, T, H, dv]. Returns 0, 1 for an unsupported
// shape (dv not a multiple of 16 up to 512, dk over 512, H not a multiple of Hk), 2 for a slot
// outside the pool (nothing is computed then).
#include <math.h>
#include <stdint.h>

#include <vector>

#include "delta_rule.h"
#include "native/kernels.h"
#include "native/simd.h"

namespace {

constexpr int MAX_DK = 512;
// State elements per thread below which a call runs on one thread: a small model's whole step
// is a few microseconds, less than waking a second thread (the other kernels' grain).
constexpr int64_t GRAIN = 32768;
constexpr float QK_EPS = 1e-6f;           // inside the rsqrt, as fla and transformers
constexpr float SOFTPLUS_THRESHOLD = 20.f;  // torch's default: above it softplus(x) = x

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return simd::bf16_to_float(x); }
inline float rounded(float x, const float*) { return x; }
inline float rounded(float x, const uint16_t*) { return simd::bf16_to_float(simd::float_to_bf16(x)); }

// out = x * rsqrt(sum(x^2) + eps) * factor, x's dk values widened to float32
template <typename T>
void normalized(const T* x, float factor, int dk, float* out) {
  float sum = 0.f;
  for (int i = 0; i < dk; i++) {
    out[i] = to_float(x[i]);
    sum += out[i] * out[i];
  }
  const float r = (1.f / sqrtf(sum + QK_EPS)) * factor;
  for (int i = 0; i < dk; i++) out[i] *= r;
}

template <typename T>
int gdn_decode(const T* u, const T* b_in, const T* a_in, int64_t sb0, int64_t sb1, int64_t sa0, int64_t sa1,
               const float* dt_bias, const float* neg_decay, const float* read_pool, int64_t R, float* pool,
               int64_t S, const int64_t* read_slots, const int64_t* write_slots, T* o, int B, int Tn, int Hk, int H,
               int dk, int dv, float scale, int threads) {
  if (dv % 16 || dv > delta_rule::MAX_DV || dk > MAX_DK || Hk <= 0 || H % Hk) return 1;
  if (delta_rule::check_slots(read_slots, R, write_slots, S, B, Tn)) return 2;
  const int groups = H / Hk;
  const int64_t D = 2 * (int64_t)Hk * dk + (int64_t)H * dv, head_stride = (int64_t)dk * dv;
  const int64_t work = (int64_t)B * H * Tn * head_stride;
  if (work / GRAIN < threads) threads = work < 2 * GRAIN ? 1 : (int)(work / GRAIN);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H, hk = h / groups;
    const float* src = read_pool + (read_slots[b] * H + h) * head_stride;
    std::vector<float> scratch;              // only for skipped writes (padding)
    float k[MAX_DK], q[MAX_DK], v[delta_rule::MAX_DV], ot[delta_rule::MAX_DV];
    for (int t = 0; t < Tn; t++) {
      const T* row = u + ((int64_t)b * Tn + t) * D;
      normalized(row + (int64_t)Hk * dk + (int64_t)hk * dk, 1.f, dk, k);
      normalized(row + (int64_t)hk * dk, scale, dk, q);
      const T* vr = row + 2 * (int64_t)Hk * dk + (int64_t)h * dv;
      for (int j = 0; j < dv; j++) v[j] = to_float(vr[j]);
      const float x = to_float(a_in[b * sa0 + t * sa1 + h]) + dt_bias[h];
      const float softplus = x > SOFTPLUS_THRESHOLD ? x : log1pf(expf(x));
      const float decay = expf(neg_decay[h] * softplus);
      const float beta = rounded(1.f / (1.f + expf(-to_float(b_in[b * sb0 + t * sb1 + h]))), o);
      float* dst = delta_rule::state_to_write(pool, write_slots[(int64_t)b * Tn + t], H, h, head_stride, scratch);
      delta_rule::token(k, q, decay, beta, v, src, dst, ot, dk, dv);
      T* out = o + (((int64_t)b * Tn + t) * H + h) * dv;
      for (int j = 0; j < dv; j += simd::W) simd::store_n(out + j, simd::load(ot + j), simd::W);
      src = dst;
    }
  }
  return 0;
}

}  // namespace

#define ENTRY(name, T)                                                                                     \
  GDN_DECODE_ENTRY(name, T) {                                                                              \
    return gdn_decode(u, b, a, sb0, sb1, sa0, sa1, dt_bias, neg_decay, read_pool, R, pool, S, read_slots,  \
                      write_slots, o, B, Tn, Hk, H, dk, dv, scale, threads);                               \
  }
ENTRY(gdn_decode_f32, float)
ENTRY(gdn_decode_bf16, uint16_t)
