// The register tiles of the blocked products (blocked_linear.cpp's description of the layouts and
// forms holds for them): the float32 / bfloat16 step types, the tile shapes, x's panels, the
// per-thread scratch buffers and one group of blocks against every panel of x. Shared by the
// float kernels (blocked_linear.cpp) and the quantized ones (quant_linear.cpp), which widen their
// weights into float32 blocks and run these same tiles on them for many rows of x.
#pragma once
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "native/simd.h"

#define PREFETCH_DISTANCE 32   // in k steps, i.e. 32 cache lines ahead in each W stream
// Weight streams are prefetched into L2 (prefetcht1, here and in quant_linear.cpp): into L1 the
// misses in flight were too few, and one core read its weights at 60-85% of a plain read's
// bandwidth (benchmarks/RESULTS.md, issue 39).
constexpr auto PREFETCH_HINT = _MM_HINT_T1;

constexpr int VB = 16 / simd::W;              // vectors per 16-column block
// Rows of x per pass. AVX2 6: MTP verify's 5 rows (k = 4) and 6 take one pass of one-block tiles
// (12 accumulators), not a 4-row pass and a second pass over W (the default model's 4 shapes at
// 5 rows, 2 threads, 3 rounds of processes interleaved: 0.53-0.73x the time in 10 of the 12,
// 1.02-1.15x in 2).
constexpr int PANEL = simd::W == 16 ? 8 : 6;
// rows of x in panel p of M rows (the last may hold fewer)
static inline int panel_rows(int M, int p) { return M - p * PANEL < PANEL ? M - p * PANEL : PANEL; }

// The float32 and bfloat16 forms of one k step, on one 64-byte run of W per block: float32
// holds 16 columns at one k, bfloat16 16 columns at two k. `WV` is one vector of W as the FMAs
// take it, `XB` one broadcast element of x.
struct F32 {
  using W = float;
  using X = float;
  using Y = float;
  using WV = simd::F;
  using XB = simd::F;
  static constexpr int K_PER_STEP = 1;
  static constexpr int REGS_PER_WV = 1;
  static inline WV load(const float* p) { return simd::load(p); }
  static inline XB broadcast(X x) { return simd::set1(x); }
  static inline simd::F fma(simd::F acc, XB x, WV w) { return simd::fmadd(x, w, acc); }
  static inline void store(float* y, simd::F v) { simd::store(y, v); }
  static inline X pack_x(const float* row, int K, int k) { return row[k]; }
};
struct BF16 {
  using W = uint16_t;
  using X = uint32_t;                       // two bf16 of x: k (low half) and k+1
  using Y = uint16_t;
  static constexpr int K_PER_STEP = 2;
#ifdef __AVX512BF16__
  using WV = __m512i;
  using XB = __m512i;
  static constexpr int REGS_PER_WV = 1;
  static inline WV load(const uint16_t* p) { return simd::load_bits(p); }
  static inline XB broadcast(X x) { return _mm512_set1_epi32((int)x); }
  static inline simd::F fma(simd::F acc, XB x, WV w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
#else
  struct WV { simd::F low, high; };         // the even-k and odd-k weights, widened
  struct XB { simd::F low, high; };
  static constexpr int REGS_PER_WV = 2;
  static inline WV load(const uint16_t* p) {
    simd::I pairs = simd::load_bits(p);
    return {simd::low_bf16(pairs), simd::high_bf16(pairs)};
  }
  static inline XB broadcast(X x) {
    return {simd::set1(simd::bits_to_float(x << 16)), simd::set1(simd::bits_to_float(x & 0xFFFF0000u))};
  }
  static inline simd::F fma(simd::F acc, XB x, WV w) {
    return simd::fmadd(x.high, w.high, simd::fmadd(x.low, w.low, acc));
  }
#endif
  static inline void store(uint16_t* y, simd::F v) { simd::store_bf16(y, v); }
  static inline X pack_x(const uint16_t* row, int K, int k2) {
    uint32_t lo = row[2 * k2], hi = 2 * k2 + 1 < K ? row[2 * k2 + 1] : 0;
    return lo | (hi << 16);
  }
};
// The widened bfloat16 form: float32 tiles on W widened into a buffer, y rounded to bf16.
struct WidenedBF16 : F32 {
  using Y = uint16_t;
  static inline void store(uint16_t* y, simd::F v) { simd::store_bf16(y, v); }
  static inline X pack_x(const uint16_t* row, int K, int k) { return simd::bits_to_float((uint32_t)row[k] << 16); }
};

// Blocks of W per tile for M rows. Up to 4 rows (decode, MTP verify) the product is bound by
// memory, not by registers: 4 blocks per tile keep more streams of W in flight, even where AVX2's
// accumulators then spill to L1 (measured at 0.8B shapes, 1 thread, against the register rule
// below: AVX2 bf16 +10-17% at 1 row, +25-50% at 2, +20-35% at 3-4; AVX2 float32 +0-5% at 1 row,
// +25-40% at 3-4; AVX-512 at 3-4 rows +5-15%). AVX2 narrows to 3 blocks at 3 rows and 2 at 4: at 4
// rows 3 and 4 blocks spill more than the extra streams win (0.8B shapes streamed from memory, 2
// threads, medians interleaved: 2 blocks 0.88-0.91x the time of 3 in float32, 0.97x in bf16; the
// default model's cache-resident shapes 0.78-1.02x). Beyond 4 rows, with one-register W vectors on
// AVX-512: 8x2 up to 8 rows, 8x3 passes for more (as measured); otherwise the widest tile whose
// accumulators (MR x NR x VB), W vectors and x broadcast fit the registers (AVX2: one block for
// panels of 5-6 rows).
template <typename T>
static int blocks_per_tile(int M) {
  if (M <= 4) return simd::W == 16 || M <= 2 ? 4 : M == 3 ? 3 : 2;
  if (simd::W == 16 && T::REGS_PER_WV == 1) return M <= 8 ? 2 : 3;
  const int rows = M < PANEL ? M : PANEL;
  for (int nr = 4; nr > 1; nr--)
    if (rows * nr * VB + nr * VB * T::REGS_PER_WV + 2 <= simd::REGISTERS) return nr;
  return 1;
}

// The same for a product of `blocks` blocks on `threads` threads: up to 4 rows, where the tile
// shape matters little (the rule above: +0-5% at 1 row), the widest tile at most that wide whose
// groups split most evenly over the threads (each thread starts on a run of its own:
// stealing_ranges.h). The default model's 192-column products are 12 blocks: 3 groups of 4 put 8
// blocks on one of 2 threads, 4 groups of 3 put 6 on each. Each output is the same FMA chain in
// any tile: the same values.
template <typename T>
static int balanced_blocks_per_tile(int M, int blocks, int threads) {
  const int widest = blocks_per_tile<T>(M);
  if (M > 4 || threads < 2) return widest;
  int best = widest, best_load = blocks + 1;
  for (int nr = widest; nr >= 2; nr--) {
    const int groups = (blocks + nr - 1) / nr;
    const int busiest = ((groups + threads - 1) / threads) * nr;   // blocks on the busiest thread
    const int load = busiest < blocks ? busiest : blocks;
    if (load < best_load) best = nr, best_load = load;
  }
  return best;
}

// One tile: rows [0, rows) of the panel xp ([steps][PANEL]) against NR blocks of W starting at
// w ([NR][steps][64 bytes]); writes y rows (row stride N) from column n0.
template <int MR, int NR, typename T>
static inline void tile(const typename T::X* xp, const typename T::W* w, int steps,
                        typename T::Y* y, int N, int n0, int rows, bool prefetch) {
  constexpr int LANE = 16 * T::K_PER_STEP;   // elements of W per block and step (64 bytes)
  constexpr int PER_VECTOR = LANE / VB;
  simd::F acc[MR][NR * VB];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR * VB; j++) acc[r][j] = simd::zero();
  for (int k = 0; k < steps; k++) {
    typename T::WV wv[NR * VB];
    for (int j = 0; j < NR; j++) {
      const typename T::W* p = w + ((size_t)j * steps + k) * LANE;
      for (int v = 0; v < VB; v++) wv[j * VB + v] = T::load(p + v * PER_VECTOR);
      if (prefetch) _mm_prefetch((const char*)(p + PREFETCH_DISTANCE * LANE), PREFETCH_HINT);
    }
    for (int r = 0; r < MR; r++) {
      const typename T::XB xb = T::broadcast(xp[(size_t)k * PANEL + r]);
      for (int j = 0; j < NR * VB; j++) acc[r][j] = T::fma(acc[r][j], xb, wv[j]);
    }
  }
  for (int r = 0; r < MR && r < rows; r++)
    for (int j = 0; j < NR * VB; j++) {
      const int n = n0 + j * simd::W;
      if (n >= N) break;
      T::store(y + (size_t)r * N + n, acc[r][j]);
    }
}

template <int NR, typename T>
static inline void tile_rows(int rows, const typename T::X* xp, const typename T::W* w, int steps,
                             typename T::Y* y, int N, int n0, bool prefetch) {
  switch (rows) {
    case 1: tile<1, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
    case 2: tile<2, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
    case 3: tile<3, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
  }
  if constexpr (PANEL > 4) {
    switch (rows) {
      case 4: tile<4, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
      case 5: tile<5, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
      case 6: tile<6, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
      case 7: tile<7, NR, T>(xp, w, steps, y, N, n0, rows, prefetch); return;
    }
  }
  tile<PANEL, NR, T>(xp, w, steps, y, N, n0, rows, prefetch);
}

// A buffer for one call's packed x (or the MLP's intermediates), 64-byte aligned. Up to
// SCRATCH_KEEP bytes it is the calling thread's buffer for that slot, kept across calls: a decode
// step makes about 40 of these calls, and allocating and freeing their few KB each time was 2% of
// the default model's compiled step (aligned_alloc splits and merges chunks). Larger ones
// (prefill) are allocated per call, so no thread keeps megabytes. Slots: the callers that hold
// one while calling another kernel (the MLP's many-rows form) use different slots.
constexpr size_t SCRATCH_KEEP = 256 << 10;
enum ScratchSlot { SCRATCH_X, SCRATCH_MLP_H, SCRATCH_MLP_A, SCRATCH_SLOTS };
class Scratch {
 public:
  Scratch(ScratchSlot slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > SCRATCH_KEEP) {
      p_ = own_ = aligned_alloc(64, bytes);
      return;
    }
    Kept& kept = kept_[slot];
    if (kept.size < bytes) {               // grown to twice the need, so a few sizes settle it
      free(kept.p);
      kept.size = SCRATCH_KEEP < 2 * bytes ? SCRATCH_KEEP : 2 * bytes;
      kept.p = aligned_alloc(64, kept.size);
    }
    p_ = kept.p;
  }
  ~Scratch() { free(own_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(p_); }

 private:
  struct Kept {
    void* p = nullptr;
    size_t size = 0;
    ~Kept() { free(p); }
  };
  static thread_local Kept kept_[SCRATCH_SLOTS];
  void* p_ = nullptr;
  void* own_ = nullptr;
};
// one set per thread, shared by the files that include this header (inline: defined once)
inline thread_local Scratch::Kept Scratch::kept_[SCRATCH_SLOTS];

// x [M][K] (float32 or bf16 rows) -> panels [ceil(M/PANEL)][steps][PANEL] of T::X at xp. A last
// panel of fewer than PANEL rows is written only in its rows: every tile reads only the rows it
// has (tile_rows), and at a decode's one row five of every six stores were padding (AVX2).
template <typename T>
static size_t panels_bytes(int M, int steps) {
  return ((size_t)((M + PANEL - 1) / PANEL) * steps * PANEL * sizeof(typename T::X) + 63) / 64 * 64;
}
template <typename T, typename XIn>
static void pack_panels_into(const XIn* x, int M, int K, int steps, typename T::X* xp) {
  const int panels = (M + PANEL - 1) / PANEL;
  for (int p = 0; p < panels; p++) {
    const int rows = panel_rows(M, p);
    for (int k = 0; k < steps; k++)
      for (int r = 0; r < rows; r++)
        xp[((size_t)p * steps + k) * PANEL + r] = T::pack_x(x + (size_t)(p * PANEL + r) * K, K, k);
  }
}
// the same into the calling thread's scratch buffer `xs`
template <typename T, typename XIn>
static typename T::X* pack_panels(const XIn* x, int M, int K, int steps, const Scratch& xs) {
  typename T::X* xp = xs.as<typename T::X>();
  pack_panels_into<T>(x, M, K, steps, xp);
  return xp;
}

// Every panel of x against one group of nb <= 4 blocks of W (wg: [nb][steps][64 bytes]).
// The software prefetch is left out on AVX2 below PREFETCH_FROM_ROWS rows on AMD's cores: there
// the loads of 4 streams alone keep the memory busy, and the prefetches cost more than they win
// (Zen 3, 0.8B, batch-1 decode interleaved with the prefetching kernel, 12 pairs: fp32 1.04x,
// bf16 1.03x; from 3 rows a C model of the tile ran faster with them). Intel's cores need them:
// the AVX2 build on a Xeon (AVX-512 machine, level avx2), 0.8B batch-1 decode interleaved with
// the kernel without them, 10 pairs: bf16 1.155x (1.12-1.17), fp32 1.035x; bf16 products alone
// 24-26 -> 26-28 GB/s (a plain read loop: 30). AVX-512 keeps them at every M.
constexpr int PREFETCH_FROM_ROWS = 3;
static bool prefetch_every_row_count() {
  static const bool yes = [] { __builtin_cpu_init(); return !__builtin_cpu_is("amd"); }();
  return yes;
}
template <typename T>
static void group_product(int nb, const typename T::X* xp, const typename T::W* wg, int steps,
                          typename T::Y* y, int M, int N, int n0) {
  const bool prefetch = simd::W == 16 || M >= PREFETCH_FROM_ROWS || prefetch_every_row_count();
  const int panels = (M + PANEL - 1) / PANEL;
  for (int p = 0; p < panels; p++) {
    const int rows = panel_rows(M, p);
    const typename T::X* xs = xp + (size_t)p * steps * PANEL;
    typename T::Y* ys = y + (size_t)p * PANEL * N;
    if (nb == 4) tile_rows<4, T>(rows, xs, wg, steps, ys, N, n0, prefetch);
    else if (nb == 3) tile_rows<3, T>(rows, xs, wg, steps, ys, N, n0, prefetch);
    else if (nb == 2) tile_rows<2, T>(rows, xs, wg, steps, ys, N, n0, prefetch);
    else tile_rows<1, T>(rows, xs, wg, steps, ys, N, n0, prefetch);
  }
}
