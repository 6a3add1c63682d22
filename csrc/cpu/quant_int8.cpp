// The cpu platform's int8 activation-quantized linear pieces (the w8a8 scheme): graphinfer::dynamic_quant and
// graphinfer::scaled_mm (graphinfer/ops/quant.py) for int8, bit for bit as their references.
//
// - dynamic_quant_int8: per-token symmetric quantization in one pass per row (the reference runs five ATen ops:
//   abs, amax, div, clamp, round): scale = max|x| / 127 (at least 1e-10) or the static input_scale, codes
//   round-half-even(clamp(x / scale, -127, 127)), the same fp32 divisions as the reference.
// - scaled_mm_int8: the exact int32 GEMM of at::_int_mm (oneDNN, VNNI where the CPU has it; the reference computes
//   it in fp64), then one fused pass out = float(acc) * a_scale * b_scale + bias in out_dtype, the reference's
//   order of fp32 operations.
// Part of graphinfer/ops/cpu/_cpu_kernels.so (graphinfer/ops/cpu/ext.py); bound by graphinfer/ops/cpu/quant.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

constexpr float kInt8Max = 127.f;
constexpr float kMinScale = 1e-10f;

template <typename scalar_t>
void quant_rows(const scalar_t* x, int8_t* q, float* scale, int64_t T, int64_t K, const float* static_scale) {
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* xr = x + t * K;
      int8_t* qr = q + t * K;
      float s;
      if (static_scale) {
        s = *static_scale;
      } else {
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
        s = std::max(amax / kInt8Max, kMinScale);
      }
      scale[t] = s;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::min(std::max(static_cast<float>(xr[k]) / s, -kInt8Max), kInt8Max);
        qr[k] = static_cast<int8_t>(std::nearbyint(v));  // round half to even, as torch.round
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> dynamic_quant_int8(const at::Tensor& x_in, const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.is_floating_point(), "dynamic_quant_int8: x must be a float tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), T = K ? x.numel() / K : 0;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scale_shape = x.sizes().vec();
  scale_shape.back() = 1;
  at::Tensor scale = at::empty(scale_shape, x.options().dtype(at::kFloat));
  at::Tensor st;
  if (input_scale.has_value()) {
    st = input_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(st.numel() == 1, "dynamic_quant_int8: input_scale must hold one value");
  }
  const float* sp = st.defined() ? st.data_ptr<float>() : nullptr;
  if (x.numel() == 0) {
    if (sp) scale.fill_(*sp);
    else scale.fill_(kMinScale);
    return {q, scale};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dynamic_quant_int8", [&] {
    quant_rows<scalar_t>(x.data_ptr<scalar_t>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), T, K, sp);
  });
  return {q, scale};
}

// One output row: float(acc) * a_scale * b_scale[n] (+ bias[n]) in the reference's order of fp32 operations (no
// FMA contraction: the product is rounded before the bias is added, as in the reference).
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"), noinline)) void scale_row(const int32_t* acc, float st, const float* bs,
                                                                      const float* bias, scalar_t* out, int64_t N) {
  if (bias) {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) out[n] = static_cast<scalar_t>(static_cast<float>(acc[n]) * st * bs[n] + bias[n]);
  } else {
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) out[n] = static_cast<scalar_t>(static_cast<float>(acc[n]) * st * bs[n]);
  }
}

template <typename scalar_t>
void scale_rows(const int32_t* acc, const float* as, const float* bs, const float* bias, scalar_t* out, int64_t T,
                int64_t N) {
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / N), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) scale_row<scalar_t>(acc + t * N, as[t], bs, bias, out + t * N, N);
  });
}

at::Tensor scaled_mm_int8(const at::Tensor& a, const at::Tensor& a_scale_in, const at::Tensor& b,
                          const at::Tensor& b_scale_in, const std::optional<at::Tensor>& bias_in,
                          at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == at::kChar && b.scalar_type() == at::kChar,
              "scaled_mm_int8: a [T, K] and b [N, K] must be int8");
  TORCH_CHECK(a.size(1) == b.size(1), "scaled_mm_int8: a ", a.sizes(), " and b ", b.sizes(), " differ in K");
  const int64_t T = a.size(0), N = b.size(0);
  const at::Tensor a_scale = a_scale_in.to(at::kFloat).contiguous(), b_scale = b_scale_in.to(at::kFloat).contiguous();
  TORCH_CHECK(a_scale.numel() == T && b_scale.numel() == N, "scaled_mm_int8: a_scale [T, 1], b_scale [N]");
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "scaled_mm_int8: bias must have N = ", N, " elements");
  }
  at::Tensor out = at::empty({T, N}, a.options().dtype(out_dtype));
  if (T == 0 || N == 0) return out;
  const at::Tensor acc = a.size(1) ? at::_int_mm(a.contiguous(), b.t()).contiguous()
                                   : at::zeros({T, N}, a.options().dtype(at::kInt));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* as = a_scale.data_ptr<float>();
  const float* bs = b_scale.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "scaled_mm_int8", [&] {
    scale_rows<scalar_t>(acc.data_ptr<int32_t>(), a_scale.data_ptr<float>(), b_scale.data_ptr<float>(),
                         bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(), T, N);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphinfer_cpu_quant, m) {
  m.def("dynamic_quant_int8(Tensor x, Tensor? input_scale) -> (Tensor, Tensor)");
  m.def("scaled_mm_int8(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu_quant, CPU, m) {
  m.impl("dynamic_quant_int8", &dynamic_quant_int8);
  m.impl("scaled_mm_int8", &scaled_mm_int8);
}
