// The cpu platform's row-wise ops: rms_norm, add_rms_norm, rotary_embedding (neox and gptj), silu_and_mul.
//
// Each replaces a chain of 5-15 ATen ops (graphinfer/ops/norm.py, rotary.py, activation.py) by one pass over the
// rows; at batch 1 those chains cost more than their arithmetic (a decode step of SmolLM2 ran ~1,000 of them).
// Results follow the PyTorch reference's rounding: math in fp32, and in bf16/fp16 every intermediate the
// reference materialises in the input dtype is rounded to it here too. What differs is at the level of fp32 ulps
// (the order of the rms_norm sum, FMA contraction, exp), which now and then flips a bf16/fp16 rounding. Inputs must be contiguous over the last dimension
// (graphinfer/ops/cpu_elementwise.py checks and falls back to the reference otherwise).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

// Round through the storage dtype (identity for float): the reference materialises these values in it.
template <typename scalar_t>
inline float rnd(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// Rows per task: small batches stay on the calling thread (OpenMP start-up costs more than the work).
inline int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

template <typename scalar_t>
void norm_rows(const scalar_t* x, const scalar_t* res, const scalar_t* w, scalar_t* out, scalar_t* res_out,
               int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * n;
      float ss = 0.f;
      if (res) {  // residual' = x + residual, in the input dtype
        const scalar_t* rr = res + r * n;
        scalar_t* ro = res_out + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t s = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          ro[i] = s;
          h[i] = static_cast<float>(s);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) h[i] = static_cast<float>(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      scalar_t* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * rnd<scalar_t>(h[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight: [hidden] in x's dtype");
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        nullptr, rows, n, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual: x's shape and dtype");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight: [hidden] in x's dtype");
  auto out = at::empty_like(x);
  auto new_residual = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), new_residual.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps));
  });
  return {out, new_residual};
}

// One token's heads: x [H, head_size] -> o. cos/sin hold rot_dim / 2 values already rounded to the input dtype.
template <typename scalar_t>
inline void rotate_token(const scalar_t* x, scalar_t* o, int64_t H, int64_t head_size, int64_t half,
                         const float* c, const float* s, bool neox) {
  for (int64_t h = 0; h < H; ++h) {
    const scalar_t* xh = x + h * head_size;
    scalar_t* oh = o + h * head_size;
    for (int64_t i = 0; i < half; ++i) {
      // neox: pairs (i, i + half); gptj: pairs (2i, 2i + 1). out1 = x1 c - x2 s, out2 = x2 c + x1 s, each product
      // rounded as the reference's `x * cos + rotated * sin` rounds it.
      const int64_t i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
      const float x1 = static_cast<float>(xh[i1]), x2 = static_cast<float>(xh[i2]);
      oh[i1] = static_cast<scalar_t>(rnd<scalar_t>(x1 * c[i]) + rnd<scalar_t>(-x2 * s[i]));
      oh[i2] = static_cast<scalar_t>(rnd<scalar_t>(x2 * c[i]) + rnd<scalar_t>(x1 * s[i]));
    }
    for (int64_t i = 2 * half; i < head_size; ++i) oh[i] = xh[i];  // partial rotary: the tail passes through
  }
}

template <typename scalar_t, typename cache_t>
void rotary(const int64_t* pos, const scalar_t* q, const scalar_t* k, scalar_t* qo, scalar_t* ko, const cache_t* cache,
            int64_t T, int64_t Hq, int64_t Hk, int64_t head_size, int64_t rot_dim, bool neox) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, T, grain((Hq + Hk) * head_size), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      const cache_t* cs = cache + pos[t] * rot_dim;
      for (int64_t i = 0; i < half; ++i) {  // the reference casts the cache to the input dtype first
        c[i] = rnd<scalar_t>(static_cast<float>(cs[i]));
        s[i] = rnd<scalar_t>(static_cast<float>(cs[half + i]));
      }
      rotate_token(q + t * Hq * head_size, qo + t * Hq * head_size, Hq, head_size, half, c.data(), s.data(), neox);
      rotate_token(k + t * Hk * head_size, ko + t * Hk * head_size, Hk, head_size, half, c.data(), s.data(), neox);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, int64_t head_size,
                                                    const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rows(query, "query");
  check_rows(key, "key");
  check_rows(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key: one dtype");
  const auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = pos.numel(), rot_dim = cos_sin_cache.size(-1);
  TORCH_CHECK(query.size(0) == T && key.size(0) == T, "query/key: one row per position");
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_size, "cos_sin_cache: [max_position, rot_dim <= head_size]");
  const int64_t Hq = T ? query.numel() / T / head_size : 0, Hk = T ? key.numel() / T / head_size : 0;
  auto qo = at::empty_like(query);
  auto ko = at::empty_like(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cos_sin_cache.scalar_type(), "rotary_cache", [&] {
      rotary<x_t, scalar_t>(pos.data_ptr<int64_t>(), query.data_ptr<x_t>(), key.data_ptr<x_t>(), qo.data_ptr<x_t>(),
                            ko.data_ptr<x_t>(), cos_sin_cache.data_ptr<scalar_t>(), T, Hq, Hk, head_size, rot_dim,
                            is_neox);
    });
  });
  return {qo, ko};
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * d;
      const scalar_t* u = g + d;
      scalar_t* o = out + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float gi = static_cast<float>(g[i]);
        o[i] = static_cast<scalar_t>(rnd<scalar_t>(gi / (1.f + std::exp(-gi))) * static_cast<float>(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t n2 = x.size(-1), d = n2 / 2, rows = n2 ? x.numel() / n2 : 0;
  // The loop's std::exp does not vectorise (glibc's vector expf needs -ffast-math): from a few rows on, ATen's
  // vectorised silu and mul cost less than the chain's dispatches (the same rounding: the reference's ops).
  if (rows > 4) return at::silu(x.narrow(-1, 0, d)) * x.narrow(-1, d, d);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding(Tensor positions, Tensor query, Tensor key, int head_size, Tensor cos_sin_cache, "
        "bool is_neox) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
