// The SwiGLU MLP's activation on CPU in one call: y = silu(gate) * up for rows [gate | up] of
// the merged gate_up projection's output.
//
// Why: the torch form (kernels/activation/reference.py `silu_mul_torch`: chunk, silu, mul) is three ops
// and two new tensors per MLP, every layer of an eager decode step, where each costs more in
// dispatch and allocation than its few thousand multiplies.
//
// Rounded as the torch ops round (silu_mul.h, shared with the fused MLP). Rows are independent,
// so a row's output does not depend on how many rows a call has or on the thread count.
// x: rows at stride sx (elements), the last dim 2I contiguous; y: [rows, I] contiguous.
#include <stdint.h>

#include "native/kernels.h"
#include "silu_mul.h"

namespace {

// Outputs per thread below which a call runs on one thread (torch's grain; a decode step's
// one row of a small model's MLP is a microsecond).
constexpr int64_t GRAIN = 32768;

template <typename T>
void silu_mul(const T* x, T* y, int rows, int I, int64_t sx, int threads) {
  const int64_t outputs = (int64_t)rows * I;
  if (outputs / GRAIN < threads) threads = outputs < 2 * GRAIN ? 1 : (int)(outputs / GRAIN);
  // row chunks of a whole vector count, so that a single long row splits across threads too
  const int64_t chunk = 4096, chunks_per_row = (I + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < (int64_t)rows * chunks_per_row; c++) {
    const int64_t r = c / chunks_per_row, begin = (c % chunks_per_row) * chunk;
    const int64_t end = begin + chunk < I ? begin + chunk : I;
    silu_mul_span(x + r * sx, x + r * sx + I, y + r * I, begin, end);
  }
}

}  // namespace

void silu_mul_f32(const float* x, float* y, int rows, int I, int64_t sx, int threads) {
  silu_mul(x, y, rows, I, sx, threads);
}
void silu_mul_bf16(const uint16_t* x, uint16_t* y, int rows, int I, int64_t sx, int threads) {
  silu_mul(x, y, rows, I, sx, threads);
}
