// The native kernels (kernels.h) as torch operators, so eager code and compiled graphs call the
// same op and no call passes through Python: each wrapper checks its inputs (with the messages
// callers and tests rely on), brings them to the dtype and layout its kernel reads (only where
// they differ: at decode sizes a needless copy costs more than the kernel), allocates the
// outputs and calls the kernel with torch's thread count.
//
// The namespace comes from ops_namespace.cpp, a one-line object compiled per library:
// `hybrid_engine_cpu` for the process's own level, `hybrid_engine_cpu_<level>` for a lower one
// loaded beside it (tests run each level below theirs in one process, and two libraries may not
// define one op twice). So this file, most of the build time (torch's headers), is compiled once
// for all levels and namespaces: it uses no SIMD and takes no level flags; the kernels it calls
// were compiled with them.
// The fake (meta) implementations that torch.compile traces live in kernels/native/ops.py.
//
// Adding a kernel: declare its entry in kernels.h, write one wrapper here, add its schema to
// define_ops and its wrapper to cpu_impls, add its source to build.py's SOURCES and its fake to
// ops.py's FAKES (ops.py's docstring has the example).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"

extern "C" const char hybrid_engine_ops_namespace[];     // ops_namespace.cpp

namespace {

using at::Tensor;

// ---- what the error messages print, as Python would -------------------------------------------

std::string dtype_name(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    default: return std::string("torch.") + c10::toString(t.scalar_type());
  }
}

std::string shape(const Tensor& t) {            // tuple(t.shape)
  std::ostringstream s;
  s << "(";
  for (int64_t d = 0; d < t.dim(); d++) s << (d ? ", " : "") << t.size(d);
  s << (t.dim() == 1 ? ",)" : ")");
  return s.str();
}

std::string values(const int64_t* p, int rows, int cols, bool nested) {   // an int64 tensor's tolist()
  std::ostringstream s;
  s << "[";
  for (int r = 0; r < rows; r++) {
    if (r) s << ", ";
    if (nested) s << "[";
    for (int c = 0; c < cols; c++) s << (c ? ", " : "") << p[(int64_t)r * cols + c];
    if (nested) s << "]";
  }
  s << "]";
  return s.str();
}

// ---- inputs as the kernels read them ----------------------------------------------------------

Tensor contiguous_as(const Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) return t;
  return t.to(dtype).contiguous();
}

Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

int threads() { return at::get_num_threads(); }

// ---- blocked_linear.cpp -----------------------------------------------------------------------

// x [..., K] @ W^T -> [..., N] from a blocked W (kernels/linear/blocked.py has the layouts).
Tensor blocked_linear_op(const Tensor& x, const Tensor& w_blocked, bool widen) {
  const bool pairs = w_blocked.dim() == 4;
  const int64_t k = x.dim() ? x.size(-1) : 0;
  const bool fits = x.dim() >= 1 && x.scalar_type() == w_blocked.scalar_type() &&
                    (pairs ? x.scalar_type() == at::kBFloat16 && w_blocked.size(2) == 16 && w_blocked.size(3) == 2
                           : x.scalar_type() == at::kFloat && w_blocked.dim() == 3 && w_blocked.size(2) == 16) &&
                    w_blocked.size(1) == (pairs ? (k + 1) / 2 : k) && w_blocked.is_contiguous();
  TORCH_CHECK_VALUE(fits, "blocked_linear: x ", shape(x), " ", dtype_name(x), " does not fit a blocked weight ",
                    shape(w_blocked), " ", dtype_name(w_blocked));
  TORCH_CHECK_VALUE(!widen || pairs, "blocked_linear: widen=True is for bfloat16 weights");
  const int64_t n = w_blocked.size(0) * 16;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  Tensor y = at::empty(sizes, x.options());
  const int64_t m = k ? x.numel() / k : 0;
  if (m == 0) return y;
  const Tensor xc = x.is_contiguous() ? x : x.contiguous();
  if (!pairs)
    blocked_linear_f32(xc.const_data_ptr<float>(), w_blocked.const_data_ptr<float>(), y.mutable_data_ptr<float>(),
                       m, n, k, threads());
  else
    (widen ? blocked_linear_bf16_widened : blocked_linear_bf16)(
        static_cast<const uint16_t*>(xc.const_data_ptr()), static_cast<const uint16_t*>(w_blocked.const_data_ptr()),
        static_cast<uint16_t*>(y.mutable_data_ptr()), m, n, k, threads());
  return y;
}

// The zero points of a packed quantized weight q of `groups` groups a row, for `op`: none, or
// int8 [N/16, groups, 16].
void check_zeros(const char* op, const std::optional<Tensor>& zeros, const Tensor& q, int64_t groups) {
  TORCH_CHECK_VALUE(!zeros || (zeros->scalar_type() == at::kChar && zeros->dim() == 3 && zeros->size(0) == q.size(0) &&
                               zeros->size(1) == groups && zeros->size(2) == 16 && zeros->is_contiguous()),
                    op, ": zeros ", zeros ? shape(*zeros) : "", " ", zeros ? dtype_name(*zeros) : "", " are not int8 [",
                    q.size(0), ", ", groups, ", 16]");
}

const int8_t* zeros_data(const std::optional<Tensor>& zeros) {
  return zeros ? static_cast<const int8_t*>(zeros->const_data_ptr()) : nullptr;
}

// x [..., K] @ W^T -> [..., N] from a quantized W: q uint8 [N/16, block bytes], each block's
// codes and float16 scales in one stream, and for asymmetric weights zeros int8 [N/16, K / group,
// 16] (kernels/linear/quantized.py, quant_linear.cpp).
Tensor quant_linear_op(const Tensor& x, const Tensor& q, const std::optional<Tensor>& zeros, int64_t bits,
                       int64_t group) {
  const int64_t k = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "linear_quant: bits must be 8 or 4, not ", bits);
  TORCH_CHECK_VALUE(group >= 32 && group % 32 == 0 && k % group == 0, "linear_quant: group ", group,
                    " is not a multiple of 32 dividing x's ", k, " columns");
  const int64_t block_bytes = quant_linear_block_bytes(k, group, bits);
  const bool fits = x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                    q.scalar_type() == at::kByte && q.dim() == 2 && q.size(1) == block_bytes && q.is_contiguous();
  TORCH_CHECK_VALUE(fits, "linear_quant: x ", shape(x), " ", dtype_name(x), " does not fit int", bits,
                    " weights ", shape(q), " ", dtype_name(q), " in groups of ", group, " (", block_bytes,
                    " bytes a block of 16 columns)");
  check_zeros("linear_quant", zeros, q, k / group);
  const int64_t n = q.size(0) * 16;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  Tensor y = at::empty(sizes, x.options());
  const int64_t m = k ? x.numel() / k : 0;
  if (m == 0) return y;
  const Tensor xc = dense(x);
  const auto* qp = static_cast<const uint8_t*>(q.const_data_ptr());
  const int8_t* zp = zeros_data(zeros);
  if (x.scalar_type() == at::kFloat)
    quant_linear_f32(xc.const_data_ptr<float>(), qp, zp, y.mutable_data_ptr<float>(), m, n, k, bits, group,
                     threads());
  else
    quant_linear_bf16(static_cast<const uint16_t*>(xc.const_data_ptr()), qp, zp,
                      static_cast<uint16_t*>(y.mutable_data_ptr()), m, n, k, bits, group, threads());
  return y;
}

// Checks a packed quantized weight of k input columns (and its zero points) for `op`.
void check_packed(const char* op, const Tensor& q, const std::optional<Tensor>& zeros, int64_t bits, int64_t group,
                  int64_t k) {
  TORCH_CHECK_VALUE((bits == 8 || bits == 4) && group >= 8 && group % 8 == 0 && k % group == 0, op, ": int", bits,
                    " in groups of ", group, " does not fit ", k, " columns (bits 8 or 4, groups a multiple of 8)");
  const int64_t block_bytes = quant_linear_block_bytes(k, group, bits);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte && q.dim() == 2 && q.size(1) == block_bytes && q.is_contiguous(), op,
                    ": ", shape(q), " ", dtype_name(q), " is not int", bits, " weights of ", k, " columns in groups of ",
                    group, " (", block_bytes, " bytes a block of 16 rows)");
  check_zeros(op, zeros, q, k / group);
}

// W[ids] float32 [n, k] of a packed quantized W (quant_rows.cpp), ids int64 [n].
Tensor quant_rows_op(const Tensor& q, const std::optional<Tensor>& zeros, const Tensor& ids, int64_t bits,
                     int64_t group, int64_t k) {
  check_packed("quant_rows", q, zeros, bits, group, k);
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids must be int64 [n], not ",
                    dtype_name(ids), " ", shape(ids));
  Tensor out = at::empty({ids.size(0), k}, q.options().dtype(at::kFloat));
  if (ids.size(0) == 0) return out;
  const Tensor idc = dense(ids);
  const int64_t N = q.size(0) * 16;
  const int rc = quant_rows_f32(static_cast<const uint8_t*>(q.const_data_ptr()), zeros_data(zeros),
                                idc.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), ids.size(0), k, N, bits,
                                group);
  TORCH_CHECK_VALUE(rc == 0, "quant_rows: an id of ", values(idc.const_data_ptr<int64_t>(), 1, ids.size(0), false),
                    " is outside the weight's ", N, " rows");
  return out;
}

// In place: in each row of y [..., n] (float32 or bf16, the last dim contiguous), its `count`
// largest outputs replaced by x . W[i] from a packed quantized W (quant_rows.cpp), x [..., k] of
// y's dtype.
void rescore_top_op(const Tensor& x, const Tensor& y, const Tensor& q, const std::optional<Tensor>& zeros, int64_t bits,
                    int64_t group, int64_t count) {
  const int64_t k = x.dim() ? x.size(-1) : 0, n = y.dim() ? y.size(-1) : 0;
  check_packed("rescore_top", q, zeros, bits, group, k);
  TORCH_CHECK_VALUE(x.dim() >= 1 && y.dim() == x.dim() && x.sizes().slice(0, x.dim() - 1) == y.sizes().slice(0, y.dim() - 1) &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                        y.scalar_type() == x.scalar_type() && y.stride(-1) == 1 && n <= q.size(0) * 16 && count >= 0,
                    "rescore_top: x ", shape(x), " ", dtype_name(x), " and y ", shape(y), " ", dtype_name(y),
                    " do not fit weights of ", q.size(0) * 16, " rows (float32 or bf16 both, y's last dim contiguous)");
  const int64_t m = k ? x.numel() / k : 0;
  if (m == 0 || n == 0) return;
  const Tensor xc = dense(x), rows = y.view({m, n});      // a view: the writes reach y
  const auto* qp = static_cast<const uint8_t*>(q.const_data_ptr());
  if (x.scalar_type() == at::kFloat)
    quant_rescore_top_f32(xc.const_data_ptr<float>(), rows.mutable_data_ptr<float>(), rows.stride(0), qp,
                          zeros_data(zeros), m, n, k, bits, group, count, threads());
  else
    quant_rescore_top_bf16(static_cast<const uint16_t*>(xc.const_data_ptr()),
                           static_cast<uint16_t*>(rows.mutable_data_ptr()), rows.stride(0), qp, zeros_data(zeros), m,
                           n, k, bits, group, count, threads());
}

// w float32 [N, K] -> (int4 codes int8 [N, K], scales float16 [N, K / group]): each group's
// scale searched (quantize_int4.cpp).
std::tuple<Tensor, Tensor> quantize_int4_op(const Tensor& w, int64_t group) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kFloat, "quantize_int4: w must be 2-d float32, not ",
                    shape(w), " ", dtype_name(w));
  TORCH_CHECK_VALUE(group >= 8 && group % 8 == 0 && w.size(1) % group == 0, "quantize_int4: group ", group,
                    " is not a multiple of 8 dividing w's ", w.size(1), " columns");
  const Tensor wc = dense(w);
  Tensor q = at::empty(w.sizes(), w.options().dtype(at::kChar));
  Tensor scales = at::empty({w.size(0), w.size(1) / group}, w.options().dtype(at::kHalf));
  quantize_int4_search(wc.const_data_ptr<float>(), w.numel() / group, group, q.mutable_data_ptr<int8_t>(),
                       static_cast<uint16_t*>(scales.mutable_data_ptr()), threads());
  return {q, scales};
}

// W[ids] [n, k] from a blocked W (float32 [N/16, K, 16] or bf16 pairs [N/16, ceil(K/2), 16, 2]),
// ids int64 [n]; k: W's columns (bf16's padded pair dropped).
Tensor blocked_rows_op(const Tensor& w_blocked, const Tensor& ids, int64_t k) {
  const bool pairs = w_blocked.dim() == 4;
  const bool fits = (pairs ? w_blocked.scalar_type() == at::kBFloat16 && w_blocked.size(3) == 2 &&
                                 w_blocked.size(1) == (k + 1) / 2
                           : w_blocked.scalar_type() == at::kFloat && w_blocked.dim() == 3 && w_blocked.size(1) == k) &&
                    w_blocked.size(2) == 16 && w_blocked.is_contiguous();
  TORCH_CHECK_VALUE(fits, "blocked_rows: ", shape(w_blocked), " ", dtype_name(w_blocked),
                    " is not a blocked weight of ", k, " columns");
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong, "blocked_rows: ids must be int64 [n], not ",
                    dtype_name(ids), " ", shape(ids));
  Tensor out = at::empty({ids.size(0), k}, w_blocked.options());
  if (ids.size(0) == 0) return out;
  const Tensor idc = dense(ids);
  const int64_t N = w_blocked.size(0) * 16;
  const int rc = pairs ? blocked_rows_bf16(static_cast<const uint16_t*>(w_blocked.const_data_ptr()),
                                           idc.const_data_ptr<int64_t>(), static_cast<uint16_t*>(out.mutable_data_ptr()),
                                           ids.size(0), k, N)
                       : blocked_rows_f32(w_blocked.const_data_ptr<float>(), idc.const_data_ptr<int64_t>(),
                                          out.mutable_data_ptr<float>(), ids.size(0), k, N);
  TORCH_CHECK_VALUE(rc == 0, "blocked_rows: an id of ", values(idc.const_data_ptr<int64_t>(), 1, ids.size(0), false),
                    " is outside the weight's ", N, " rows");
  return out;
}

// x [..., H] -> silu_mul(x Wgu^T) Wd^T [..., N] from two blocked weights of x's dtype (the
// SwiGLU MLP; kernels/linear/cpu.py `fused_swiglu` routes to it).
Tensor blocked_mlp_op(const Tensor& x, const Tensor& gate_up_blocked, const Tensor& down_blocked) {
  const bool pairs = gate_up_blocked.dim() == 4;
  const int64_t h = x.dim() ? x.size(-1) : 0;
  const auto fits = [&](const Tensor& w, int64_t k) {
    return w.dim() == gate_up_blocked.dim() && w.scalar_type() == x.scalar_type() && w.is_contiguous() &&
           w.size(1) == (pairs ? (k + 1) / 2 : k) && w.size(2) == 16 && (!pairs || w.size(3) == 2);
  };
  const bool dtype = pairs ? x.scalar_type() == at::kBFloat16 : x.scalar_type() == at::kFloat;
  const int64_t i = gate_up_blocked.dim() >= 1 ? gate_up_blocked.size(0) * 8 : 0;   // half of 2I's columns
  TORCH_CHECK_VALUE(x.dim() >= 1 && dtype && fits(gate_up_blocked, h) && fits(down_blocked, i),
                    "blocked_mlp: x ", shape(x), " ", dtype_name(x), " does not fit the blocked weights gate_up ",
                    shape(gate_up_blocked), " ", dtype_name(gate_up_blocked), " and down ", shape(down_blocked),
                    " ", dtype_name(down_blocked));
  const int64_t n = down_blocked.size(0) * 16;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  Tensor y = at::empty(sizes, x.options());
  const int64_t m = h ? x.numel() / h : 0;
  if (m == 0) return y;
  const Tensor xc = dense(x);
  if (!pairs)
    blocked_mlp_f32(xc.const_data_ptr<float>(), gate_up_blocked.const_data_ptr<float>(),
                    down_blocked.const_data_ptr<float>(), y.mutable_data_ptr<float>(), m, h, i, n, threads());
  else
    blocked_mlp_bf16(static_cast<const uint16_t*>(xc.const_data_ptr()),
                     static_cast<const uint16_t*>(gate_up_blocked.const_data_ptr()),
                     static_cast<const uint16_t*>(down_blocked.const_data_ptr()),
                     static_cast<uint16_t*>(y.mutable_data_ptr()), m, h, i, n, threads());
  return y;
}

// ---- gdn_recurrent.cpp ------------------------------------------------------------------------

// Whether rows may run in parallel on the pool itself: every read slot is read by one row only,
// and no row writes a slot another row reads (kernels/gdn/recurrent_cpu.py rows_independent).
bool rows_independent(const int64_t* read, const int64_t* write, int B, int T) {
  if (B <= 1) return true;
  std::vector<std::pair<int64_t, int>> owner(B);
  for (int b = 0; b < B; b++) owner[b] = {read[b], b};
  std::sort(owner.begin(), owner.end());
  for (int b = 1; b < B; b++)
    if (owner[b].first == owner[b - 1].first) return false;
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const int64_t slot = write[(int64_t)b * T + t];
      auto it = std::lower_bound(owner.begin(), owner.end(), std::make_pair(slot, -1));
      if (it != owner.end() && it->first == slot && it->second != b) return false;
    }
  return true;
}

// Where each row of a step starts from: the pool itself, or, for rows that read a slot another
// row writes (or share a read slot), a copy of their first states gathered before any write, as
// the torch form's gather (the kernels run rows in parallel on the pool).
struct FirstStates {
  const float* pool;
  int64_t size;                   // states in `pool`
  const int64_t* slots;           // row b's first state: pool[slots[b]]
  Tensor gathered;
  std::vector<int64_t> own_rows;
};

FirstStates first_states(const Tensor& state_pool, const int64_t* read, const int64_t* write, int B, int T) {
  FirstStates first{state_pool.const_data_ptr<float>(), state_pool.size(0), read, {}, {}};
  if (rows_independent(read, write, B, T)) return first;
  const int64_t state = state_pool.stride(0);
  first.gathered = at::empty({B, state_pool.size(1), state_pool.size(2), state_pool.size(3)}, state_pool.options());
  float* g = first.gathered.mutable_data_ptr<float>();
  for (int b = 0; b < B; b++) std::memcpy(g + b * state, first.pool + read[b] * state, state * sizeof(float));
  first.own_rows.resize(B);
  for (int b = 0; b < B; b++) first.own_rows[b] = b;
  first.pool = g, first.size = B, first.slots = first.own_rows.data();
  return first;
}

// Whether every read slot is in [0, S) and every write slot below S (the message callers see).
void check_slots(const char* op, const int64_t* read, const int64_t* write, int B, int T, int64_t S) {
  bool inside = true;
  for (int b = 0; b < B; b++) {
    inside = inside && read[b] >= 0 && read[b] < S;
    for (int t = 0; t < T; t++) inside = inside && write[(int64_t)b * T + t] < S;
  }
  TORCH_CHECK_VALUE(inside, op, ": a slot outside the pool of ", S, " (read ", values(read, 1, B, false), ", write ",
                    values(write, B, T, true), ")");
}

// kq [B, T, H, 2, dk], decay/beta [B, T, H], v [B, T, H, dv]; state_pool [S, H, dk, dv] float32,
// updated in place -> o [B, T, H, dv] float32.
Tensor gdn_recurrent_op(const Tensor& kq_in, const Tensor& decay_in, const Tensor& beta_in, const Tensor& v_in,
                     const Tensor& state_pool, const Tensor& read_in, const Tensor& write_in) {
  TORCH_CHECK_VALUE(state_pool.scalar_type() == at::kFloat && state_pool.is_contiguous() && state_pool.dim() == 4,
                    "gdn_recurrent: the state pool must be a contiguous float32 [S, H, dk, dv] tensor, not ",
                    shape(state_pool), " ", dtype_name(state_pool));
  TORCH_CHECK_VALUE(kq_in.dim() == 5 && v_in.dim() == 4, "gdn_recurrent: kq ", shape(kq_in), " and v ",
                    shape(v_in), " are not [B, T, H, 2, dk] and [B, T, H, dv]");
  const int B = kq_in.size(0), T = kq_in.size(1), H = kq_in.size(2), dk = kq_in.size(4), dv = v_in.size(3);
  const int64_t S = state_pool.size(0);
  const Tensor kq = contiguous_as(kq_in, at::kFloat), decay = contiguous_as(decay_in, at::kFloat);
  const Tensor beta = contiguous_as(beta_in, at::kFloat), v = contiguous_as(v_in, at::kFloat);
  const Tensor read = contiguous_as(read_in, at::kLong), write = contiguous_as(write_in, at::kLong);
  const int64_t* rp = read.const_data_ptr<int64_t>();
  const int64_t* wp = write.const_data_ptr<int64_t>();
  check_slots("gdn_recurrent", rp, wp, B, T, S);
  Tensor o = at::empty({B, T, H, dv}, kq.options());
  if (B == 0 || T == 0) return o;
  const FirstStates first = first_states(state_pool, rp, wp, B, T);
  const int err = gdn_recurrent(kq.const_data_ptr<float>(), decay.const_data_ptr<float>(),
                                  beta.const_data_ptr<float>(), v.const_data_ptr<float>(), first.pool, first.size,
                                  state_pool.mutable_data_ptr<float>(), S, first.slots, wp,
                                  o.mutable_data_ptr<float>(), B, T, H, dk, dv, threads());
  TORCH_CHECK_VALUE(err == 0, "gdn_recurrent: dv ", dv, " unsupported (a multiple of 16 up to 512)");
  return o;
}

// ---- paged_attention.cpp ----------------------------------------------------------------------

// q [N * Q, nh, hd]; kv_cache [num_blocks, 2, block_size, nkv, hd] float32 or bf16; block_tables
// [N, width]; seq_lens [N] cached + new -> o [N * Q, nh, hd] float32.
Tensor paged_attention_decode_op(const Tensor& q_in, const Tensor& kv_cache, const Tensor& tables_in,
                              const Tensor& lens_in, double scale) {
  const auto dtype = kv_cache.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) && kv_cache.is_contiguous() &&
                        kv_cache.dim() == 5 && q_in.dim() == 3 && tables_in.dim() == 2,
                    "paged_attention_native: no kernel for a ", dtype_name(kv_cache), " cache ", shape(kv_cache),
                    " and q ", shape(q_in), " (a contiguous float32 or bfloat16 cache)");
  const int64_t T = q_in.size(0), nh = q_in.size(1), hd = q_in.size(2), N = lens_in.size(0);
  Tensor o = at::empty({T, nh, hd}, q_in.options().dtype(at::kFloat));
  if (N == 0 || T == 0) return o;
  const Tensor q = contiguous_as(q_in, at::kFloat);
  const Tensor tables = contiguous_as(tables_in, at::kLong), lens = contiguous_as(lens_in, at::kLong);
  const int64_t num_blocks = kv_cache.size(0), bs = kv_cache.size(2), nkv = kv_cache.size(3);
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  float* op = o.mutable_data_ptr<float>();
  const int err = dtype == at::kFloat
      ? paged_attention_f32(q.const_data_ptr<float>(), kv_cache.const_data_ptr<float>(), tp, lp, op, num_blocks,
                            N, T / N, nh, nkv, hd, bs, tables.size(1), scale, threads())
      : paged_attention_bf16(q.const_data_ptr<float>(), static_cast<const uint16_t*>(kv_cache.const_data_ptr()),
                             tp, lp, op, num_blocks, N, T / N, nh, nkv, hd, bs, tables.size(1), scale, threads());
  static const char* const errors[] = {"", "unsupported shape",
                                       "a sequence shorter than its queries or longer than its block table",
                                       "a block id outside the cache"};
  TORCH_CHECK_VALUE(err == 0, "paged_attention_native: ", err > 0 && err < 4 ? errors[err] : "error",
                    " (q ", shape(q), ", cache ", shape(kv_cache), ", block table ", shape(tables), ")");
  return o;
}

// ---- causal_conv1d_update.cpp -----------------------------------------------------------------

// One kernel entry per (x dtype, weight dtype), called on the tensors' data as those types.
template <typename T, typename TW>
int conv_call(CONV_UPDATE_ENTRY((*entry), T, TW), const Tensor& x, const Tensor& weight, const Tensor& pool,
              const Tensor& read, const Tensor& write, const Tensor& y) {
  return entry(static_cast<const T*>(x.const_data_ptr()), static_cast<const TW*>(weight.const_data_ptr()),
               static_cast<T*>(pool.mutable_data_ptr()), read.const_data_ptr<int64_t>(),
               write.const_data_ptr<int64_t>(), static_cast<T*>(y.mutable_data_ptr()), pool.size(0), x.size(0),
               x.size(1), x.size(2), weight.size(1), x.stride(0), x.stride(1), threads());
}

bool conv_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// x [B, T, D] (channels contiguous, rows at any stride); weight [D, K]; window_pool [S, D, K-1]
// in x's dtype, updated in place; read_slots [B]; write_slots [B, T] -> y [B, T, D] in x's dtype.
Tensor causal_conv1d_update_op(const Tensor& x_in, const Tensor& weight_in, const Tensor& window_pool,
                            const Tensor& read_in, const Tensor& write_in) {
  const auto xt = x_in.scalar_type(), wt = weight_in.scalar_type();
  TORCH_CHECK_VALUE(conv_dtype(xt) && conv_dtype(wt) && window_pool.scalar_type() == xt &&
                        window_pool.is_contiguous() && x_in.dim() == 3 && weight_in.dim() == 2,
                    "conv_update_native: no kernel for x ", dtype_name(x_in), " ", shape(x_in), ", weight ",
                    dtype_name(weight_in), ", pool ", dtype_name(window_pool));
  const int B = x_in.size(0), T = x_in.size(1), K = weight_in.size(1);
  Tensor y = at::empty({B, T, x_in.size(2)}, x_in.options());
  if (B == 0 || T == 0) return y;
  const Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();     // rows may be strided, channels not
  const Tensor weight = weight_in.is_contiguous() ? weight_in : weight_in.contiguous();
  const Tensor read = contiguous_as(read_in, at::kLong), write = contiguous_as(write_in, at::kLong);
  const bool xf = xt == at::kFloat, wf = wt == at::kFloat;
  const int err = xf ? (wf ? conv_call(conv_update_f32_f32, x, weight, window_pool, read, write, y)
                           : conv_call(conv_update_f32_bf16, x, weight, window_pool, read, write, y))
                     : (wf ? conv_call(conv_update_bf16_f32, x, weight, window_pool, read, write, y)
                           : conv_call(conv_update_bf16_bf16, x, weight, window_pool, read, write, y));
  TORCH_CHECK_VALUE(err == 0, "conv_update_native: ", err == 1 ? "unsupported kernel size" : "a slot outside the pool",
                    " (K ", K, ", pool of ", window_pool.size(0), ", read ",
                    values(read.const_data_ptr<int64_t>(), 1, B, false), ", write ",
                    values(write.const_data_ptr<int64_t>(), B, T, true), ")");
  return y;
}

// ---- gdn_decode.cpp (after causal_conv1d_update.cpp) -----------------------------------------

// A 1-D float32 or bf16 tensor's values as float32 (a layer's per-head constants: a few floats).
std::vector<float> floats_of(const Tensor& t) {
  const Tensor c = dense(t);
  std::vector<float> out(c.numel());
  if (c.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), c.const_data_ptr<float>(), out.size() * sizeof(float));
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(c.const_data_ptr());
    for (size_t i = 0; i < out.size(); i++) {
      const uint32_t bits = (uint32_t)p[i] << 16;
      std::memcpy(&out[i], &bits, sizeof(float));
    }
  }
  return out;
}

// mixed [B, T, D] (pre-conv q|k|v, channels contiguous, rows at any stride), b, a [B, T, H] (heads
// contiguous) of one dtype; conv_weight [D, K]; conv_pool [S, D, K-1] in mixed's dtype and
// state_pool [S, H, dk, dv] float32, both updated in place; dt_bias, neg_decay_rate [H]; read
// [B], write [B, T] -> o [B, T, H, dv] in mixed's dtype. The conv's output goes to a buffer of
// this call, which the step then reads head by head.
Tensor gdn_decode_op(const Tensor& mixed, const Tensor& b, const Tensor& a, const Tensor& conv_weight_in,
                     const Tensor& conv_pool, const Tensor& dt_bias, const Tensor& neg_decay_rate,
                     const Tensor& state_pool, const Tensor& read_in, const Tensor& write_in, double scale) {
  const auto xt = mixed.scalar_type();
  const bool pools = conv_dtype(xt) && conv_dtype(conv_weight_in.scalar_type()) && conv_pool.scalar_type() == xt &&
                     conv_pool.is_contiguous() && conv_pool.dim() == 3 && state_pool.scalar_type() == at::kFloat &&
                     state_pool.is_contiguous() && state_pool.dim() == 4;
  TORCH_CHECK_VALUE(pools && mixed.dim() == 3 && conv_weight_in.dim() == 2,
                    "gdn_decode: no kernel for mixed ", dtype_name(mixed), " ", shape(mixed), ", conv weight ",
                    dtype_name(conv_weight_in), ", conv pool ", dtype_name(conv_pool), " ", shape(conv_pool),
                    ", state pool ", dtype_name(state_pool), " ", shape(state_pool),
                    " (float32 or bf16 activations, contiguous pools, float32 states)");
  const int B = mixed.size(0), T = mixed.size(1), H = state_pool.size(1), dk = state_pool.size(2),
            dv = state_pool.size(3);
  const int64_t D = mixed.size(2), key_dim = (D - (int64_t)H * dv) / 2;
  const int Hk = dk ? key_dim / dk : 0;
  // the kernel's own limits checked here too, so that the conv before it leaves its pool as is
  const bool heads = Hk > 0 && 2 * (int64_t)Hk * dk + (int64_t)H * dv == D && H % Hk == 0 && dv % 16 == 0 &&
                     dv <= 512 && dk <= 512 &&
                     conv_weight_in.size(0) == D && conv_pool.size(1) == D &&
                     conv_pool.size(2) == conv_weight_in.size(1) - 1;
  const std::vector<int64_t> gate_shape{B, T, H};
  const bool gates = b.sizes() == gate_shape && a.sizes() == gate_shape && b.scalar_type() == xt &&
                     a.scalar_type() == xt && b.stride(2) == 1 && a.stride(2) == 1 && dt_bias.numel() == H &&
                     neg_decay_rate.numel() == H && conv_dtype(dt_bias.scalar_type()) &&
                     conv_dtype(neg_decay_rate.scalar_type());
  TORCH_CHECK_VALUE(heads && gates, "gdn_decode: mixed ", shape(mixed),
                    " (D = 2 Hk dk + H dv; dv a multiple of 16 up to 512, dk up to 512), b ", shape(b),
                    " and a ", shape(a), " (", dtype_name(b), ", ", dtype_name(a), ", [B, T, H] in mixed's dtype), ",
                    "dt_bias ", shape(dt_bias), " and neg_decay_rate ", shape(neg_decay_rate),
                    " do not fit the states ", shape(state_pool), " and conv ", shape(conv_weight_in), ", ",
                    shape(conv_pool));
  const Tensor read = contiguous_as(read_in, at::kLong), write = contiguous_as(write_in, at::kLong);
  const int64_t* rp = read.const_data_ptr<int64_t>();
  const int64_t* wp = write.const_data_ptr<int64_t>();
  check_slots("gdn_decode", rp, wp, B, T, std::min(conv_pool.size(0), state_pool.size(0)));
  Tensor o = at::empty({B, T, H, dv}, mixed.options());
  if (B == 0 || T == 0) return o;
  const Tensor x = mixed.stride(2) == 1 ? mixed : mixed.contiguous();
  const Tensor conv_weight = dense(conv_weight_in);
  Tensor u = at::empty({B, T, D}, mixed.options());
  const bool xf = xt == at::kFloat, wf = conv_weight.scalar_type() == at::kFloat;
  const int conv_err = xf ? (wf ? conv_call(conv_update_f32_f32, x, conv_weight, conv_pool, read, write, u)
                                : conv_call(conv_update_f32_bf16, x, conv_weight, conv_pool, read, write, u))
                          : (wf ? conv_call(conv_update_bf16_f32, x, conv_weight, conv_pool, read, write, u)
                                : conv_call(conv_update_bf16_bf16, x, conv_weight, conv_pool, read, write, u));
  TORCH_CHECK_VALUE(conv_err == 0, "gdn_decode: unsupported conv kernel size ", conv_weight.size(1));
  const std::vector<float> bias = floats_of(dt_bias), neg_decay = floats_of(neg_decay_rate);
  const FirstStates first = first_states(state_pool, rp, wp, B, T);
  float* pool = state_pool.mutable_data_ptr<float>();
  const int64_t S = state_pool.size(0);
  const int err = xf
      ? gdn_decode_f32(u.const_data_ptr<float>(), b.const_data_ptr<float>(), a.const_data_ptr<float>(), b.stride(0),
                       b.stride(1), a.stride(0), a.stride(1), bias.data(), neg_decay.data(), first.pool, first.size,
                       pool, S, first.slots, wp, o.mutable_data_ptr<float>(), B, T, Hk, H, dk, dv, scale, threads())
      : gdn_decode_bf16(static_cast<const uint16_t*>(u.const_data_ptr()),
                        static_cast<const uint16_t*>(b.const_data_ptr()),
                        static_cast<const uint16_t*>(a.const_data_ptr()), b.stride(0), b.stride(1), a.stride(0),
                        a.stride(1), bias.data(), neg_decay.data(), first.pool, first.size, pool, S, first.slots, wp,
                        static_cast<uint16_t*>(o.mutable_data_ptr()), B, T, Hk, H, dk, dv, scale, threads());
  TORCH_CHECK_VALUE(err == 0, "gdn_decode: heads of dk ", dk, ", dv ", dv, " with ", Hk, " key and ", H,
                    " value heads unsupported (dv a multiple of 16 up to 512, dk up to 512)");
  return o;
}

// ---- rms_norm.cpp -----------------------------------------------------------------------------

// The kernel's entries as overloads on the element types (float, or uint16_t bf16 bits), so one
// wrapper body serves the four (activation, weight) dtype pairs.
#define RMS_NORM_OVERLOADS(xn, wn, T, TW)                                                               \
  void rms_norm_entry(const T* x, const TW* w, T* y, int n0, int n1, int D, int64_t s0, int64_t s1,     \
                      float eps, int th) {                                                              \
    rms_norm_##xn##_##wn(x, w, y, n0, n1, D, s0, s1, eps, th);                                          \
  }                                                                                                     \
  void add_rms_norm_entry(const T* x, const T* h, const TW* w, T* sum, T* y, int rows, int D, int64_t sx, \
                          int64_t sh, float eps, int th) {                                              \
    add_rms_norm_##xn##_##wn(x, h, w, sum, y, rows, D, sx, sh, eps, th);                                \
  }                                                                                                     \
  void gated_rms_norm_entry(const T* x, const T* z, const TW* w, T* y, int n0, int n1, int D, int64_t sx0, \
                            int64_t sx1, int64_t sz0, int64_t sz1, float eps, int th) {                 \
    gated_rms_norm_##xn##_##wn(x, z, w, y, n0, n1, D, sx0, sx1, sz0, sz1, eps, th);                     \
  }                                                                                                     \
  void qk_norm_rope_entry(const T* q, const T* k, const TW* qw, const TW* kw, const T* cos, const T* sin, \
                          T* out, int tokens, int nh, int nkv, int hd, int rot, int64_t sq0, int64_t sq1, \
                          int64_t sk0, int64_t sk1, int64_t scs, float eps, int th) {                   \
    qk_norm_rope_##xn##_##wn(q, k, qw, kw, cos, sin, out, tokens, nh, nkv, hd, rot, sq0, sq1, sk0, sk1, scs, \
                             eps, th);                                                                  \
  }
RMS_NORM_OVERLOADS(f32, f32, float, float)
RMS_NORM_OVERLOADS(bf16, bf16, uint16_t, uint16_t)
RMS_NORM_OVERLOADS(bf16, f32, uint16_t, float)
RMS_NORM_OVERLOADS(f32, bf16, float, uint16_t)

constexpr int64_t MAX_HEAD_DIM = 1024;     // rms_norm.cpp's q/k row buffer

template <typename T> T* data(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// Calls f(T{}, TW{}) with the element types of the activations' and the weight's dtypes.
template <typename F>
void by_norm_dtypes(const Tensor& x, const Tensor& weight, F&& f) {
  const bool xf = x.scalar_type() == at::kFloat, wf = weight.scalar_type() == at::kFloat;
  if (xf && wf) f(float{}, float{});
  else if (xf) f(float{}, uint16_t{});
  else if (wf) f(uint16_t{}, float{});
  else f(uint16_t{}, uint16_t{});
}

void check_norm(const char* op, const Tensor& x, const Tensor& weight, int64_t D) {
  TORCH_CHECK_VALUE(conv_dtype(x.scalar_type()) && conv_dtype(weight.scalar_type()) && x.dim() >= 1 &&
                        weight.dim() == 1 && weight.size(0) == D && x.size(-1) == D,
                    op, ": no kernel for x ", dtype_name(x), " ", shape(x), " with a weight ", dtype_name(weight),
                    " ", shape(weight), " (float32 or bfloat16, a weight [D] for the last dim D)");
}

Tensor rows_of(const Tensor& t, int64_t D) {            // [..., D] -> [R, D], the last dim contiguous
  const Tensor rows = t.dim() == 2 ? t : t.reshape({-1, D});
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

Tensor heads_of(const Tensor& t, int64_t D) {           // [..., D] -> [tokens, heads, D]
  const Tensor heads = t.dim() == 3 ? t : t.dim() < 3 ? t.reshape({-1, 1, D}) : t.reshape({-1, t.size(-2), D});
  return heads.stride(-1) == 1 ? heads : heads.contiguous();
}

// x [..., D] -> x * rsqrt(mean(x^2) + eps) * (1 + weight), x's dtype, contiguous.
Tensor rms_norm_op(const Tensor& x, const Tensor& weight_in, double eps) {
  const int64_t D = x.dim() ? x.size(-1) : 0;
  check_norm("rms_norm", x, weight_in, D);
  Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return y;
  const Tensor rows = rows_of(x, D), weight = dense(weight_in);
  by_norm_dtypes(x, weight, [&](auto t, auto tw) {
    using T = decltype(t);
    using TW = decltype(tw);
    rms_norm_entry(data<const T>(rows), data<const TW>(weight), data<T>(y), rows.size(0), 1, D, rows.stride(0), 0,
                   eps, threads());
  });
  return y;
}

// x, h [..., D] of one dtype -> (x + h, its zero-centred norm), both x's dtype.
std::tuple<Tensor, Tensor> add_rms_norm_op(const Tensor& x, const Tensor& h, const Tensor& weight_in, double eps) {
  const int64_t D = x.dim() ? x.size(-1) : 0;
  check_norm("add_rms_norm", x, weight_in, D);
  TORCH_CHECK_VALUE(h.scalar_type() == x.scalar_type() && h.sizes() == x.sizes(), "add_rms_norm: h ",
                    dtype_name(h), " ", shape(h), " is not of x's dtype and shape ", dtype_name(x), " ", shape(x));
  Tensor total = at::empty(x.sizes(), x.options()), y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return {total, y};
  const Tensor xr = rows_of(x, D), hr = rows_of(h, D), weight = dense(weight_in);
  by_norm_dtypes(x, weight, [&](auto t, auto tw) {
    using T = decltype(t);
    using TW = decltype(tw);
    add_rms_norm_entry(data<const T>(xr), data<const T>(hr), data<const TW>(weight), data<T>(total), data<T>(y),
                       xr.size(0), D, xr.stride(0), hr.stride(0), eps, threads());
  });
  return {total, y};
}

// x, z [..., D] of one dtype (z may be a strided slice) -> weight * rmsnorm(x) * silu(z), with a
// plain weight, x's dtype.
Tensor gated_rms_norm_op(const Tensor& x, const Tensor& z, const Tensor& weight_in, double eps) {
  const int64_t D = x.dim() ? x.size(-1) : 0;
  check_norm("gated_rms_norm", x, weight_in, D);
  TORCH_CHECK_VALUE(z.scalar_type() == x.scalar_type() && z.sizes() == x.sizes(), "gated_rms_norm: z ",
                    dtype_name(z), " ", shape(z), " is not of x's dtype and shape ", dtype_name(x), " ", shape(x));
  Tensor y = at::empty(x.sizes(), x.options());
  if (y.numel() == 0) return y;
  const Tensor xr = heads_of(x, D), zr = heads_of(z, D), weight = dense(weight_in);
  by_norm_dtypes(x, weight, [&](auto t, auto tw) {
    using T = decltype(t);
    using TW = decltype(tw);
    gated_rms_norm_entry(data<const T>(xr), data<const T>(zr), data<const TW>(weight), data<T>(y), xr.size(0),
                         xr.size(1), D, xr.stride(0), xr.stride(1), zr.stride(0), zr.stride(1), eps, threads());
  });
  return y;
}

// q [T, nh, hd], k [T, nkv, hd] (strided heads allowed), weights [hd], cos/sin [T, rot] in q's
// dtype -> [T, nh + nkv, hd]: q's heads then k's, normed and rotated.
Tensor qk_norm_rope_op(const Tensor& q, const Tensor& k, const Tensor& q_weight_in, const Tensor& k_weight_in,
                       double eps, const Tensor& cos_in, const Tensor& sin_in) {
  const int64_t hd = q.dim() == 3 ? q.size(2) : 0, rot = cos_in.dim() == 2 ? cos_in.size(1) : -1;
  check_norm("qk_norm_rope", q, q_weight_in, hd);
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == hd &&
                        k.scalar_type() == q.scalar_type() && q.stride(2) == 1 && k.stride(2) == 1 &&
                        k_weight_in.sizes() == q_weight_in.sizes() &&
                        k_weight_in.scalar_type() == q_weight_in.scalar_type() &&
                        cos_in.scalar_type() == q.scalar_type() && sin_in.sizes() == cos_in.sizes() &&
                        sin_in.scalar_type() == q.scalar_type() && cos_in.size(0) == q.size(0) && rot >= 0 &&
                        rot % 2 == 0 && rot <= hd && hd <= MAX_HEAD_DIM,
                    "qk_norm_rope: no kernel for q ", shape(q), " ", dtype_name(q), ", k ", shape(k), " ",
                    dtype_name(k), ", cos ", shape(cos_in), " ", dtype_name(cos_in),
                    " (heads of one dtype and size <= 1024, cos and sin [T, even rot <= hd] in q's dtype)");
  const int64_t T = q.size(0), nh = q.size(1), nkv = k.size(1);
  Tensor out = at::empty({T, nh + nkv, hd}, q.options());
  if (T == 0 || hd == 0) return out;
  const Tensor cos = dense(cos_in), sin = dense(sin_in), qw = dense(q_weight_in), kw = dense(k_weight_in);
  by_norm_dtypes(q, qw, [&](auto t, auto tw) {
    using T_ = decltype(t);
    using TW = decltype(tw);
    qk_norm_rope_entry(data<const T_>(q), data<const T_>(k), data<const TW>(qw), data<const TW>(kw),
                       data<const T_>(cos), data<const T_>(sin), data<T_>(out), T, nh, nkv, hd, rot, q.stride(0),
                       q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps, threads());
  });
  return out;
}

// ---- silu_mul.cpp -----------------------------------------------------------------------------

// x [..., 2I] (rows [gate | up], the last dim contiguous) -> silu(gate) * up [..., I], x's dtype.
Tensor silu_mul_op(const Tensor& x) {
  const int64_t D = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK_VALUE(conv_dtype(x.scalar_type()) && x.dim() >= 1 && D % 2 == 0,
                    "silu_mul: no kernel for x ", dtype_name(x), " ", shape(x),
                    " (float32 or bfloat16, an even last dim [gate | up])");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = D / 2;
  Tensor y = at::empty(sizes, x.options());
  if (y.numel() == 0) return y;
  const Tensor rows = rows_of(x, D);
  if (x.scalar_type() == at::kFloat)
    silu_mul_f32(rows.const_data_ptr<float>(), y.mutable_data_ptr<float>(), rows.size(0), D / 2, rows.stride(0),
                 threads());
  else
    silu_mul_bf16(static_cast<const uint16_t*>(rows.const_data_ptr()), static_cast<uint16_t*>(y.mutable_data_ptr()),
                  rows.size(0), D / 2, rows.stride(0), threads());
  return y;
}

// ---- a quantized projection with float rows after it ------------------------------------------

// x [..., K] -> [x Wq^T | (x Wt^T)[..., :tail_rows]]: a quantized layer whose last shards stay float
// (the GDN in_proj's b and a rows), its packed product and its blocked float tail's (widen: the
// widened-tile form, linear_blocked's flag) in one call, the same values as linear_quant,
// linear_blocked and a cat, without the Python and dispatch between them.
Tensor quant_linear_tail_op(const Tensor& x, const Tensor& q, const std::optional<Tensor>& zeros, int64_t bits,
                            int64_t group, const Tensor& tail_blocked, bool widen, int64_t tail_rows) {
  const Tensor y = quant_linear_op(x, q, zeros, bits, group);
  const Tensor tail = blocked_linear_op(x, tail_blocked, widen);
  TORCH_CHECK_VALUE(tail_rows >= 0 && tail_rows <= tail.size(-1), "linear_quant_tail: ", tail_rows,
                    " rows of a blocked tail ", shape(tail_blocked), " of ", tail.size(-1));
  std::vector<int64_t> sizes = y.sizes().vec();
  const int64_t n = sizes.back();
  sizes.back() = n + tail_rows;
  Tensor out = at::empty(sizes, y.options());
  out.narrow(-1, 0, n).copy_(y);
  out.narrow(-1, n, tail_rows).copy_(tail.narrow(-1, 0, tail_rows));
  return out;
}

// ---- the quantized SwiGLU MLP -----------------------------------------------------------------

// x [..., H] -> silu_mul(x Wgu^T) Wd^T [..., N] from two packed quantized weights (gate_up: the
// merged [gate | up] projection, 2I columns; down: I columns in), x's dtype. The three calls a
// quantized MLP makes (linear_quant, silu_mul, linear_quant) in C++ one after the other: the same
// values as those calls, without the Python and dispatch between them, which at batch 1 cost a
// quantized MLP a good part of its products' time (benchmarks/RESULTS.md, issue 39).
Tensor quant_mlp_op(const Tensor& x, const Tensor& gate_up_q, const std::optional<Tensor>& gate_up_zeros,
                    const Tensor& down_q, const std::optional<Tensor>& down_zeros, int64_t bits, int64_t group) {
  // (the first product checks x, gate_up and the groups against x; down's against the activation here)
  TORCH_CHECK_VALUE(gate_up_q.dim() == 2 && down_q.dim() == 2, "mlp_quant: gate_up ", shape(gate_up_q),
                    " and down ", shape(down_q), " are not packed weights [blocks, bytes]");
  const int64_t i = gate_up_q.size(0) * 8;                 // half of gate_up's 2I columns
  TORCH_CHECK_VALUE((bits == 8 || bits == 4) && group >= 32 && group % 32 == 0 && i % group == 0 &&
                        down_q.size(1) == quant_linear_block_bytes(i, group, bits),
                    "mlp_quant: down ", shape(down_q), " does not take the ", i, " columns of gate_up ",
                    shape(gate_up_q), "'s activation (int", bits, " in groups of ", group, ")");
  const Tensor h = silu_mul_op(quant_linear_op(x, gate_up_q, gate_up_zeros, bits, group));
  return quant_linear_op(h, down_q, down_zeros, bits, group);
}

// ---- token_bitmask.cpp ------------------------------------------------------------------------

// logits [N, V] float32 (vocab contiguous), in place: -inf where bitmask [N, >= ceil(V/32)]
// int32 (words contiguous) has a 0 bit.
void apply_token_bitmask_op(const Tensor& logits, const Tensor& bitmask) {
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat && bitmask.scalar_type() == at::kInt && logits.dim() == 2 &&
                        bitmask.dim() == 2 && logits.size(0) == bitmask.size(0) &&
                        bitmask.size(1) * 32 >= logits.size(1) && logits.stride(1) == 1 && bitmask.stride(1) == 1,
                    "apply_token_bitmask: no kernel for logits ", dtype_name(logits), " ", shape(logits),
                    " and bitmask ", dtype_name(bitmask), " ", shape(bitmask),
                    " (float32 [N, V] and int32 [N, >= ceil(V/32)], their last dims contiguous)");
  if (logits.numel() == 0) return;
  apply_token_bitmask_f32(logits.mutable_data_ptr<float>(), bitmask.const_data_ptr<int32_t>(), logits.size(0),
                          logits.size(1), logits.stride(0), bitmask.stride(0), threads());
}

// ---- the ops ----------------------------------------------------------------------------------

void define_ops(torch::Library& m) {
  // No schema defaults: inductor's C++ wrapper leaves out an argument equal to its default and
  // hands the dispatcher a shorter stack (torch 2.13), so the kernel would read it from past the
  // end (linear_blocked's `widen` read True from garbage in an MTP pass). The blocked product is
  // named linear_blocked since: inductor's on-disk cache keys graphs by their code, not by the
  // schemas of the ops they call, and would serve graphs compiled for the old schema.
  m.def("linear_blocked(Tensor x, Tensor w_blocked, bool widen) -> Tensor");
  m.def("blocked_rows(Tensor w_blocked, Tensor ids, int k) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor q, Tensor? zeros, int bits, int group) -> Tensor");
  m.def("quantize_int4(Tensor w, int group) -> (Tensor, Tensor)");
  m.def("quant_rows(Tensor q, Tensor? zeros, Tensor ids, int bits, int group, int k) -> Tensor");
  m.def("rescore_top(Tensor x, Tensor(a!) y, Tensor q, Tensor? zeros, int bits, int group, int count) -> ()");
  m.def("mlp_blocked(Tensor x, Tensor gate_up_blocked, Tensor down_blocked) -> Tensor");
  m.def("linear_quant_tail(Tensor x, Tensor q, Tensor? zeros, int bits, int group, Tensor tail_blocked, bool widen, "
        "int tail_rows) -> Tensor");
  m.def("mlp_quant(Tensor x, Tensor gate_up_q, Tensor? gate_up_zeros, Tensor down_q, Tensor? down_zeros, "
        "int bits, int group) -> Tensor");
  m.def("gdn_recurrent(Tensor kq, Tensor decay, Tensor beta, Tensor v, Tensor(a!) state_pool, "
        "Tensor read_slots, Tensor write_slots) -> Tensor");
  m.def("paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) window_pool, Tensor read_slots, "
        "Tensor write_slots) -> Tensor");
  m.def("gdn_decode(Tensor mixed, Tensor b, Tensor a, Tensor conv_weight, Tensor(a!) conv_pool, "
        "Tensor dt_bias, Tensor neg_decay_rate, Tensor(b!) state_pool, Tensor read_slots, Tensor write_slots, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor h, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, "
        "Tensor sin) -> Tensor");
}

void cpu_impls(torch::Library& m) {
  m.impl("linear_blocked", blocked_linear_op);
  m.impl("mlp_blocked", blocked_mlp_op);
  m.impl("mlp_quant", quant_mlp_op);
  m.impl("linear_quant_tail", quant_linear_tail_op);
  m.impl("blocked_rows", blocked_rows_op);
  m.impl("linear_quant", quant_linear_op);
  m.impl("quantize_int4", quantize_int4_op);
  m.impl("quant_rows", quant_rows_op);
  m.impl("rescore_top", rescore_top_op);
  m.impl("gdn_recurrent", gdn_recurrent_op);
  m.impl("paged_attention_decode", paged_attention_decode_op);
  m.impl("causal_conv1d_update", causal_conv1d_update_op);
  m.impl("gdn_decode", gdn_decode_op);
  m.impl("rms_norm", rms_norm_op);
  m.impl("add_rms_norm", add_rms_norm_op);
  m.impl("gated_rms_norm", gated_rms_norm_op);
  m.impl("qk_norm_rope", qk_norm_rope_op);
  m.impl("silu_mul", silu_mul_op);
  m.impl("apply_token_bitmask", apply_token_bitmask_op);
}

// What TORCH_LIBRARY_FRAGMENT(ns, m) and TORCH_LIBRARY_IMPL(ns, CPU, m) expand to, with the
// namespace a string of the library's rather than a macro argument: registered when the
// library is loaded.
const torch::detail::TorchLibraryInit definitions(torch::Library::FRAGMENT, &define_ops, hybrid_engine_ops_namespace,
                                                  std::nullopt, __FILE__, __LINE__);
const torch::detail::TorchLibraryInit implementations(torch::Library::IMPL, &cpu_impls, hybrid_engine_ops_namespace,
                                                      c10::DispatchKey::CPU, __FILE__, __LINE__);

}  // namespace
