// Float vectors over fp32 / bf16 / fp16 memory (fp64 converted element by element: math in fp32) for the cpu
// platform's kernels: ATen's own Vectorized<float> (AVX512, AVX2 or scalar, as graphinfer/ops/cpu/ext.py sets
// CPU_CAPABILITY from torch's reading of this CPU) with its
// bf16/fp16 <-> fp32 conversions (round to nearest even, as a tensor's .to() rounds) and its exp (Sleef, 1 ulp,
// what ATen's own silu uses). Plain C++ loops over c10::BFloat16 do not vectorise: each element converts alone.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
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

// f(i0, i1) over [0, n) in chunks of `chunk`, handed out one at a time to whichever thread asks next (at::parallel_for
// splits the range evenly up front): a thread that the OS or the hypervisor holds back does less of the work instead
// of holding up the rest. One thread where there is only one chunk.
template <class F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;)
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// parallel_chunks' chunk (in units of codes_per_unit weight codes) for a kernel that streams a weight once (decode):
// at least 4 chunks a thread, between min_codes and kStreamChunkCodes codes a chunk. Each chunk is a new stream for
// the hardware prefetchers: against chunks of 32K-64K codes (56-112 rows of SmolLM2), 288K took gate_up (3,072 x 576,
// Q4_1) from 67-69 to 46-50 us and the Q8_0 LM head from 1.1-1.2 to 0.8-0.96 ms on the Zen 5 VM, the attention
// shapes unchanged (docs/bench/cpu_gemv_stream_chunks_2026-12-02_zen5.json).
constexpr int64_t kStreamChunkCodes = 288 << 10;
inline int64_t stream_chunk(int64_t units, int64_t codes_per_unit, int64_t min_codes) {
  const int64_t codes = units * codes_per_unit / (4 * at::get_num_threads());
  return std::max<int64_t>(1, std::clamp(codes, min_codes, kStreamChunkCodes) / codes_per_unit);
}

#if defined(__AVX512F__)
// r[i] = dwords j0..j0+15 of row i  ->  r[j] = row 0..15's dword j0 + j (a 16 x 16 transpose of 32-bit elements)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: element 4L + c of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  __m512i o[16];
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    o[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    o[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    o[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    o[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}
#endif

}  // namespace cpu_vec
