// The cpu platform's paged KV-cache kernels. Paged decode attention: every one-row query of a batch attends over its own context,
// reading K and V in place from the paged cache (no gather copy, no padding to the longest context).
//
// Built by `make` (graphinfer/ops/cpu_ext.py) into graphinfer/ops/_cpu_kernels.so and loaded with
// torch.ops.load_library; graphinfer/ops/cpu_attention.py falls back to gather + ATen flash when it is absent.
//
// Layouts as in graphinfer/ops/attention.py: query [T, Hq, D] (stride 1 over D), caches [num_blocks,
// block_size, Hkv, D] contiguous, block_tables [B, W] int32, query_start_loc [B + 1] int32, seq_lens [B] int32.
// Request b is a decode row when it owns exactly one query row and has seq_len > 0; its output row is written,
// every other row of `out` is left untouched (the caller handles prefill chunks and zero-fills padding).
// One task per (request, kv head) holds the GQA group's G query heads and walks the context block by block
// with an online softmax in fp32, so K and V are read once per group: a block's K rows are widened to fp32 (ATen's
// vectorised conversion, vec.h) and transposed, so that scores, exp and the weighted sum of V all run as float
// vectors: no horizontal sum per token and score, no scalar exp. fp32 caches skip the widening copies: K is
// transposed and V read straight from the cache. bf16 caches on AVX512-BF16 take their scores from bf16 pairs
// (vdpbf16ps: exact products, fp32 sums), so K is transposed but never widened.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>  // vdpbf16ps
#endif

namespace {

using cpu_vec::fVec;
using cpu_vec::kVec;
constexpr int64_t kHeads = 4;   // query heads whose scores one pass over K^T accumulates (independent FMA chains)
constexpr int64_t kChains = 4;  // vectors of a head's output accumulated together (independent FMA chains)

// row[0..Dp) = src[0..D) as floats, zero past D (Dp: D rounded up to whole vectors).
template <typename scalar_t>
inline void widen(const scalar_t* src, float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += kVec) cpu_vec::load(src + d, std::min(kVec, D - d)).store(row + d);
}

// Scores from K^T [Dp, bsp] (fp32): kHeads heads' scores of the kVec tokens at kt + t are Dp broadcast-FMAs into
// kHeads independent vectors (no per-token horizontal sum); q holds the heads pre-scaled, [kHeads, Dp].
inline void float_scores(const float* q, int64_t Dp, const float* kt, int64_t bsp, int64_t t, float* out,
                         int64_t out_stride) {
  fVec sv[kHeads] = {}, sw[kHeads] = {};  // even and odd d: twice the independent chains
  for (int64_t d = 0; d < Dp; d += 2) {  // Dp is a whole number of vectors: even
    const fVec k0 = fVec::loadu(kt + d * bsp + t), k1 = fVec::loadu(kt + (d + 1) * bsp + t);
    for (int64_t g = 0; g < kHeads; ++g) {
      sv[g] = at::vec::fmadd(fVec(q[g * Dp + d]), k0, sv[g]);
      sw[g] = at::vec::fmadd(fVec(q[g * Dp + d + 1]), k1, sw[g]);
    }
  }
  for (int64_t g = 0; g < kHeads; ++g) (sv[g] + sw[g]).store(out + g * out_stride);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// bf16 scores without widening (AVX512-BF16): K^T is transposed as 32-bit lanes, each a pair of adjacent d values of
// one token, [D2 = D / 2, bsp]; vdpbf16ps multiplies the pairs exactly and adds them into fp32 lanes (one per token).
// kHeads heads' scores of the 16 tokens at kt + t, times scale, to out + g * out_stride.
inline void bf16_pair_scores(const uint32_t* qp, int64_t D2, const uint32_t* kt, int64_t bsp, int64_t t, float scale,
                             float* out, int64_t out_stride) {
  __m512 sv[kHeads], sw[kHeads];  // even and odd pairs: twice the independent chains
  for (int64_t g = 0; g < kHeads; ++g) sv[g] = sw[g] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 1 < D2; d += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + d * bsp + t);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (d + 1) * bsp + t);
    for (int64_t g = 0; g < kHeads; ++g) {
      sv[g] = _mm512_dpbf16_ps(sv[g], k0, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g * D2 + d])));
      sw[g] = _mm512_dpbf16_ps(sw[g], k1, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g * D2 + d + 1])));
    }
  }
  if (d < D2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + d * bsp + t);
    for (int64_t g = 0; g < kHeads; ++g)
      sv[g] = _mm512_dpbf16_ps(sv[g], k0, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g * D2 + d])));
  }
  for (int64_t g = 0; g < kHeads; ++g)
    _mm512_storeu_ps(out + g * out_stride, _mm512_mul_ps(_mm512_add_ps(sv[g], sw[g]), _mm512_set1_ps(scale)));
}
#else
constexpr bool kBf16Dot = false;
inline void bf16_pair_scores(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float, float*, int64_t) {}
#endif

template <typename scalar_t>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
            double scale) {
  const int64_t B = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2), G = Hq / Hkv, W = block_tables.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t tok = Hkv * D;  // cache stride between consecutive tokens of a block
  const int64_t Dp = (D + kVec - 1) / kVec * kVec, Gp = (G + kHeads - 1) / kHeads * kHeads;
  const int64_t bsp = (bs + kVec - 1) / kVec * kVec, row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // fp32 caches whose rows are whole passes of kChains vectors: K transposed and V read straight from the cache
  const bool direct = std::is_same_v<scalar_t, float> && D % (kChains * kVec) == 0;
  // bf16 caches on AVX512-BF16: scores from bf16 pairs (bf16_pair_scores), K never widened
  const bool pairs = kBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && D % 2 == 0;
  const int64_t D2 = D / 2;

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // Per task, zero-padded to whole vectors and to kHeads heads: the G query heads (scaled) and their fp32
    // accumulators [Gp, Dp], a block's scores / probabilities [Gp, bsp], its K rows widened [bs, Dp] and
    // transposed [Dp, bsp], its V rows widened [bs, Dp] (+ one pass of kChains vectors of padding).
    std::vector<float> q(Gp * Dp), acc(Gp * Dp), s(Gp * bsp), m(G), l(G), kf(bs * Dp), kt(Dp * bsp, 0.f),
        vf(bs * Dp + kChains * kVec);
    std::vector<uint32_t> qp(pairs ? Gp * D2 : 0, 0u);  // the G query heads as bf16 pairs, unscaled
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, r = qsl[b], L = lens[b];
      if (qsl[b + 1] - r != 1 || L <= 0) continue;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* qg = q_ptr + r * q_row + (h * G + g) * q_head;
        if (pairs) {
          std::memcpy(qp.data() + g * D2, qg, D * sizeof(scalar_t));
        } else {
          widen(qg, q.data() + g * Dp, D);
          for (int64_t d = 0; d < Dp; ++d) q[g * Dp + d] *= fscale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j = 0; j * bs < L; ++j) {
        const int64_t n = std::min(bs, L - j * bs), base = (static_cast<int64_t>(bt[b * W + j]) * bs * Hkv + h) * D;
        if ((j + 1) * bs < L) {  // the next block's rows of this head: scattered blocks defeat the hardware prefetcher
          const int64_t next = (static_cast<int64_t>(bt[b * W + j + 1]) * bs * Hkv + h) * D;
          for (int64_t t = 0; t < bs; ++t) {
            for (int64_t byte = 0; byte < row_bytes; byte += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(k_ptr + next + t * tok) + byte);
              __builtin_prefetch(reinterpret_cast<const char*>(v_ptr + next + t * tok) + byte);
            }
          }
        }
        // Scores of the block's n tokens, [Gp, bsp], from its K rows transposed.
        if (pairs) {  // 32-bit lanes moved, not converted: transpose_mxn only shuffles
          at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(k_ptr + base), tok / 2, kt.data(), bsp,
                                        static_cast<int>(n), static_cast<int>(D2));
          const uint32_t* kt32 = reinterpret_cast<const uint32_t*>(kt.data());
          for (int64_t g0 = 0; g0 < G; g0 += kHeads)
            for (int64_t t = 0; t < n; t += kVec)
              bf16_pair_scores(qp.data() + g0 * D2, D2, kt32, bsp, t, fscale, s.data() + g0 * bsp + t, bsp);
        } else {
          if (direct) {
            at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(k_ptr + base), tok, kt.data(), bsp,
                                          static_cast<int>(n), static_cast<int>(Dp));
          } else {
            for (int64_t t = 0; t < n; ++t) widen(k_ptr + base + t * tok, kf.data() + t * Dp, D);
            at::vec::transpose_mxn<float>(kf.data(), Dp, kt.data(), bsp, static_cast<int>(n), static_cast<int>(Dp));
          }
          for (int64_t g0 = 0; g0 < G; g0 += kHeads)
            for (int64_t t = 0; t < n; t += kVec)
              float_scores(q.data() + g0 * Dp, Dp, kt.data(), bsp, t, s.data() + g0 * bsp + t, bsp);
        }
        for (int64_t g = 0; g < G; ++g) {
          // online softmax: probabilities against the new running maximum, the old sums rescaled to it
          float* sg = s.data() + g * bsp;
          const float mx = std::max(m[g], n == kVec ? cpu_vec::reduce_max(fVec::loadu(sg))
                                                    : *std::max_element(sg, sg + n));
          const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first block
          for (int64_t t = 0; t < n; t += kVec) (fVec::loadu(sg + t) - fVec(mx)).exp().store(sg + t);
          l[g] = l[g] * corr + (n == kVec ? cpu_vec::reduce_sum(fVec::loadu(sg))
                                          : std::accumulate(sg, sg + n, 0.f));
          m[g] = mx;
          float* ag = acc.data() + g * Dp;
          for (int64_t d = 0; d < Dp; d += kVec) (fVec::loadu(ag + d) * fVec(corr)).store(ag + d);
        }
        // Values: acc_g += sum_t p_g[t] v[t], kChains vectors of a head's accumulator at a time kept in registers
        // (independent FMA chains; intrinsic stores may alias anything, so memory-resident sums reload every step)
        const float* vfp = vf.data();
        int64_t vld = Dp;
        if (direct) {
          vfp = reinterpret_cast<const float*>(v_ptr + base);
          vld = tok;
        } else {
          for (int64_t t = 0; t < n; ++t) widen(v_ptr + base + t * tok, vf.data() + t * Dp, D);
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = s.data() + g * bsp;
          float* ag = acc.data() + g * Dp;
          for (int64_t d0 = 0; d0 < Dp; d0 += kChains * kVec) {
            const int64_t nv = std::min(kChains, (Dp - d0) / kVec);  // past nv: vf's padding, never stored
            fVec a[kChains] = {};
            for (int64_t c = 0; c < nv; ++c) a[c] = fVec::loadu(ag + d0 + c * kVec);
            for (int64_t t = 0; t < n; ++t) {
              const fVec p(pg[t]);
              const float* vt = vfp + t * vld + d0;
              for (int64_t c = 0; c < kChains; ++c) a[c] = at::vec::fmadd(p, fVec::loadu(vt + c * kVec), a[c]);
            }
            for (int64_t c = 0; c < nv; ++c) a[c].store(ag + d0 + c * kVec);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* dst = o_ptr + r * o_row + (h * G + g) * o_head;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * Dp + d] * inv);
      }
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, Hq, D] and caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need stride 1 over the head dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be contiguous int32");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "query, out and the caches must share one dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of the KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale);
  });
}

// The cache write: token t's key and value rows [Hkv, D] go to slot slot_mapping[t] (< 0: padding, skipped), one
// memcpy each, tokens in parallel (index_copy_ copies row by row on one thread: 5 ms for a 2,500-token prefill).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2), "key and value need contiguous [Hkv, D] rows");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value and their caches must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t T = key.size(0), bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t k_row = key.stride(0) * key.element_size(), v_row = value.stride(0) * value.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * bytes, k + t * k_row, bytes);
      std::memcpy(vc + slots[t] * bytes, v + t * v_row, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(graphinfer_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
