// The memory's read rate as a plain stream, for bench_cpu.py's bandwidth probe: each thread sums
// its contiguous share of a float32 buffer far larger than the caches into four 32-byte vector
// accumulators (GCC/Clang vector extensions: full-width loads at any level, two SSE halves
// without AVX). Nothing but the loads and one add each, so no per-element work of torch's ops
// (mv's FMAs and its reduction over columns, amax's NaN checks) can hold it below the memory.
#include <stddef.h>

#include <omp.h>

typedef float v8 __attribute__((vector_size(32)));

float stream_read(const float* x, size_t n, int threads) {
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const size_t per = n / nt / 32 * 32, begin = per * t;    // the tail past nt * per is not read
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (size_t i = begin; i < begin + per; i += 32) {
      const v8* p = (const v8*)(x + i);                       // x is 64-byte aligned (torch)
      a0 += p[0];
      a1 += p[1];
      a2 += p[2];
      a3 += p[3];
    }
    a0 += a1 + a2 + a3;
    for (int j = 0; j < 8; j++) total += a0[j];
  }
  return total;   // returned, so the reads cannot be dropped
}
