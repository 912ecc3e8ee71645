// y[M, N] = x[M, K] @ W^T for a few rows of x, with W stored in 16-column blocks.
//
// Why: batch-1 and small-batch decode on a CPU is a stream of every weight once per step. In a
// blocked layout W_blocked[N/16][K][16] each thread reads one contiguous run of memory, and the
// vectors of W feed the FMAs of every row of x at once, so 4-32 rows cost little more than one
// (MKL's GEMM at 4-16 rows streams at about half the rate of its GEMV). Software prefetch keeps
// a few KB of each stream in flight: without it the 16-row case ran at 60% of this speed
// (AVX2 at 1-2 rows on AMD's cores goes without: group_product).
//
// One source for every level (simd.h): a 16-column block is 16 / simd::W vectors (one on
// AVX-512, two on AVX2). Register tiles: MR rows of x (broadcast one at a time) times NR blocks
// of W, chosen so the accumulators and W's vectors fit the level's registers (`blocks_per_tile`).
// x is first repacked into panels of PANEL rows [ceil(M/PANEL)][K][PANEL] so a pass reads it
// contiguously.
//
// float32: W_blocked [N/16][K][16], x and y float32, FMAs on broadcast floats of x.
// bfloat16: W in pairs of k, [N/16][ceil(K/2)][16][2] (odd K padded with a zero column), the
// layout AVX512-BF16's dot product reads: one vdpbf16ps multiplies 16 columns by two k at once,
// accumulating in float32. Without AVX512-BF16 the same pairs are widened in registers (the low
// bf16 of each 32-bit pair shifted up, the high one masked) and take two FMAs: the weights are
// still read at half float32's bytes. x is repacked into pairs, y rounded to bf16 (nearest
// even) at the end. With vdpbf16ps, faster than oneDNN's AMX kernel at 1-4 rows (26-28 vs 18-20
// GB/s at 0.8B shapes), slower from 8-16 rows on, so callers keep oneDNN for more rows where
// they have it.
// bfloat16, widened (`blocked_linear_bf16_widened`): for many rows of x where the level has no
// bf16 dot product (AVX2). Widening in registers costs two ALU ops beside every FMA pair, and the
// broadcasts of x two more: at 512 rows 1.5-1.8x slower than float32. Instead each thread widens
// the group of blocks it works on into a float32 buffer of its own once per call ([NR][K][16],
// at most ~1 MB: it stays in L2 across all panels of x) and runs the float32 tiles on it, x
// widened once into float32 panels. The same float32 FMAs in the same k order as the register
// form: identical results, at about float32's speed (the widening is O(N K), the product O(M N K)).
// On AVX2 from MANY_ROWS rows it takes the float32 many-rows form below on widened runs of
// blocks instead (as float32 does there: 1.45-1.7x the group form at 512 rows of 0.8B shapes).
// N is a multiple of 16 (the caller blocks whole columns only).
#include <stdint.h>
#include <stdlib.h>

#include <omp.h>

#include "activation/silu_mul.h"
#include "linear/blocked_tiles.h"
#include "native/kernels.h"
#include "native/simd.h"
#include "native/stealing_ranges.h"

// The tiles, x's panels and the scratch buffers: blocked_tiles.h.

// ---- many rows of x (prefill), float32 on AVX2 -------------------------------------------------
// The form above runs every panel of x over the whole K of a group of W's blocks: at 512 rows on
// AVX2 its 4 x 16 tiles (8 accumulators) reach about 0.8-0.9x of MKL's AVX2 sgemm. From MANY_ROWS
// rows on, AVX2 takes this form instead: 6 x 16 tiles (12 accumulators, 2 W vectors, 1 broadcast:
// the 16 registers, MKL's AVX2 shape), and K cut into slices of KC, so one block's slice of W
// (KC x 64 bytes) stays in L1 while the panels of a block of rows pass over it, and that row
// block's slice of x (at most MAX_BLOCK_ROWS x KC floats, about 1 MB) stays in L2. After the first
// slice a tile's accumulators start from y, prefetched one panel ahead (without it the wait for y
// cost more than the slicing won: slices of 64-128 k ran slower than none). Each output is the
// same chain of FMAs in k order as in the form above: the same results bitwise, at any M.
// Measured at 512 rows of the 0.8B shapes, 1 thread, alternating in one process: 1.1-1.25x the
// form above, on par with MKL (KC 512 against 256 and 1024). AVX-512 keeps the form above: its
// 8 x 48 tiles already run at MKL's speed there, and this slicing made them 5-15% slower.
constexpr int MANY_ROWS = 64;
constexpr int MANY_MR = 6;                                 // rows of x per tile
constexpr int KC = 512;                                    // k per slice: W's slice 32 KB
constexpr int MAX_BLOCK_ROWS = 1024 * 1024 / (KC * 4);     // x's slice of a row block: ~1 MB

// One tile over one slice: the MANY_MR rows of the panel slice xs ([kc][MANY_MR], zero rows past
// `rows`) times one block's slice of W (w: [kc][16]) -> y rows [0, rows) at columns n0..n0+15
// (row stride N); from_y: the accumulators start from y.
static inline void slice_tile(const float* xs, const float* w, int kc, float* y, int N, int n0,
                              int rows, bool from_y) {
  constexpr int MR = MANY_MR;
  simd::F acc[MR][VB];
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < VB; v++)
      acc[r][v] = from_y && r < rows ? simd::load(y + (size_t)r * N + n0 + v * simd::W) : simd::zero();
  for (int k = 0; k < kc; k++) {
    simd::F wv[VB];
    for (int v = 0; v < VB; v++) wv[v] = simd::load(w + (size_t)k * 16 + v * simd::W);
    for (int r = 0; r < MR; r++) {
      const simd::F xb = simd::set1(xs[(size_t)k * MR + r]);
      for (int v = 0; v < VB; v++) acc[r][v] = simd::fmadd(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR && r < rows; r++)
    for (int v = 0; v < VB; v++) simd::store(y + (size_t)r * N + n0 + v * simd::W, acc[r][v]);
}

// Rows [0, M) of x against W's blocks [b_begin, b_end), slice by slice; xp: these rows packed
// [slices][panels][kc][MANY_MR] (the last slice's kc = K - its start); w: block b_begin's first
// float, the run's blocks after it ([b_end - b_begin][K][16]).
static void row_block_product(const float* xp, const float* w, float* y, int M, int N, int K,
                              int b_begin, int b_end) {
  constexpr int MR = MANY_MR;
  const int panels = (M + MR - 1) / MR;
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int kc = K - k0 < KC ? K - k0 : KC;
    const float* xs = xp + (size_t)k0 * panels * MR;
    for (int b = b_begin; b < b_end; b++) {
      const float* wb = w + ((size_t)(b - b_begin) * K + k0) * 16;
      for (int p = 0; p < panels; p++) {
        const int rows = M - p * MR < MR ? M - p * MR : MR;
        if (k0 > 0)
          for (int m = (p + 1) * MR; m < (p + 2) * MR && m < M; m++)
            _mm_prefetch((const char*)(y + (size_t)m * N + b * 16), _MM_HINT_T0);
        slice_tile(xs + (size_t)p * kc * MR, wb, kc, y + (size_t)p * MR * N, N, b * 16, rows, k0 > 0);
      }
    }
  }
}

static inline float as_float(float v) { return v; }
static inline float as_float(uint16_t v) { return simd::bits_to_float((uint32_t)v << 16); }
static void widen_blocks(const uint16_t* w, float* out, int nb, int K);

// float32 W: each thread's run of blocks is read where it lies. bf16 W (pairs of k, as
// blocked_linear_bf16 takes them): each thread widens its run once per call into a float32
// buffer of its own; at the many rows this form takes, the O(N K) widening is a few percent of
// the O(M N K) product. The columns go in chunks whose widened runs stay under WIDENED_BYTES
// per thread, where they stay in cache until the tiles read them (AVX2, 0.8B shapes, 64-512
// rows: 0.90-1.04x the float32 form's time, against 0.75-0.94x with 4 MB and 0.46-0.97x with
// the whole run at once; a 248320-row lm_head's whole run would be 0.5 GB a thread).
constexpr size_t WIDENED_BYTES = 2 << 20;
static int chunk_blocks(const float*, int blocks, int, int) { return blocks; }
static int chunk_blocks(const uint16_t*, int blocks, int K, int threads) {
  const int per_thread = (int)(WIDENED_BYTES / ((size_t)K * 16 * sizeof(float)));
  return per_thread < 1 ? threads : per_thread * threads;
}
static const float* thread_blocks(const float* w, int K, int b_begin, int, float*) {
  return w + (size_t)b_begin * K * 16;
}
static const float* thread_blocks(const uint16_t* w, int K, int b_begin, int b_end, float* buffer) {
  widen_blocks(w + (size_t)b_begin * ((K + 1) / 2) * 32, buffer, b_end - b_begin, K);
  return buffer;
}

// x [M][K] float32 or bf16, W float32 blocked or bf16 pairs, y [M][N] float32 or bf16 (y_acc: a
// float32 [M][N] buffer the tiles accumulate in where y is bf16, each thread rounding its own
// columns into y at the end: the same float32 sums as the float32 form, rounded once).
template <typename XIn, typename WIn, typename YOut>
static void blocked_linear_many_rows(const XIn* x, const WIn* w, YOut* y, float* y_acc, int M, int N, int K,
                                     int num_threads) {
  constexpr int MR = MANY_MR;
  // rows in equal blocks of whole panels, each at most about MAX_BLOCK_ROWS
  const int row_blocks = (M + MAX_BLOCK_ROWS - 1) / MAX_BLOCK_ROWS;
  const int block_rows = ((M + row_blocks - 1) / row_blocks + MR - 1) / MR * MR;
  float* xp = (float*)aligned_alloc(64, ((size_t)block_rows * K * sizeof(float) + 63) / 64 * 64);
  const int blocks = N / 16;
  const int chunk = chunk_blocks(w, blocks, K, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float* widened = sizeof(WIn) == 2 ? (float*)aligned_alloc(
        64, ((size_t)((chunk + nt - 1) / nt) * K * 16 * sizeof(float) + 63) / 64 * 64) : nullptr;
    for (int c0 = 0; c0 < blocks; c0 += chunk) {
      const int c1 = blocks - c0 < chunk ? blocks : c0 + chunk;
      // each thread its own contiguous run of blocks: its share of W streams once per row block
      const int b_begin = c0 + (int)((long)(c1 - c0) * t / nt), b_end = c0 + (int)((long)(c1 - c0) * (t + 1) / nt);
      const float* wt = thread_blocks(w, K, b_begin, b_end, widened);
      for (int m0 = 0; m0 < M; m0 += block_rows) {
        const int rows = M - m0 < block_rows ? M - m0 : block_rows;
        const int panels = (rows + MR - 1) / MR;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++)
          for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            float* dst = xp + (size_t)k0 * panels * MR + (size_t)p * kc * MR;
            for (int k = 0; k < kc; k++)
              for (int r = 0; r < MR; r++) {
                const int m = p * MR + r;
                dst[(size_t)k * MR + r] = m < rows ? as_float(x[(size_t)(m0 + m) * K + k0 + k]) : 0.0f;
              }
          }
        // (the loop's implicit barrier: every panel is packed before any thread reads them)
        row_block_product(xp, wt, y_acc + (size_t)m0 * N, rows, N, K, b_begin, b_end);
#pragma omp barrier
      }
      if constexpr (sizeof(YOut) == 2)
        for (int m = 0; m < M; m++)
          for (int n = b_begin * 16; n < b_end * 16; n += simd::W)
            simd::store_bf16((uint16_t*)y + (size_t)m * N + n, simd::load(y_acc + (size_t)m * N + n));
    }
    free(widened);
  }
  free(xp);
}

template <typename T>
static void blocked_linear(const typename T::W* x, const typename T::W* w, typename T::W* y,
                           int M, int N, int K, int num_threads) {
  const int steps = (K + T::K_PER_STEP - 1) / T::K_PER_STEP;
  const Scratch xs(SCRATCH_X, panels_bytes<T>(M, steps));
  typename T::X* xp = pack_panels<T>(x, M, K, steps, xs);
  const int blocks = N / 16;
  const int NR = balanced_blocks_per_tile<T>(M, blocks, num_threads);
  const int groups = (blocks + NR - 1) / NR;
  constexpr int LANE = 16 * T::K_PER_STEP;
  native::StealingRanges work(groups, num_threads);    // as the quantized products share theirs
#pragma omp parallel num_threads(num_threads)
  for (native::StealingRanges::Cursor items(work, omp_get_thread_num()); items.next();) {
    const int g = items.item(), b0 = g * NR;
    const int nb = blocks - b0 < NR ? blocks - b0 : NR;
    group_product<T>(nb, xp, w + (size_t)b0 * steps * LANE, steps, y, M, N, b0 * 16);
  }
}

// nb blocks of bf16 pairs [nb][ceil(K/2)][16][2] -> float32 [nb][K][16] (the padded k dropped)
static void widen_blocks(const uint16_t* w, float* out, int nb, int K) {
  const int steps = (K + 1) / 2;
  for (int j = 0; j < nb; j++)
    for (int k2 = 0; k2 < steps; k2++) {
      const uint16_t* src = w + ((size_t)j * steps + k2) * 32;
      float* even = out + ((size_t)j * K + 2 * k2) * 16;
      for (int v = 0; v < VB; v++) {
        const simd::I pairs = simd::load_bits(src + v * 2 * simd::W);
        simd::store(even + v * simd::W, simd::low_bf16(pairs));
        if (2 * k2 + 1 < K) simd::store(even + 16 + v * simd::W, simd::high_bf16(pairs));
      }
    }
}

static void blocked_linear_widened(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                   int M, int N, int K, int num_threads) {
  if (simd::W == 8 && M >= MANY_ROWS) {
    float* acc = (float*)aligned_alloc(64, ((size_t)M * N * sizeof(float) + 63) / 64 * 64);
    blocked_linear_many_rows(x, w, y, acc, M, N, K, num_threads);
    free(acc);
    return;
  }
  const Scratch xs(SCRATCH_X, panels_bytes<WidenedBF16>(M, K));
  float* xp = pack_panels<WidenedBF16>(x, M, K, K, xs);
  const int blocks = N / 16;
  const int NR = blocks_per_tile<WidenedBF16>(M);
  const int groups = (blocks + NR - 1) / NR;
  const size_t pair_steps = (K + 1) / 2;
#pragma omp parallel num_threads(num_threads)
  {
    float* wf = (float*)aligned_alloc(64, ((size_t)NR * K * 16 * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
      const int b0 = g * NR;
      const int nb = blocks - b0 < NR ? blocks - b0 : NR;
      widen_blocks(w + (size_t)b0 * pair_steps * 32, wf, nb, K);
      group_product<WidenedBF16>(nb, xp, wf, K, y, M, N, b0 * 16);
    }
    free(wf);
  }
}

// ---- the SwiGLU MLP in one call ------------------------------------------------------------
// y = (silu(gate) * up) Wd^T, [gate | up] = x Wgu^T, for the few rows of a decode or verify step.
// Why: for a small model each of the three calls (two products and the activation) costs more in
// dispatch, output allocation and its OpenMP fork/join than its arithmetic: one region instead
// of three, one call instead of three through the dispatcher of a compiled step. The products run
// the same tiles over the same groups of blocks as `blocked_linear` (each output is one tile's
// FMA chain, whichever thread runs it) and the activation is silu_mul.h: the same values as the
// three calls, bitwise. Many rows (prefill) take the three calls themselves: there each is long
// and has forms of its own (the AVX2 many-rows form).
constexpr int MLP_FUSED_MAX_ROWS = MANY_ROWS - 1;

template <typename T>
static void blocked_mlp(const typename T::W* x, const typename T::W* wgu, const typename T::W* wd,
                        typename T::W* y, int M, int H, int I, int N, int num_threads) {
  using W = typename T::W;
  using X = typename T::X;
  constexpr int LANE = 16 * T::K_PER_STEP;
  const int steps_x = (H + T::K_PER_STEP - 1) / T::K_PER_STEP, steps_a = (I + T::K_PER_STEP - 1) / T::K_PER_STEP;
  const Scratch xs(SCRATCH_X, panels_bytes<T>(M, steps_x)), acts(SCRATCH_MLP_A, panels_bytes<T>(M, steps_a)),
      hs(SCRATCH_MLP_H, (size_t)M * 3 * I * sizeof(W));
  X* xp = pack_panels<T>(x, M, H, steps_x, xs);
  X* ap = acts.as<X>();
  W* h = hs.as<W>();                    // [gate | up] rows, then the activation's rows
  W* a = h + (size_t)M * 2 * I;
  const int gu_blocks = 2 * I / 16, d_blocks = N / 16;
  const int gu_nr = balanced_blocks_per_tile<T>(M, gu_blocks, num_threads), gu_groups = (gu_blocks + gu_nr - 1) / gu_nr;
  const int d_nr = balanced_blocks_per_tile<T>(M, d_blocks, num_threads), d_groups = (d_blocks + d_nr - 1) / d_nr;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int g = 0; g < gu_groups; g++) {
      const int b0 = g * gu_nr, nb = gu_blocks - b0 < gu_nr ? gu_blocks - b0 : gu_nr;
      group_product<T>(nb, xp, wgu + (size_t)b0 * steps_x * LANE, steps_x, h, M, 2 * I, b0 * 16);
    }
    // (the loop's barrier: all of [gate | up] is written.) One thread forms the activation's
    // panels, a few hundred to a few thousand elements a row: less than another barrier's wait.
#pragma omp single
    {
      for (int m = 0; m < M; m++) silu_mul_span(h + (size_t)m * 2 * I, h + (size_t)m * 2 * I + I, a + (size_t)m * I, 0, I);
      pack_panels_into<T>(a, M, I, steps_a, ap);
    }
#pragma omp for schedule(static)
    for (int g = 0; g < d_groups; g++) {
      const int b0 = g * d_nr, nb = d_blocks - b0 < d_nr ? d_blocks - b0 : d_nr;
      group_product<T>(nb, ap, wd + (size_t)b0 * steps_a * LANE, steps_a, y, M, N, b0 * 16);
    }
  }
}

// ---- rows of a blocked weight --------------------------------------------------------------
// W[ids] [n][K] back from the blocks: a tied embedding table whose only copy is the blocked
// lm_head. Why native: as torch indexing (the shift-and-mask gather), inductor inlines the gather
// into every consumer of the embedding, each a loop of masked 8-lane index vectors over K for a
// single token (in the default model's compiled step two such kernels took 5% of the main
// thread); one call writes the rows once. Row id's element k: float32 W[id >> 4][k][id & 15],
// bf16 pairs W[id >> 4][k >> 1][id & 15][k & 1]. -> 0, or 1 where an id is outside [0, N).
template <typename Wt>
static int blocked_rows(const Wt* w, const int64_t* ids, Wt* out, int n, int K, int64_t N, int steps, int per_step) {
  for (int i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= N) return 1;
  for (int i = 0; i < n; i++) {
    const Wt* block = w + (size_t)(ids[i] >> 4) * steps * 16 * per_step + (ids[i] & 15) * per_step;
    Wt* row = out + (size_t)i * K;
    for (int k = 0; k < K; k++) row[k] = block[(size_t)(k / per_step) * 16 * per_step + k % per_step];
  }
  return 0;
}

// The fused form for few rows; for many, the three calls themselves (`linear` and `silu` are
// this file's and silu_mul.cpp's entries for T's dtype), through the same intermediate buffer.
template <typename T, typename W = typename T::W>
static int mlp_entry(const W* x, const W* wgu, const W* wd, W* y, int M, int H, int I, int N, int threads,
                     int (*linear)(const W*, const W*, W*, int, int, int, int),
                     void (*silu)(const W*, W*, int, int, int64_t, int)) {
  if (M <= MLP_FUSED_MAX_ROWS) {
    blocked_mlp<T>(x, wgu, wd, y, M, H, I, N, threads);
    return 0;
  }
  const Scratch hs(SCRATCH_MLP_H, (size_t)M * 3 * I * sizeof(W));
  W* h = hs.as<W>();
  linear(x, wgu, h, M, 2 * I, H, threads);
  silu(h, h + (size_t)M * 2 * I, M, I, 2 * I, threads);
  linear(h + (size_t)M * 2 * I, wd, y, M, N, I, threads);
  return 0;
}

extern "C" {
int blocked_rows_f32(const float* w, const int64_t* ids, float* out, int n, int K, int64_t N) {
  return blocked_rows(w, ids, out, n, K, N, K, 1);
}
int blocked_rows_bf16(const uint16_t* w, const int64_t* ids, uint16_t* out, int n, int K, int64_t N) {
  return blocked_rows(w, ids, out, n, K, N, (K + 1) / 2, 2);
}
int blocked_linear_f32(const float* x, const float* w, float* y, int M, int N, int K, int threads) {
  if (simd::W == 8 && M >= MANY_ROWS) blocked_linear_many_rows(x, w, y, y, M, N, K, threads);
  else blocked_linear<F32>(x, w, y, M, N, K, threads);
  return 0;
}
int blocked_linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K, int threads) {
  blocked_linear<BF16>(x, w, y, M, N, K, threads);
  return 0;
}
int blocked_linear_bf16_widened(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K, int threads) {
  blocked_linear_widened(x, w, y, M, N, K, threads);
  return 0;
}
int blocked_mlp_f32(const float* x, const float* wgu, const float* wd, float* y, int M, int H, int I, int N,
                    int threads) {
  return mlp_entry<F32>(x, wgu, wd, y, M, H, I, N, threads, blocked_linear_f32, silu_mul_f32);
}
int blocked_mlp_bf16(const uint16_t* x, const uint16_t* wgu, const uint16_t* wd, uint16_t* y, int M, int H, int I,
                     int N, int threads) {
  return mlp_entry<BF16>(x, wgu, wd, y, M, H, I, N, threads, blocked_linear_bf16, silu_mul_bf16);
}
}
