// The cpu platform's row-wise ops: rms_norm, add_rms_norm, rotary_embedding (neox and gptj), silu_and_mul.
//
// Each replaces a chain of 5-15 ATen ops (graphinfer/ops/norm.py, rotary.py, activation.py) by one pass over the
// rows; at batch 1 those chains cost more than their arithmetic (a decode step of SmolLM2 ran ~1,000 of them).
// Results follow the PyTorch reference's rounding: math in fp32, and in bf16/fp16 every intermediate the
// reference materialises in the input dtype is rounded to it here too. What differs is at the level of fp32 ulps
// (the order of the rms_norm sum, exp), which now and then flips a bf16/fp16 rounding. Rows are read and written
// as float vectors (vec.h): a scalar loop over bf16 converts element by element.
// Inputs must be contiguous rows (rotary's query and key: contiguous within a token, any row stride, as the
// slices of a fused qkv output are); graphinfer/ops/cpu/elementwise.py checks and falls back to the reference.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

using cpu_vec::fVec;
using cpu_vec::kVec;
using cpu_vec::load;
using cpu_vec::reduce_sum;
using cpu_vec::round_to;
using cpu_vec::store;

// One value rounded through the storage dtype (identity for float): the reference materialises it in that dtype.
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
      fVec ss(0.f);
      for (int64_t i = 0; i < n; i += kVec) {
        const int64_t m = std::min(kVec, n - i);
        fVec v = load(x + r * n + i, m);
        if (res) {  // residual' = x + residual, in the input dtype
          v = v + load(res + r * n + i, m);
          store(res_out + r * n + i, v, m);
          v = round_to<scalar_t>(v);
        }
        v.store(h.data() + i, m);
        ss = at::vec::fmadd(v, v, ss);  // lanes past m load as 0
      }
      const fVec inv(1.f / std::sqrt(reduce_sum(ss) / static_cast<float>(n) + eps));
      for (int64_t i = 0; i < n; i += kVec) {
        const int64_t m = std::min(kVec, n - i);
        store(out + r * n + i, load(w + i, m) * round_to<scalar_t>(fVec::loadu(h.data() + i, m) * inv), m);
      }
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
// out1 = x1 c - x2 s, out2 = x2 c + x1 s, each product rounded as the reference's `x * cos + rotated * sin` rounds
// it. neox pairs (i, i + half), contiguous halves: vectors; gptj pairs (2i, 2i + 1): element by element.
template <typename scalar_t>
inline void rotate_token(const scalar_t* x, scalar_t* o, int64_t H, int64_t head_size, int64_t half,
                         const float* c, const float* s, bool neox) {
  for (int64_t h = 0; h < H; ++h) {
    const scalar_t* xh = x + h * head_size;
    scalar_t* oh = o + h * head_size;
    if (neox) {
      for (int64_t i = 0; i < half; i += kVec) {
        const int64_t m = std::min(kVec, half - i);
        const fVec x1 = load(xh + i, m), x2 = load(xh + half + i, m);
        const fVec ci = fVec::loadu(c + i, m), si = fVec::loadu(s + i, m);
        store(oh + i, round_to<scalar_t>(x1 * ci) - round_to<scalar_t>(x2 * si), m);
        store(oh + half + i, round_to<scalar_t>(x2 * ci) + round_to<scalar_t>(x1 * si), m);
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xh[2 * i]), x2 = static_cast<float>(xh[2 * i + 1]);
        oh[2 * i] = static_cast<scalar_t>(rnd<scalar_t>(x1 * c[i]) - rnd<scalar_t>(x2 * s[i]));
        oh[2 * i + 1] = static_cast<scalar_t>(rnd<scalar_t>(x2 * c[i]) + rnd<scalar_t>(x1 * s[i]));
      }
    }
    for (int64_t i = 2 * half; i < head_size; ++i) oh[i] = xh[i];  // partial rotary: the tail passes through
  }
}

template <typename scalar_t, typename cache_t>
void rotary(const int64_t* pos, const scalar_t* q, int64_t q_row, const scalar_t* k, int64_t k_row, scalar_t* qo,
            scalar_t* ko, const cache_t* cache, int64_t T, int64_t Hq, int64_t Hk, int64_t head_size, int64_t rot_dim,
            bool neox) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, T, grain((Hq + Hk) * head_size), [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      const cache_t* cs = cache + pos[t] * rot_dim;
      for (int64_t i = 0; i < half; ++i) {  // the reference casts the cache to the input dtype first
        c[i] = rnd<scalar_t>(static_cast<float>(cs[i]));
        s[i] = rnd<scalar_t>(static_cast<float>(cs[half + i]));
      }
      rotate_token(q + t * q_row, qo + t * Hq * head_size, Hq, head_size, half, c.data(), s.data(), neox);
      rotate_token(k + t * k_row, ko + t * Hk * head_size, Hk, head_size, half, c.data(), s.data(), neox);
    }
  });
}

// A token's heads contiguous (the last dims dense), rows at any stride: the q and k slices of a fused qkv output.
bool token_rows(const at::Tensor& t) {
  if (t.dim() < 2) return false;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, int64_t head_size,
                                                    const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(token_rows(query) && token_rows(key), "query and key: each token's heads contiguous");
  check_rows(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "query and key: one dtype");
  const auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = pos.numel(), rot_dim = cos_sin_cache.size(-1);
  TORCH_CHECK(query.size(0) == T && key.size(0) == T, "query/key: one row per position");
  TORCH_CHECK(rot_dim % 2 == 0 && rot_dim <= head_size, "cos_sin_cache: [max_position, rot_dim <= head_size]");
  const int64_t Hq = T ? query.numel() / T / head_size : 0, Hk = T ? key.numel() / T / head_size : 0;
  auto qo = at::empty(query.sizes(), query.options());
  auto ko = at::empty(key.sizes(), key.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    using x_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cos_sin_cache.scalar_type(), "rotary_cache", [&] {
      rotary<x_t, scalar_t>(pos.data_ptr<int64_t>(), query.data_ptr<x_t>(), query.stride(0), key.data_ptr<x_t>(),
                            key.stride(0), qo.data_ptr<x_t>(), ko.data_ptr<x_t>(), cos_sin_cache.data_ptr<scalar_t>(),
                            T, Hq, Hk, head_size, rot_dim, is_neox);
    });
  });
  return {qo, ko};
}

// silu(gate) * up, silu in fp32 as ATen's (x / (1 + exp(-x)), Sleef's exp) and rounded to the dtype before the
// product, as the reference's silu(x[..., :d]) * x[..., d:] rounds it.
template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* out, int64_t rows, int64_t d) {
  const fVec one(1.f);
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * d;
      const scalar_t* u = g + d;
      scalar_t* o = out + r * d;
      for (int64_t i = 0; i < d; i += kVec) {
        const int64_t m = std::min(kVec, d - i);
        const fVec gi = load(g + i, m);
        store(o + i, round_to<scalar_t>(gi / (one + gi.neg().exp())) * load(u + i, m), m);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t n2 = x.size(-1), d = n2 / 2, rows = n2 ? x.numel() / n2 : 0;
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
