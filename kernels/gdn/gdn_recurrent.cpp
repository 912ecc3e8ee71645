// The gated delta rule for decode and speculative verify: T tokens per request, each head's
// state read from its read slot and the state after every token written to that token's slot.
//
// Why: at batch 16 of Qwen3.5-0.8B the states are 16 x 18 layers x 1 MB per step, and the torch
// form (a bmm for the two reads, mul_ for the decay, baddbmm_ for the rank-1 update) passes
// over each state five times per token. Here each head's S [dk, dv] is read from memory once
// a token: a block of its columns at a time, for both reads (k^T S, q^T S), then decayed,
// updated and written while the block is still in L1 (delta_rule.h). On small models the gain
// is the op count instead: one call per layer for any batch and draft length, where the torch
// form dispatches ~8 ops per token.
//
// Per request b, head h and token t: the step of delta_rule.h, from the state the previous token
// wrote (the read slot's for the first), to pool[write_slots[b, t]], or to a scratch state when
// that slot is < 0 (skipped). A write slot may equal its own row's read slot (plain decode; a
// verify's first token). Rows run in parallel, so the caller guarantees that no row writes a
// slot another row reads, and that rows write distinct slots; where rows do read what another
// writes, the caller gathers their first states into a copy and passes that as `read_pool`
// (native/ops.cpp).
// kq: [B, T, H, 2, dk] (k, then the scaled q), decay/beta: [B, T, H], v: [B, T, H, dv] float32;
// read_pool: [R, H, dk, dv] float32, row b's first state at read_slots[b] (usually the pool
// itself); pool: [S, H, dk, dv] float32; read_slots: [B], write_slots: [B, T] int64;
// o: [B, T, H, dv]. Returns 0, or 1 for an unsupported dv, 2 for a slot outside its pool
// (nothing is computed then).
// One source for every level: rows of S are walked in vectors of simd::W floats (simd.h).
#include <stdint.h>

#include <vector>

#include "delta_rule.h"
#include "native/kernels.h"

int gdn_recurrent(const float* kq, const float* decay, const float* beta, const float* v,
                  const float* read_pool, int64_t R, float* pool, int64_t S, const int64_t* read_slots,
                  const int64_t* write_slots, float* o, int B, int T, int H, int dk, int dv, int threads) {
  if (dv % 16 || dv > delta_rule::MAX_DV) return 1;
  if (delta_rule::check_slots(read_slots, R, write_slots, S, B, T)) return 2;
  const int64_t head_stride = (int64_t)dk * dv;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H;
    const float* src = read_pool + (read_slots[b] * H + h) * head_stride;
    std::vector<float> scratch;              // only for skipped writes (padding)
    for (int t = 0; t < T; t++) {
      const int64_t bth = ((int64_t)b * T + t) * H + h;   // the index of (b, t, h)
      float* dst = delta_rule::state_to_write(pool, write_slots[(int64_t)b * T + t], H, h, head_stride, scratch);
      const float* k = kq + bth * 2 * dk;
      delta_rule::token(k, k + dk, decay[bth], beta[bth], v + bth * dv, src, dst, o + bth * dv, dk, dv);
      src = dst;
    }
  }
  return 0;
}
