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
// with an online softmax in fp32 (bf16/fp16 caches are widened on load), so K and V are read once per group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename scalar_t>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
            double scale) {
  const int64_t B = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2), G = Hq / Hkv, W = block_tables.size(1);
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t tok = Hkv * D;  // cache stride between consecutive tokens of a block
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), acc(G * D), s(G * bs), m(G), l(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, row = qsl[b], L = lens[b];
      if (qsl[b + 1] - row != 1 || L <= 0) continue;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = q_ptr + row * q_row + (h * G + g) * q_head;
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t j = 0; j * bs < L; ++j) {
        const int64_t n = std::min(bs, L - j * bs), base = (static_cast<int64_t>(bt[b * W + j]) * bs * Hkv + h) * D;
        const scalar_t* kb = k_ptr + base;
        const scalar_t* vb = v_ptr + base;
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * bs;
          float mx = m[g];
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = dot(q.data() + g * D, kb + t * tok, D);
            mx = std::max(mx, sg[t]);
          }
          const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first block
          float* a = acc.data() + g * D;
          float sum = l[g] * corr;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(sg[t] - mx);
            sum += p;
            const scalar_t* v = vb + t * tok;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
          }
          m[g] = mx;
          l[g] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        scalar_t* dst = o_ptr + row * o_row + (h * G + g) * o_head;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
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
