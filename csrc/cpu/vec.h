// Float vectors over fp32 / bf16 / fp16 memory (fp64 converted element by element: math in fp32) for the cpu
// platform's kernels: ATen's own Vectorized<float> (AVX512, AVX2 or scalar, as graphinfer/ops/cpu/ext.py sets
// CPU_CAPABILITY from torch's reading of this CPU) with its
// bf16/fp16 <-> fp32 conversions (round to nearest even, as a tensor's .to() rounds) and its exp (Sleef, 1 ulp,
// what ATen's own silu uses). Plain C++ loops over c10::BFloat16 do not vectorise: each element converts alone.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace cpu_vec {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();

// fVec::size() values from p as floats (n < kVec: the first n, the rest 0).
template <typename T>
inline fVec load(const T* p, int64_t n = kVec) {
  if constexpr (std::is_same_v<T, float>) {
    return n == kVec ? fVec::loadu(p) : fVec::loadu(p, n);
  } else if constexpr (!at::vec::is_reduced_floating_point_v<T>) {  // double: element by element
    float buf[kVec] = {};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return fVec::loadu(buf);
  } else {
    if (n == kVec) {
      fVec v;
      at::vec::load_to_float(p, v);
      return v;
    }
    T buf[kVec] = {};
    for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
    fVec v;
    at::vec::load_to_float(buf, v);
    return v;
  }
}

// The first n values of v to p, rounded to T.
template <typename T>
inline void store(T* p, const fVec& v, int64_t n = kVec) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else if constexpr (!at::vec::is_reduced_floating_point_v<T>) {
    float buf[kVec];
    v.store(buf);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

// v rounded through T and back (identity for float): the reference materialises such intermediates in T.
template <typename T>
inline fVec round_to(const fVec& v) {
  if constexpr (!at::vec::is_reduced_floating_point_v<T>) {
    return v;
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return lo;
  }
}

// The sum and the maximum of v's lanes.
inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return a + b; }, v);
}
inline float reduce_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, v);
}

// out (fp32, contiguous) as a tensor of dtype: bf16 / fp16 converted here (round to nearest even, as .to()), single
// threaded, without the dispatcher's copy (.to() of one row costs a few us, on each of a decode step's ~120 quantized
// linears); other dtypes by .to().
inline at::Tensor float_to(const at::Tensor& out, at::ScalarType dtype) {
  if (dtype == at::kFloat) return out;
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return out.to(dtype);
  auto convert = [&](auto* dst) {
    const float* src = out.data_ptr<float>();
    const int64_t n = out.numel();
    int64_t i = 0;
    for (; i + kVec <= n; i += kVec) store(dst + i, fVec::loadu(src + i));
    if (i < n) store(dst + i, fVec::loadu(src + i, n - i), n - i);
  };
  at::Tensor res = at::empty(out.sizes(), out.options().dtype(dtype));
  if (dtype == at::kBFloat16) convert(res.data_ptr<at::BFloat16>());
  else convert(res.data_ptr<at::Half>());
  return res;
}

}  // namespace cpu_vec
