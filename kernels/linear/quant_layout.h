// The packed layout of a quantized weight, as kernels/linear/quantized.py `pack` writes it and
// quant_linear.cpp (the products, where the layout is described in full) and quant_rows.cpp (single
// rows) read it: one stream of bytes per block of 16 columns, in units of two groups, each unit
// its float16 scales ([2 groups][16 columns]) and then both groups' codes, in steps of 64 bytes
// that hold 4 consecutive k of each of the 16 columns (a 32-bit lane a column); int8 codes are
// q + 128, int4 nibbles q + 8 (low nibble k = 8 s + j, high k = 8 s + 4 + j of lane byte j).
#pragma once
#include <stddef.h>

namespace quant_layout {

constexpr int BLOCK = 16;              // columns a block holds
constexpr int SCALE_BYTES = 64;        // a unit's scales: 2 groups x 16 columns of float16
constexpr int STEP_BYTES = 64;         // a step of codes: 16 columns x 4 bytes

// what a stored code holds over its value q
constexpr int middle(int bits) { return bits == 8 ? 128 : 8; }

// one group's codes in a block
inline size_t group_code_bytes(int group, int bits) { return (size_t)group * BLOCK * bits / 8; }

// a block's bytes at K input columns (an odd last group makes a unit of its own)
inline size_t block_bytes(int K, int group, int bits) {
  const int groups = K / group;
  return (size_t)(groups + 1) / 2 * SCALE_BYTES + (size_t)groups * group_code_bytes(group, bits);
}

}  // namespace quant_layout
