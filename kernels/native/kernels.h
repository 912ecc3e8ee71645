// The native kernels' entry points: plain C functions on raw pointers, one source file each
// (compiled for one level of kernels/native/isa.py: simd.h). ops.cpp wraps them as torch operators;
// each kernel's source includes this header too, so the two sides cannot disagree on a signature.
// Each returns 0, or an error code its source documents (nothing is computed then).
#pragma once
#include <stdint.h>

extern "C" {

int blocked_linear_f32(const float* x, const float* w, float* y, int M, int N, int K, int threads);
int blocked_linear_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K, int threads);
int blocked_linear_bf16_widened(const uint16_t* x, const uint16_t* w, uint16_t* y, int M, int N, int K,
                                int threads);
// Rows W[ids] [n, K] of a blocked weight of N rows (blocked_linear.cpp): 0, or 1 where an id is
// outside [0, N) (nothing written then).
int blocked_rows_f32(const float* w, const int64_t* ids, float* out, int n, int K, int64_t N);
int blocked_rows_bf16(const uint16_t* w, const int64_t* ids, uint16_t* out, int n, int K, int64_t N);
// The SwiGLU MLP (blocked_linear.cpp): y [M, N] = silu_mul(x Wgu^T) Wd^T, x [M, H], Wgu blocked
// [2I / 16] blocks over H, Wd [N / 16] blocks over I; both float32 or both bf16 pairs (the
// register forms of blocked_linear_f32 / _bf16: the same values as those calls and silu_mul's).
int blocked_mlp_f32(const float* x, const float* wgu, const float* wd, float* y, int M, int H, int I, int N,
                    int threads);
int blocked_mlp_bf16(const uint16_t* x, const uint16_t* wgu, const uint16_t* wd, uint16_t* y, int M, int H, int I,
                     int N, int threads);
// x [M, K] @ W^T for a quantized W, its codes and scales packed in one stream per block of 16
// columns (quant_linear.cpp has the layout): bits 8 or 4, group a multiple of 32 dividing K, N a
// multiple of 16; zeros the zero points of asymmetric weights (NULL: symmetric); x and y float32
// or bf16 bits. 1 where the shapes do not fit (nothing written then).
// Bytes of one block of 16 columns in that layout, for K input columns in groups of `group`.
int64_t quant_linear_block_bytes(int K, int group, int bits);
int quant_linear_f32(const float* x, const uint8_t* q, const int8_t* zeros, float* y, int M, int N, int K, int bits,
                     int group, int threads);
int quant_linear_bf16(const uint16_t* x, const uint8_t* q, const int8_t* zeros, uint16_t* y, int M, int N, int K,
                      int bits, int group, int threads);
// Single rows of such a packed weight (quant_rows.cpp), group a multiple of 8 dividing K:
// out [n, K] float32 = W[ids] dequantized: 0, 1 where an id is outside [0, N), 2 where the
// scheme does not fit (nothing written then).
int quant_rows_f32(const uint8_t* q, const int8_t* zeros, const int64_t* ids, float* out, int n, int K, int64_t N,
                   int bits, int group);
// In place, in each row r of y [M, n] (rows sy elements apart), its `count` largest outputs
// y[r][i] replaced by x[r] . W[i] of this packed weight (n <= its rows; x [M, K] contiguous):
// 0, or 2 where the scheme does not fit.
int quant_rescore_top_f32(const float* x, float* y, int64_t sy, const uint8_t* q, const int8_t* zeros, int M,
                          int64_t n, int K, int bits, int group, int count, int threads);
int quant_rescore_top_bf16(const uint16_t* x, uint16_t* y, int64_t sy, const uint8_t* q, const int8_t* zeros,
                           int M, int64_t n, int K, int bits, int group, int count, int threads);
// int4 codes and float16 scales of `groups` groups of `group` consecutive float32 values
// (quantize_int4.cpp: the scale of least squared error among 21 around max / -8): 0, or 1 where
// group is not a multiple of 8.
int quantize_int4_search(const float* w, int64_t groups, int group, int8_t* q, uint16_t* scales, int threads);

int gdn_recurrent(const float* kq, const float* decay, const float* beta, const float* v,
                  const float* read_pool, int64_t R, float* pool, int64_t S, const int64_t* read_slots,
                  const int64_t* write_slots, float* o, int B, int T, int H, int dk, int dv, int threads);

// The GDN decode step after the conv (gdn_decode.cpp), activations float32 or bf16 bits.
#define GDN_DECODE_ENTRY(name, T)                                                                        \
  int name(const T* u, const T* b, const T* a, int64_t sb0, int64_t sb1, int64_t sa0, int64_t sa1,          \
           const float* dt_bias, const float* neg_decay, const float* read_pool, int64_t R, float* pool,     \
           int64_t S, const int64_t* read_slots, const int64_t* write_slots, T* o, int B, int Tn, int Hk,    \
           int H, int dk, int dv, float scale, int threads)
GDN_DECODE_ENTRY(gdn_decode_f32, float);
GDN_DECODE_ENTRY(gdn_decode_bf16, uint16_t);

int paged_attention_f32(const float* q, const float* cache, const int64_t* block_tables, const int64_t* seq_lens,
                        float* o, int64_t num_blocks, int N, int Q, int nh, int nkv, int hd, int bs, int width,
                        float scale, int threads);
int paged_attention_bf16(const float* q, const uint16_t* cache, const int64_t* block_tables,
                         const int64_t* seq_lens, float* o, int64_t num_blocks, int N, int Q, int nh, int nkv,
                         int hd, int bs, int width, float scale, int threads);

// x and pool in the first dtype, weight in the second (f32 = float32, bf16 = bfloat16 bits).
#define CONV_UPDATE_ENTRY(name, T, TW)                                                                  \
  int name(const T* x, const TW* weight, T* pool, const int64_t* read, const int64_t* write, T* y,     \
           int64_t S, int B, int Tn, int D, int K, int64_t sb, int64_t st, int threads)
CONV_UPDATE_ENTRY(conv_update_f32_f32, float, float);
CONV_UPDATE_ENTRY(conv_update_bf16_bf16, uint16_t, uint16_t);
CONV_UPDATE_ENTRY(conv_update_bf16_f32, uint16_t, float);
CONV_UPDATE_ENTRY(conv_update_f32_bf16, float, uint16_t);

// A structured output's token mask (token_bitmask.cpp), in place: logits [rows, vocab] at row
// stride sl = -inf where the bit of bitmask [rows, >= ceil(vocab/32)] at row stride sb is 0.
void apply_token_bitmask_f32(float* logits, const int32_t* bitmask, int rows, int64_t vocab, int64_t sl,
                             int64_t sb, int threads);

// The SwiGLU activation (silu_mul.cpp): y [rows, I] = silu(gate) * up of rows [gate | up].
void silu_mul_f32(const float* x, float* y, int rows, int I, int64_t sx, int threads);
void silu_mul_bf16(const uint16_t* x, uint16_t* y, int rows, int I, int64_t sx, int threads);

// The RMSNorms (rms_norm.cpp), activations in the first dtype, the weight in the second. Rows
// (i, j), i < n0 and j < n1, sit at base + i * s0 + j * s1 elements, the last dim contiguous.
#define RMS_NORM_ENTRIES(xn, wn, T, TW)                                                                      \
  void rms_norm_##xn##_##wn(const T* x, const TW* w, T* y, int n0, int n1, int D, int64_t s0, int64_t s1,     \
                            float eps, int threads);                                                         \
  void add_rms_norm_##xn##_##wn(const T* x, const T* h, const TW* w, T* sum, T* y, int rows, int D,           \
                                int64_t sx, int64_t sh, float eps, int threads);                             \
  void gated_rms_norm_##xn##_##wn(const T* x, const T* z, const TW* w, T* y, int n0, int n1, int D,           \
                                  int64_t sx0, int64_t sx1, int64_t sz0, int64_t sz1, float eps, int threads); \
  void qk_norm_rope_##xn##_##wn(const T* q, const T* k, const TW* qw, const TW* kw, const T* cos,              \
                                const T* sin, T* out, int tokens, int nh, int nkv, int hd, int rot,           \
                                int64_t sq0, int64_t sq1, int64_t sk0, int64_t sk1, int64_t scs, float eps,  \
                                int threads)
RMS_NORM_ENTRIES(f32, f32, float, float);
RMS_NORM_ENTRIES(bf16, bf16, uint16_t, uint16_t);
RMS_NORM_ENTRIES(bf16, f32, uint16_t, float);
RMS_NORM_ENTRIES(f32, bf16, float, uint16_t);

}
