// silu(gate) * up over one span of a row, as silu_mul.cpp and the fused MLP (blocked_linear.cpp
// `blocked_mlp`) both compute it: one definition, so the MLP's activation rounds exactly as the
// standalone op's does and a fused step gives the unfused step's values bitwise.
//
// Rounded as the torch ops round: in float32, silu = x / (1 + e^-x) (simd::exp takes the steps
// of the SLEEF exp torch's vectorized SiLU calls) times up; in bf16, silu rounded to bf16, then
// the product of the two bf16 values rounded again.
#pragma once
#include <stdint.h>

#include "native/simd.h"

template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += simd::W) {
    const int n = end - i < simd::W ? (int)(end - i) : simd::W;
    const simd::F s = simd::round_to(simd::silu(simd::load_n(gate + i, n)), out);
    simd::store_n(out + i, simd::mul(s, simd::load_n(up + i, n)), n);
  }
}
