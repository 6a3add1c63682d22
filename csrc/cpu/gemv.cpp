// The cpu platform's few-row dense linear: out = x W^T + b for x of 1..kMaxRows rows (batch-1 decode), W [N, K] in
// fp32 or bf16 as the model holds it (graphinfer/compiler/cpu_packed_linear.py calls it; more rows go to oneDNN).
//
// A decode step reads each weight once from memory, so the kernel is a stream: OpenMP over blocks of kRowBlock
// adjacent rows (one contiguous run of memory each), each block's rows dotted with every x row in fp32 vectors
// (vec.h: AVX2 or AVX-512 as torch dispatches), bf16 weights widened in registers (products exact, sums fp32: a
// bf16 GEMM's numerics, at half the fp32 bytes). Sums run in a different order than oneDNN's or MKL's: results
// agree to fp32 rounding, not bit for bit.
//
// Why not a library call: at one row on the 2-core AMD EPYC (AVX2) dev VM, oneDNN's prepacked matmul
// (torch.ops.mkldnn._linear_pointwise) costs ~30 us a call whatever the shape and MKL's GEMV (F.linear) streams at
// ~13 GB/s; this kernel's call costs a few us and streams near a plain read (tools/cpu_gemv_bench.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace {

using cpu_vec::fVec;
using cpu_vec::kVec;
using cpu_vec::reduce_sum;

constexpr int64_t kMaxRows = 4;      // x rows served; the caller sends more to oneDNN
constexpr int64_t kRowBlock = 8;     // weight rows per register tile
constexpr int kUnroll = 2;           // vectors along K a step: kRowBlock x kUnroll FMA chains (fewer measured slower)

// out[t, n0..n0+R) for every x row t; the R weight rows are read from memory once (later x rows hit L1/L2).
template <typename w_t, int R>
inline void tile(const float* x, const w_t* w, const float* bias, float* out, int64_t T, int64_t K, int64_t N,
                 int64_t n0) {
  const w_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + (n0 + r) * K;
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    fVec acc[R][kUnroll];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < kUnroll; ++u) acc[r][u] = fVec(0.f);
    int64_t k = 0;
    for (; k + kUnroll * kVec <= K; k += kUnroll * kVec) {  // R x kUnroll independent FMA chains
      for (int u = 0; u < kUnroll; ++u) {
        const fVec xv = fVec::loadu(xt + k + u * kVec);
        for (int r = 0; r < R; ++r)
          acc[r][u] = at::vec::fmadd(cpu_vec::load(rows[r] + k + u * kVec), xv, acc[r][u]);
      }
    }
    for (; k < K; k += kVec) {  // the tail: lanes past K load as 0
      const int64_t m = std::min(kVec, K - k);
      const fVec xv = fVec::loadu(xt + k, m);
      for (int r = 0; r < R; ++r) acc[r][0] = at::vec::fmadd(cpu_vec::load(rows[r] + k, m), xv, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      for (int u = 1; u < kUnroll; ++u) acc[r][0] = acc[r][0] + acc[r][u];
      out[t * N + n0 + r] = reduce_sum(acc[r][0]) + (bias ? bias[n0 + r] : 0.f);
    }
  }
}

template <typename w_t>
void gemv_kernel(const float* x, const w_t* w, const float* bias, float* out, int64_t T, int64_t K, int64_t N) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // >= ~64 KiB of weight a task: smaller layers stay on fewer threads (OpenMP start-up costs more than the work)
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kRowBlock * K * static_cast<int64_t>(sizeof(w_t))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowBlock;
      if (n0 + kRowBlock <= N) {
        tile<w_t, kRowBlock>(x, w, bias, out, T, K, N, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) tile<w_t, 1>(x, w, bias, out, T, K, N, n);
      }
    }
  });
}

// x [..., K] (T <= kMaxRows rows) fp32 or bf16; weight [N, K] fp32 or bf16, contiguous; bias [N] or none -> [..., N]
// in x's dtype. Leading dims are handled here, not in Python: a reshape and a view there cost more than the kernel's
// call (tools/cpu_gemv_bench.py, "call_us").
at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x_in.size(-1) && weight.is_contiguous(),
              "gemv: weight must be a contiguous [N, K] for x [..., K]");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)});
  TORCH_CHECK(x.size(0) <= kMaxRows, "gemv: x must have T <= ", kMaxRows, " rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "gemv: weight must be fp32 or bf16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv: x must be fp32 or bf16");
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // no copy for fp32 rows
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv: bias must be [N]");
    bf = bias->to(at::kFloat).contiguous();
  }
  auto shape = x_in.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  if (weight.scalar_type() == at::kFloat) {
    gemv_kernel(xf.data_ptr<float>(), weight.data_ptr<float>(), b, out.data_ptr<float>(), T, K, N);
  } else {
    gemv_kernel(xf.data_ptr<float>(), weight.data_ptr<at::BFloat16>(), b, out.data_ptr<float>(), T, K, N);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphinfer_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu, CPU, m) {
  m.impl("gemv", &gemv);
}
