// The GDN layer's causal depthwise conv + SiLU for decode and speculative verify: B rows of T
// new tokens, each row continuing from a window of its last K-1 inputs in a slot pool, the
// window after every token written to that token's slot.
//
// Why: the torch form (kernels/conv/reference.py `causal_conv1d_update`, the reference)
// is ~12 ops per layer (gather, cat, unfold, product, sum, casts, SiLU, one scatter per token),
// each a dispatch and a pass over small tensors: at decode sizes their set-up costs more than
// the arithmetic (K multiply-adds per channel). Here it is one call per layer.
//
// Per row b, token t and channel c, with xx = the window read ++ the row's T inputs:
//   y[b, t, c] = silu(round(sum_j w[c, j] * xx[c, t + j]))     j = 0..K-1, in that order
//   window after token t = xx[c, t+1 .. t+K-1]  -> pool[write[b, t], c, :]  (skipped when < 0)
// The products are rounded one by one and summed in tap order in float32 (the reference's
// `(xx * w).sum(-1)`, bitwise), rounded to the inputs' dtype, then SiLU in float32.
//
// Work item: a chunk of channels (CHUNK_GROUPS groups of simd::W) for every row. Channels never
// mix, so a chunk's reads and writes touch only its own part of each slot: it reads every
// row's window first, then computes and writes token by token (rows in order within a token,
// as the reference's one scatter per token), so any slots may alias (a row writing another's
// read slot included) and the chunks still run in parallel.
//
// The pool keeps each channel's window contiguous ([S, D, K-1]) and the weight each channel's
// taps ([D, K]); a group's are deinterleaved into one vector per tap by register permutes
// (Shuffle) and interleaved back the same way. x: [B, T, D] at row strides (sb, st), channels
// contiguous (a column slice of the layer's projection); y: [B, T, D] contiguous.
// Returns 0, 1 for an unsupported K, 2 for a slot outside the pool (nothing is computed then).
#include <stdint.h>

#include <vector>

#include "native/kernels.h"
#include "native/simd.h"

namespace {

constexpr int V = simd::W;
constexpr int MAX_K = 4;
// Outputs per thread below which a call runs on one thread. An output costs far more here than
// in an elementwise op (the permutes that gather its taps and window, K products, a SiLU and the
// window written back), so the grain is a sixteenth of torch's elementwise one
// (at::internal::GRAIN_SIZE): one decode row of a GDN layer (thousands of channels) runs on two
// threads, which measured faster than one (benchmarks/RESULTS.md, issue 39), while a row of a
// test-sized layer stays on one.
constexpr int64_t GRAIN = 2048;
// Groups per work item: each token's window is written as one run of a slot (CHUNK_GROUPS * V
// channels, 6 KB of float32 at K = 4) rather than a few lines in each of B x T slots at once,
// whose rows sit a multiple of 4 KB apart and so contend for the same L1 sets.
constexpr int CHUNK_GROUPS = 32;

using simd::load_n;
using simd::round_to;
using simd::store_n;

inline int count(int left) { return left < 0 ? 0 : left < V ? left : V; }     // of one vector

// Between a group's interleaved values (flat: channel c's S values at c * S + j, over S vectors)
// and one vector per j (columns: lane c of vector j) in registers: output vector o lane l comes
// from input vector k lane m. Each output is built by two-vector permutes, inputs 0 and 1 first,
// then each later input merged in (a lane keeps what it has or takes the new input's): S - 1
// permutes per output. A fixed table per S and direction, built once.
template <int S>
struct Shuffle {
  int32_t lanes[S][S > 1 ? S - 1 : 1][V];   // [output][step]: indices into (so far ++ input)
  explicit Shuffle(bool to_columns) {
    int source[S][V], lane[S][V];            // output o lane l <- input source lane `lane`
    for (int o = 0; o < S; o++)
      for (int l = 0; l < V; l++) {
        const int e = to_columns ? l * S + o : o * V + l;          // the flat index
        source[o][l] = to_columns ? e / V : e % S;
        lane[o][l] = to_columns ? e % V : e / S;
      }
    for (int o = 0; o < S; o++)
      for (int l = 0; l < V; l++) {
        if (S == 1) { lanes[o][0][l] = lane[o][l]; continue; }
        // step 0 merges inputs 0 and 1; step k - 1 merges input k into the result so far
        lanes[o][0][l] = source[o][l] == 1 ? V + lane[o][l] : source[o][l] == 0 ? lane[o][l] : l;
        for (int k = 2; k < S; k++) lanes[o][k - 1][l] = source[o][l] == k ? V + lane[o][l] : l;
      }
  }
  void apply(const simd::F* in, simd::F* out) const {
    for (int o = 0; o < S; o++) {
      simd::F r = simd::permute2(in[0], in[S > 1 ? 1 : 0], simd::load_bits(lanes[o][0]));
      for (int k = 2; k < S; k++) r = simd::permute2(r, in[k], simd::load_bits(lanes[o][k - 1]));
      out[o] = r;
    }
  }
};

// cols[j] = the vector of p[c * S + j] over the group's n channels, as float (zeros past n).
template <int S, typename T>
inline void deinterleave(const Shuffle<S>& shuffle, const T* p, int n, simd::F* cols) {
  simd::F flat[S];
  for (int i = 0; i < S; i++) flat[i] = load_n(p + i * V, count(n * S - i * V));
  shuffle.apply(flat, cols);
}

// p[c * S + j] = lane c of cols[j], for the group's n channels.
template <int S, typename T>
inline void interleave(const Shuffle<S>& shuffle, const simd::F* cols, int n, T* p) {
  simd::F flat[S];
  shuffle.apply(cols, flat);
  for (int i = 0; i * V < n * S; i++) store_n(p + i * V, flat[i], count(n * S - i * V));
}

template <int K, typename T, typename TW>
void conv_update(const T* x, const TW* weight, T* pool, const int64_t* read, const int64_t* write, T* y,
                 int B, int Tn, int D, int64_t sb, int64_t st, int threads) {
  constexpr int Wn = K - 1;                      // window length
  static const Shuffle<K> tap_columns(true);
  static const Shuffle<Wn> window_columns(true), window_flat(false);
  const int groups = (D + V - 1) / V, chunks = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS;
  const int64_t outputs = (int64_t)B * Tn * D;
  if (outputs / GRAIN < threads) threads = outputs < 2 * GRAIN ? 1 : (int)(outputs / GRAIN);
#pragma omp parallel num_threads(threads)
  {
    // a chunk's taps and every row's window, one vector per tap: [group][j] and [b][group][j]
    std::vector<float> taps((size_t)CHUNK_GROUPS * K * V), windows((size_t)B * CHUNK_GROUPS * Wn * V);
    simd::F cols[MAX_K];
#pragma omp for schedule(static)
    for (int ci = 0; ci < chunks; ci++) {
      const int g0 = ci * CHUNK_GROUPS, ng = groups - g0 < CHUNK_GROUPS ? groups - g0 : CHUNK_GROUPS;
      auto width = [&](int g) { return D - (g0 + g) * V < V ? D - (g0 + g) * V : V; };
      auto window = [&](int b, int g, int j) { return windows.data() + (((size_t)b * CHUNK_GROUPS + g) * Wn + j) * V; };
      for (int g = 0; g < ng; g++) {
        deinterleave(tap_columns, weight + (int64_t)(g0 + g) * V * K, width(g), cols);
        for (int j = 0; j < K; j++) simd::store(taps.data() + ((size_t)g * K + j) * V, cols[j]);
      }
      for (int b = 0; b < B; b++)                // all reads before any write
        for (int g = 0; g < ng; g++) {
          deinterleave(window_columns, pool + (read[b] * D + (int64_t)(g0 + g) * V) * Wn, width(g), cols);
          for (int j = 0; j < Wn; j++) simd::store(window(b, g, j), cols[j]);
        }
      // token by token, rows in order; a row's chunk of each slot written front to back
      for (int t = 0; t < Tn; t++)
        for (int b = 0; b < B; b++) {
          const int64_t slot = write[(int64_t)b * Tn + t];
          for (int g = 0; g < ng; g++) {
            const int c0 = (g0 + g) * V, n = width(g);
            simd::F xx[MAX_K];                   // xx[c, t .. t + K - 1]
            for (int j = 0; j < K; j++) {
              const int i = t + j;
              xx[j] = i < Wn ? simd::load(window(b, g, i)) : load_n(x + b * sb + (i - Wn) * st + c0, n);
            }
            const float* tap = taps.data() + (size_t)g * K * V;
            simd::F acc = simd::mul_rounded(simd::load(tap), xx[0]);
            for (int j = 1; j < K; j++) acc = simd::add(acc, simd::mul_rounded(simd::load(tap + j * V), xx[j]));
            store_n(y + ((int64_t)b * Tn + t) * D + c0, simd::silu(round_to(acc, y)), n);
            if (slot >= 0) interleave(window_flat, xx + 1, n, pool + (slot * D + c0) * Wn);
          }
        }
    }
  }
}

template <typename T, typename TW>
int run(const T* x, const TW* weight, T* pool, const int64_t* read, const int64_t* write, T* y, int64_t S,
        int B, int Tn, int D, int K, int64_t sb, int64_t st, int threads) {
  for (int b = 0; b < B; b++) {
    if (read[b] < 0 || read[b] >= S) return 2;
    for (int t = 0; t < Tn; t++)
      if (write[(int64_t)b * Tn + t] >= S) return 2;
  }
  switch (K) {
    case 2: conv_update<2>(x, weight, pool, read, write, y, B, Tn, D, sb, st, threads); return 0;
    case 3: conv_update<3>(x, weight, pool, read, write, y, B, Tn, D, sb, st, threads); return 0;
    case 4: conv_update<4>(x, weight, pool, read, write, y, B, Tn, D, sb, st, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// One entry per (activation dtype, weight dtype): f32 = float32, bf16 = bfloat16 bits.
#define ENTRY(name, T, TW) \
  CONV_UPDATE_ENTRY(name, T, TW) { return run(x, weight, pool, read, write, y, S, B, Tn, D, K, sb, st, threads); }
ENTRY(conv_update_f32_f32, float, float)
ENTRY(conv_update_bf16_bf16, uint16_t, uint16_t)
ENTRY(conv_update_bf16_f32, uint16_t, float)
ENTRY(conv_update_f32_bf16, float, uint16_t)
