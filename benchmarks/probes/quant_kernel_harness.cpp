// The native quantized product alone (kernels/linear/quant_linear.cpp) at one shape, outside
// torch: enough copies of the weight that every call reads it from memory (512 MB in all),
// 40 timed calls, the median's microseconds and GB/s of weight bytes. bits 0: the bf16 blocked
// product (blocked_linear.cpp) at the same shape.
//
//   FL="-O3 -fopenmp -std=c++17 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq \
//       -mavx512bf16 -mavx512vnni -mtune=native -Ikernels"          (the level's flags: kernels/native/build.py)
//   g++ $FL benchmarks/probes/quant_kernel_harness.cpp kernels/linear/quant_linear.cpp \
//       kernels/linear/blocked_linear.cpp kernels/activation/silu_mul.cpp -o harness
//   T=2 ./harness K N BITS [M]                                        (BITS 8, 4 or 0; M rows, default 1)
//
// An A/B of two versions of the quantized kernel (same layout) in one process, their calls
// alternated (the machine's bandwidth drifts within seconds, so separate runs cannot settle a
// few percent): build version B with its entry points renamed, link both, -DAB:
//   g++ $FL -c B/quant_linear.cpp -o b.o -Dquant_linear_bf16=quant_linear_bf16_b -Dquant_linear_f32=quant_linear_f32_b
//   g++ $FL -DAB benchmarks/probes/quant_kernel_harness.cpp kernels/linear/quant_linear.cpp b.o \
//       kernels/linear/blocked_linear.cpp kernels/activation/silu_mul.cpp -o ab
//   T=2 ./ab K N BITS [M]          (the medians of both, of B / A per pair, and whether their outputs are equal)
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <vector>
#include <algorithm>
#include <chrono>
#include <omp.h>
#include <sys/mman.h>
static void* halloc(size_t n){ n=(n+(2<<20)-1)/(2<<20)*(2<<20); void* p=aligned_alloc(2<<20,n); if(getenv("HP")) madvise(p,n,MADV_HUGEPAGE); return p; }
#include "native/kernels.h"
#ifdef AB
extern "C" int quant_linear_bf16_b(const uint16_t* x, const uint8_t* q, const int8_t* zeros, uint16_t* y, int M,
                                   int N, int K, int bits, int group, int threads);
#endif
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  int K = atoi(argv[1]), N = atoi(argv[2]), bits = atoi(argv[3]), M = argc > 4 ? atoi(argv[4]) : 1;
  int threads = getenv("T") ? atoi(getenv("T")) : 2, group = 32, reps = 40;
  // the packed layout: per block of 16 columns, units of two groups' 64 bytes of float16 scales
  // and then their codes (quant_linear.cpp); K / group even here
  const size_t code_bytes = (size_t)group * 16 * bits / 8, unit = 64 + 2 * code_bytes;
  const size_t per = bits ? (size_t)N / 16 * (K / group / 2) * unit : (size_t)N * K * 2;
  int copies = std::max<size_t>(1, (size_t)(512 << 20) / per);
  std::vector<uint8_t*> qs;
  for (int c = 0; c < copies; c++) {
    uint8_t* q = (uint8_t*)halloc((per + 63) / 64 * 64);
    for (size_t i = 0; i < per; i++) q[i] = (uint8_t)(i * 2654435761u >> 13);
    if (bits)                                     // scales of normal size (random bits could be NaN)
      for (size_t u = 0; u < per / unit; u++)
        for (int i = 0; i < 32; i++) ((uint16_t*)(q + u * unit))[i] = 0x2000 + ((u + i) & 255);
    qs.push_back(q);
  }
  std::vector<uint16_t> x(M * K), y(M * N);
  for (int i = 0; i < M * K; i++) x[i] = 0x3f80 + (i % 97);
#ifdef AB
  if (!bits) return 1;
  std::vector<uint16_t> yb(M * N);
  std::vector<double> ta, tb, ratio;
  bool same = true;
  for (int r = 0; r < reps + copies; r++) {       // A then B, B then A, ...; each on its own copy
    const uint8_t* qa = qs[r % copies];
    const uint8_t* qb = qs[(r + copies / 2) % copies];
    double a = 0, b = 0;
    for (int i = 0; i < 2; i++) {
      const double t = now();
      if ((i == 0) == (r % 2 == 0)) { quant_linear_bf16(x.data(), qa, nullptr, y.data(), M, N, K, bits, group, threads); a = now() - t; }
      else { quant_linear_bf16_b(x.data(), qb, nullptr, yb.data(), M, N, K, bits, group, threads); b = now() - t; }
    }
    if (r >= copies) { ta.push_back(a); tb.push_back(b); ratio.push_back(b / a); }
  }
  quant_linear_bf16(x.data(), qs[0], nullptr, y.data(), M, N, K, bits, group, threads);
  quant_linear_bf16_b(x.data(), qs[0], nullptr, yb.data(), M, N, K, bits, group, threads);
  same = y == yb;
  for (auto* v : {&ta, &tb, &ratio}) std::sort(v->begin(), v->end());
  printf("K %d N %d bits %d M %d: A %.1f us, B %.1f us (medians), B / A %.3f (median of pairs), outputs %s\n", K, N,
         bits, M, ta[ta.size() / 2] * 1e6, tb[tb.size() / 2] * 1e6, ratio[ratio.size() / 2], same ? "equal" : "differ");
#else
  std::vector<double> ts;
  for (int r = 0; r < reps + copies; r++) {
    int c = r % copies; double t = now();
    if (bits) quant_linear_bf16(x.data(), qs[c], nullptr, y.data(), M, N, K, bits, group, threads);
    else blocked_linear_bf16(x.data(), (uint16_t*)qs[c], y.data(), M, N, K, threads);
    if (r >= copies) ts.push_back(now() - t);
  }
  std::sort(ts.begin(), ts.end());
  double t = ts[ts.size() / 2];
  printf("K %d N %d bits %d M %d: %.1f us, %.1f GB/s\n", K, N, bits, M, t * 1e6, per / t / 1e9);
#endif
}
