// The cpu platform's weight-only quantized linear: graphinfer::wo_linear (graphinfer/ops/quant.py) on the packed
// weight, never dequantized as a whole.
//
// Built by `make` (graphinfer/ops/cpu/ext.py) into graphinfer/ops/cpu/_cpu_kernels.so beside paged_attention.cpp, in its
// own op namespace graphinfer_cpu_quant; graphinfer/ops/cpu/quant.py binds it (and falls back to the reference).
//
// Packed forms as in ops/quant.py: x [T, K] (fp32 / bf16), qweight uint8 [N, K / 2] (bits 4: codes 0..15, even k in
// the low nibble) or int8 [N, K] (bits 8), scales [N, G] fp32, zeros [N, G] fp32 or none, w = q * scale + zero per
// group of g = K / G elements; out [T, N] in x's dtype, fp32 accumulation.
//
// Few tokens (decode, T < kGemmMinTokens): the weight streams once from memory. OpenMP over blocks of output rows;
// each row is read once from memory for all tokens, in register tiles of 1 (or 2, see rows_tile) rows x MT tokens
// (MT <= 8; the next token tile re-reads the row from L1), with a software prefetch kPrefetchBytes ahead. A vector of
// L lanes (AVX-512: 16, AVX2: 8) takes one chunk of codes: bits 4 loads L bytes = 2L codes and splits them into the
// low nibbles (even k) and the high ones (odd k), so x is permuted once per call to match (each chunk of 2L
// elements: the L even ones, then the L odd ones); bits 8 loads L codes. Two accumulation forms, chosen per tile by
// which does fewer vector ops:
// - factored: per group, the code dot sum_k q_k x_k (integer codes widened to fp32), then acc += scale * dot; the
//   zero term zero * sum_k x_k uses per-group sums of x computed once per call (best for one or two tokens, or
//   big groups);
// - dequantized: w = q * scale + zero in registers, then one FMA per token (best when several tokens share it).
// Many tokens (prefill, batched decode): on the 8-lane (AVX2) path gemm_f32, panels of rows dequantized into L2 and
// multiplied by a register-tiled FMA kernel; elsewhere chunks of rows (up to kGemmChunkBytes of fp32, a whole SmolLM2
// layer) dequantized by all threads into one buffer, each chunk multiplied by one at::mm (MKL, all threads). (One tile
// per thread with single-threaded at::mm calls measured up to 35% slower: MKL re-packs x for every tile.) With
// bf16_gemm (the caller accepts bf16's rounding) on a CPU with avx512_bf16, group sizes of 32k: gemm_bf16, panels of rows
// dequantized into L2 and multiplied with vdpbf16ps (on AMX tiles where the build targets amx_bf16; there, from
// kAmxDenseTokens tokens on, the weight dequantized whole into a bf16 buffer for oneDNN's linear), x and the weights
// rounded to bf16, fp32 accumulation; elsewhere bf16_gemm is ignored (exact).
// Group sizes that are not a multiple of the chunk (and machines without AVX2) take a generic path: rows dequantized
// one by one into a buffer in natural k order, then plain dot products.
//
// Measured on the 2-core AVX-512 dev VM (tools/cpu_quant_bench.py, cold weights): M = 1 streams the Q4_1-form LM
// head at ~28 GB/s and the Q8_0 form at ~35 GB/s; M = 64..256 within a few % of fp32 F.linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "amx.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGemmMinTokens = 64;  // from here on: dequantized rows through at::mm (tools/cpu_quant_bench.py)
constexpr int64_t kGemmChunkBytes = 8 << 20;  // fp32 rows dequantized per at::mm (a whole layer of SmolLM2)
constexpr int64_t kRowBlock = 4;        // rows per task unit of the decode kernels
constexpr int64_t kPrefetchBytes = 2048;  // software prefetch distance along the weight (decode kernels)
constexpr int kMaxTokens = 8;           // tokens per register tile
constexpr int64_t kL1TileBytes = 20 << 10;  // a token tile's x above this: two rows per register tile

#if defined(__AVX512F__)
struct V16 {
  using reg = __m512;
  static constexpr int L = 16;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static inline reg set1(float v) { return _mm512_set1_ps(v); }
  static inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) { return _mm512_reduce_add_ps(a); }
  // L bytes -> the L low nibbles (even k) and the L high nibbles (odd k) as fp32
  static inline void nib(const uint8_t* p, reg& lo, reg& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  static inline reg i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
struct V8 {
  using reg = __m256;
  static constexpr int L = 8;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static inline reg set1(float v) { return _mm256_set1_ps(v); }
  static inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static inline void nib(const uint8_t* p, reg& lo, reg& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static inline reg i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // r[i] = row i of an 8 x 8 block -> r[j] = its column j
  static inline void transpose(reg r[8]) {
    reg t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
      r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
  }
};
#endif

struct Problem {
  const uint8_t* w;     // packed rows, w_row bytes apart
  int64_t w_row;
  const void* scales;   // [N, G], fp32 or (half) fp16: read as they are, not converted per call
  const void* zeros;    // [N, G] or nullptr, as scales
  bool half;
  const float* bias;    // [N] or nullptr
  const float* x;       // [T, K] fp32, k permuted per chunk (vector kernels, bits 4) or natural
  const float* xsum;    // [T, G] per-group sums of x (factored kernels with zeros), else nullptr
  float* out;           // [T, N]
  int64_t N, K, G, g, T, bits;
  at::BFloat16* out_bf16 = nullptr;  // gemm_bf16 with bf16 x: [T, N] written in bf16 instead of out
};

// element i of a scales / zeros array
inline float param(const Problem& p, const void* base, int64_t i) {
  if (!p.half) return static_cast<const float*>(base)[i];
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))  // (immintrin.h included)
  return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);  // one instruction (c10::Half's conversion is bit twiddling)
#else
  return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
#endif
}

// Register tile: rows n0..n0+R-1, tokens t0..t0+MT-1 (x rows K apart, out rows N apart).
template <class V, int BITS, bool FACT, bool ZERO, int R, int MT>
void tile(const Problem& p, int64_t n0, int64_t t0) {
  using reg = typename V::reg;
  constexpr int L = V::L;
  constexpr int CH = BITS == 4 ? 2 * L : L;  // codes per chunk
  const int64_t K = p.K, G = p.G, cpg = p.g / CH;
  const float* x = p.x + t0 * K;
  const uint8_t* w[R];
  for (int r = 0; r < R; ++r) w[r] = p.w + (n0 + r) * p.w_row;
  auto s = [&](int r, int64_t gi) { return param(p, p.scales, (n0 + r) * G + gi); };
  auto z = [&](int r, int64_t gi) { return param(p, p.zeros, (n0 + r) * G + gi); };
  reg acc[R][MT];
  float zacc[R][MT];  // factored with zeros: sum over groups of zero * (sum of x over the group)
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) {
      acc[r][t] = V::zero();
      zacc[r][t] = 0.f;
    }

  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t kg = gi * p.g;
    for (int r = 0; r < R; ++r) __builtin_prefetch(w[r] + (BITS == 4 ? kg / 2 : kg) + kPrefetchBytes);
    if constexpr (FACT) {
      reg dq[R][MT];
      // the group's first chunk starts the code dots (mul), the others accumulate (fma)
      auto chunk = [&](int64_t k, auto first) {
        for (int r = 0; r < R; ++r) {
          if constexpr (BITS == 4) {
            reg lo, hi;
            V::nib(w[r] + k / 2, lo, hi);
            for (int t = 0; t < MT; ++t) {
              const float* xt = x + t * K + k;
              reg e;
              if constexpr (decltype(first)::value) e = V::mul(lo, V::load(xt));
              else e = V::fma(lo, V::load(xt), dq[r][t]);
              dq[r][t] = V::fma(hi, V::load(xt + L), e);
            }
          } else {
            const reg q = V::i8(reinterpret_cast<const int8_t*>(w[r]) + k);
            for (int t = 0; t < MT; ++t) {
              const reg xv = V::load(x + t * K + k);
              if constexpr (decltype(first)::value) dq[r][t] = V::mul(q, xv);
              else dq[r][t] = V::fma(q, xv, dq[r][t]);
            }
          }
        }
      };
      chunk(kg, std::true_type{});
      for (int64_t c = 1; c < cpg; ++c) chunk(kg + c * CH, std::false_type{});
      for (int r = 0; r < R; ++r) {
        const reg sv = V::set1(s(r, gi));
        for (int t = 0; t < MT; ++t) acc[r][t] = V::fma(dq[r][t], sv, acc[r][t]);
        if constexpr (ZERO) {
          const float zr = z(r, gi);
          for (int t = 0; t < MT; ++t) zacc[r][t] += zr * p.xsum[(t0 + t) * G + gi];
        }
      }
    } else {
      reg sv[R], zv[R];
      for (int r = 0; r < R; ++r) {
        sv[r] = V::set1(s(r, gi));
        if constexpr (ZERO) zv[r] = V::set1(z(r, gi));
      }
      for (int64_t c = 0; c < cpg; ++c) {
        const int64_t k = kg + c * CH;
        if constexpr (BITS == 4) {
          reg wl[R], wh[R];
          for (int r = 0; r < R; ++r) {
            reg lo, hi;
            V::nib(w[r] + k / 2, lo, hi);
            if constexpr (ZERO) {
              wl[r] = V::fma(lo, sv[r], zv[r]);
              wh[r] = V::fma(hi, sv[r], zv[r]);
            } else {
              wl[r] = V::mul(lo, sv[r]);
              wh[r] = V::mul(hi, sv[r]);
            }
          }
          for (int t = 0; t < MT; ++t) {
            const reg xe = V::load(x + t * K + k), xo = V::load(x + t * K + k + L);
            for (int r = 0; r < R; ++r) acc[r][t] = V::fma(wh[r], xo, V::fma(wl[r], xe, acc[r][t]));
          }
        } else {
          reg wq[R];
          for (int r = 0; r < R; ++r) {
            const reg q = V::i8(reinterpret_cast<const int8_t*>(w[r]) + k);
            if constexpr (ZERO) wq[r] = V::fma(q, sv[r], zv[r]);
            else wq[r] = V::mul(q, sv[r]);
          }
          for (int t = 0; t < MT; ++t) {
            const reg xv = V::load(x + t * K + k);
            for (int r = 0; r < R; ++r) acc[r][t] = V::fma(wq[r], xv, acc[r][t]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = p.bias ? p.bias[n0 + r] : 0.f;
    for (int t = 0; t < MT; ++t) {
      p.out[(t0 + t) * p.N + n0 + r] = V::hsum(acc[r][t]) + zacc[r][t] + b;
    }
  }
}

// Rows n0..n0+nrows-1 against tokens t0..t0+MT-1, one row at a time while the token tile's x fits in L1 (a single
// stream through the weight: 4 rows side by side measured up to 2x slower at M = 1, the prefetchers following fewer
// streams), else two rows at a time so each x load from L2 serves both.
template <class V, int BITS, bool FACT, bool ZERO, int MT>
void rows_tile(const Problem& p, int64_t n0, int64_t nrows, int64_t t0) {
  // the accumulators (and, factored, the group dots) of a 2 x MT tile must stay within the vector registers
  constexpr bool two = (FACT ? 4 * MT : 2 * MT) <= (V::L == 16 ? 16 : 8);
  int64_t n = n0;
  if (two && MT * p.K * 4 > kL1TileBytes)
    for (; n + 2 <= n0 + nrows; n += 2) tile<V, BITS, FACT, ZERO, (two ? 2 : 1), MT>(p, n, t0);
  for (; n < n0 + nrows; ++n) tile<V, BITS, FACT, ZERO, 1, MT>(p, n, t0);
}

template <class V, int BITS, bool FACT, bool ZERO>
void rows_dispatch(const Problem& p, int64_t n0, int64_t nrows, int64_t t0, int mt) {
  switch (mt) {
    case 1: return rows_tile<V, BITS, FACT, ZERO, 1>(p, n0, nrows, t0);
    case 2: return rows_tile<V, BITS, FACT, ZERO, 2>(p, n0, nrows, t0);
    case 3: return rows_tile<V, BITS, FACT, ZERO, 3>(p, n0, nrows, t0);
    case 4: return rows_tile<V, BITS, FACT, ZERO, 4>(p, n0, nrows, t0);
    case 5: return rows_tile<V, BITS, FACT, ZERO, 5>(p, n0, nrows, t0);
    case 6: return rows_tile<V, BITS, FACT, ZERO, 6>(p, n0, nrows, t0);
    case 7: return rows_tile<V, BITS, FACT, ZERO, 7>(p, n0, nrows, t0);
    default: return rows_tile<V, BITS, FACT, ZERO, 8>(p, n0, nrows, t0);
  }
}

// Whether the factored form does fewer vector ops than the dequantized one for a tile of mt tokens
// (per chunk: factored 2 mt + mt / cpg FMAs for bits 4, mt + mt / cpg for bits 8; dequantized 2 + 2 mt, 1 + mt).
inline bool factored(int bits, int64_t mt, int64_t cpg) { return bits == 4 ? mt < 2 * cpg : mt < cpg; }

template <class V, int BITS>
void decode_vec(const Problem& p) {
  constexpr int CH = BITS == 4 ? 2 * V::L : V::L;
  // (token tiles of 16 measured 1.5x slower at M = 16: 16 rows of x outgrow L1 at K = 576)
  const int64_t cpg = p.g / CH, blocks = (p.N + kRowBlock - 1) / kRowBlock;
  const int64_t grain = cpu_vec::stream_chunk(blocks, kRowBlock * p.K, 32768);
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {  // each block of rows: from memory once, then from L1 for every token tile
      const int64_t n0 = b * kRowBlock, nrows = std::min(p.N, n0 + kRowBlock) - n0;
      for (int64_t t0 = 0; t0 < p.T;) {
        const int mt = static_cast<int>(std::min<int64_t>(p.T - t0, kMaxTokens));
        const bool fact = factored(BITS, mt, cpg);
        if (p.zeros) {
          if (fact) rows_dispatch<V, BITS, true, true>(p, n0, nrows, t0, mt);
          else rows_dispatch<V, BITS, false, true>(p, n0, nrows, t0, mt);
        } else {
          if (fact) rows_dispatch<V, BITS, true, false>(p, n0, nrows, t0, mt);
          else rows_dispatch<V, BITS, false, false>(p, n0, nrows, t0, mt);
        }
        t0 += mt;
      }
    }
  };
  cpu_vec::parallel_chunks(blocks, grain, run);
}

// Row n dequantized into dst[K] in the vector kernels' k order (permuted per chunk for bits 4).
template <class V, int BITS>
void dequant_row_vec(const Problem& p, int64_t n, float* dst) {
  constexpr int L = V::L, CH = BITS == 4 ? 2 * L : L;
  const uint8_t* w = p.w + n * p.w_row;
  const int64_t cpg = p.g / CH;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const auto sv = V::set1(param(p, p.scales, n * p.G + gi));
    const auto zv = V::set1(p.zeros ? param(p, p.zeros, n * p.G + gi) : 0.f);
    for (int64_t c = 0; c < cpg; ++c) {
      const int64_t k = gi * p.g + c * CH;
      if constexpr (BITS == 4) {
        typename V::reg lo, hi;
        V::nib(w + k / 2, lo, hi);
        V::store(dst + k, V::fma(lo, sv, zv));
        V::store(dst + k + L, V::fma(hi, sv, zv));
      } else {
        V::store(dst + k, V::fma(V::i8(reinterpret_cast<const int8_t*>(w) + k), sv, zv));
      }
    }
  }
}

// Row n dequantized into dst[K] in natural k order, any group size.
void dequant_row_generic(const Problem& p, int64_t n, float* dst) {
  const uint8_t* w = p.w + n * p.w_row;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const float sc = param(p, p.scales, n * p.G + gi), zr = p.zeros ? param(p, p.zeros, n * p.G + gi) : 0.f;
    for (int64_t k = gi * p.g; k < (gi + 1) * p.g; ++k) {
      const float q = p.bits == 4 ? static_cast<float>((w[k >> 1] >> ((k & 1) * 4)) & 15)
                                  : static_cast<float>(reinterpret_cast<const int8_t*>(w)[k]);
      dst[k] = q * sc + zr;
    }
  }
}

// Few tokens, no vector kernel for this group size / machine: row by row, dequantized then dotted.
void decode_generic(const Problem& p) {
  const int64_t grain = std::max<int64_t>(1, 32768 / p.K);
  at::parallel_for(0, p.N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(p.K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row_generic(p, n, row.data());
      const float b = p.bias ? p.bias[n] : 0.f;
      for (int64_t t = 0; t < p.T; ++t) {
        const float* xt = p.x + t * p.K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < p.K; ++k) acc += row[k] * xt[k];
        p.out[t * p.N + n] = acc + b;
      }
    }
  });
}

// Many tokens: chunks of rows dequantized by all threads into one buffer, then one at::mm (MKL, all threads) each.
void gemm_chunks(const Problem& p, const at::Tensor& x, at::Tensor& out,
                 void (*dequant)(const Problem&, int64_t, float*), int64_t chunk_bytes) {
  const int64_t rows = std::max<int64_t>(1, std::min(p.N, chunk_bytes / (p.K * 4)));
  at::Tensor buf = at::empty({rows, p.K}, x.options());
  for (int64_t n0 = 0; n0 < p.N; n0 += rows) {
    const int64_t nb = std::min(rows, p.N - n0);
    at::parallel_for(0, nb, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant(p, n0 + r, buf.data_ptr<float>() + r * p.K);
    });
    at::Tensor dst = nb == p.N ? out : out.narrow(1, n0, nb);
    at::mm_out(dst, x, buf.narrow(0, 0, nb).t());
  }
  if (p.bias) out.add_(at::from_blob(const_cast<float*>(p.bias), {p.N}, x.options()));
}

#if defined(__AVX2__) && defined(__FMA__)
// Many tokens in fp32 on the AVX2 path (8 lanes): a GEMM of our own instead of gemm_chunks. A task dequantizes a
// panel of 16 rows (dequant_row_vec, k in the vector kernels' order, as x), transposes it into a thread's buffer
// [K][16] and multiplies it with x in register tiles of 6 tokens x 16 rows (BLIS's AVX2 shape: 12 accumulators, x
// broadcast), fp32 products and sums throughout (exact, as gemm_chunks). So the weight is never written out whole and
// no library repacks it per call (at::mm on gemm_chunks' buffer: MKL packs it again every call). Up to 8 token blocks
// a thread (decode batches, short prompts): the threads share the panels, each dequantized once, x from L2 / L3;
// more (long prefills): each thread takes blocks of tokens whose x stays in L2 and dequantizes every panel again per
// block (a few % of the block's products). Measured on the AVX2 dev VM (tools/cpu_quant_bench.py, 2 threads, cold
// weights, SmolLM2's shapes; docs/benchmarks.md): 0.7-1.0x the time of oneDNN's linear on the dense fp32 weight
// prepacked at 64 tokens, 0.9-1.3x at 256 and 4,096. (AVX-512 builds keep gemm_chunks for their 16-lane forms: this
// GEMM has not run on one.)
constexpr int64_t kF32PanelRows = 16;
constexpr int kF32Tokens = 6;
constexpr int64_t kF32BlockBytes = 256 << 10;  // x of a token block, kept in L2

// out[t0 .. t0 + MT - 1][n0 .. n0 + 15] = x[t] . panel (+ bias), rows past N not stored.
template <int MT>
void f32_tile(const Problem& p, const float* panel, int64_t t0, int64_t n0) {
  using V = V8;
  const int64_t K = p.K;
  const float* x = p.x + t0 * K;
  __m256 acc[MT][2];
#pragma GCC unroll 8
  for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * kF32PanelRows), w1 = _mm256_load_ps(panel + k * kF32PanelRows + 8);
#pragma GCC unroll 8
    for (int t = 0; t < MT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(x + t * K + k);
      acc[t][0] = V::fma(w0, xb, acc[t][0]);
      acc[t][1] = V::fma(w1, xb, acc[t][1]);
    }
  }
  // the sums go out through a buffer: with the bias and the row tail handled on the accumulators themselves, gcc
  // kept a copy of each in memory, storing all 12 every step
  alignas(32) float o[MT][kF32PanelRows];
#pragma GCC unroll 8
  for (int t = 0; t < MT; ++t) {
    _mm256_store_ps(o[t], acc[t][0]);
    _mm256_store_ps(o[t] + 8, acc[t][1]);
  }
  const int64_t valid = std::min<int64_t>(kF32PanelRows, p.N - n0);
  for (int t = 0; t < MT; ++t) {
    float* dst = p.out + (t0 + t) * p.N + n0;
    for (int64_t r = 0; r < valid; ++r) dst[r] = o[t][r] + (p.bias ? p.bias[n0 + r] : 0.f);
  }
}

// One tile of t1 - t0 <= MT tokens (the last of a block).
template <int MT>
void f32_tail(const Problem& p, const float* panel, int64_t t0, int64_t t1, int64_t n0) {
  if constexpr (MT > 0) {
    if (t1 - t0 == MT) return f32_tile<MT>(p, panel, t0, n0);
    f32_tail<MT - 1>(p, panel, t0, t1, n0);
  }
}

// Rows n0 .. n0 + 15 (zeros past N) dequantized into rows [16][K], then transposed into panel [K][16].
template <int BITS>
void f32_panel(const Problem& p, int64_t n0, float* rows, float* panel) {
  const int64_t K = p.K, n = std::min(kF32PanelRows, p.N - n0);
  for (int64_t r = 0; r < n; ++r) dequant_row_vec<V8, BITS>(p, n0 + r, rows + r * K);
  if (n < kF32PanelRows) std::fill(rows + n * K, rows + kF32PanelRows * K, 0.f);
  __m256 v[8];
  for (int64_t k = 0; k < K; k += 8)
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(rows + (8 * h + i) * K + k);
      V8::transpose(v);
      for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * kF32PanelRows + 8 * h, v[j]);
    }
}

template <int BITS>
void gemm_f32(const Problem& p) {
  const int64_t K = p.K, panels = (p.N + kF32PanelRows - 1) / kF32PanelRows;
  const int64_t tb = std::max<int64_t>(kF32Tokens, kF32BlockBytes / (K * 4) / kF32Tokens * kF32Tokens);
  const int64_t blocks = (p.T + tb - 1) / tb;
  auto tokens = [&](const float* panel, int64_t n0, int64_t t0, int64_t t1) {
    int64_t t = t0;
    for (; t + kF32Tokens <= t1; t += kF32Tokens) f32_tile<kF32Tokens>(p, panel, t, n0);
    if (t < t1) f32_tail<kF32Tokens - 1>(p, panel, t, t1, n0);
  };
  auto with_buffers = [&](auto&& body) {  // body(rows, panel): a thread's buffers, 64-byte aligned
    float* buf = static_cast<float*>(std::aligned_alloc(64, 2 * kF32PanelRows * K * 4));
    body(buf, buf + kF32PanelRows * K);
    std::free(buf);
  };
  if (blocks >= 8 * at::get_num_threads()) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      with_buffers([&](float* rows, float* panel) {
        for (int64_t b = b0; b < b1; ++b)
          for (int64_t i = 0; i < panels; ++i) {
            f32_panel<BITS>(p, i * kF32PanelRows, rows, panel);
            tokens(panel, i * kF32PanelRows, b * tb, std::min(p.T, (b + 1) * tb));
          }
      });
    });
  } else {
    at::parallel_for(0, panels, 1, [&](int64_t i0, int64_t i1) {
      with_buffers([&](float* rows, float* panel) {
        for (int64_t i = i0; i < i1; ++i) {
          f32_panel<BITS>(p, i * kF32PanelRows, rows, panel);
          tokens(panel, i * kF32PanelRows, 0, p.T);
        }
      });
    });
  }
}
#endif

#if defined(__AVX512BF16__)
// Many tokens in bf16 (bf16_gemm) on a CPU with avx512_bf16: a GEMM of our own instead of gemm_chunks, so that the
// weight is never written out dequantized and no GEMM library repacks it per call (both cost more than the
// products at 64 tokens: issue 55). Each task takes a panel of kPanelRows rows: dequantized (in fp32, rounded to
// bf16) straight into a thread-local buffer in the layout of vdpbf16ps's second operand (per pair of k: the pairs
// of the panel's rows, one dword each), then every tile of up to kTokenTile tokens multiplies it from L1 / L2, with
// x's pairs broadcast: acc[t][v] += x[t][k, k+1] . w[16 rows][k, k+1], fp32 accumulation, out in x's dtype.
// Measured on the 2-vCPU Zen 5 VM (tools/cpu_quant_bench.py, 2 threads, cold weights, SmolLM2's shapes; JSON
// docs/bench/cpu_gemm_bf16_2026-12-01_zen5.json) against oneDNN's linear on the dense bf16 weight prepacked: 0.91-1.07x
// its time at 512 and 2,048 tokens; at 64, 0.84-0.98x on the attention and down shapes, 1.23x on gate_up (3,072 x 576)
// and 1.31x on the Q8_0 LM head, where the dequantization (~0.5 vector ops a weight against vdpbf16ps's 2 at 64
// tokens) is not hidden.
#if defined(GRAPHINFER_AMX)
constexpr int kPanelRows = 32;  // AMX: two B tiles of 16 columns, for amx_panel_tile's 2 x 2 tile products
#else
constexpr int kPanelRows = 48;  // three vectors of rows: 12 panels of a 576-row linear share 2 threads evenly
#endif
constexpr int kTokenTile = 8;  // 8 tokens x 3 vectors = 24 accumulators of the 32 registers

// Columns n .. n + 15 of out's row t (those in m) = v: fp32, or bf16 rounded to nearest even (as .to()) where the
// caller gave out_bf16 (an fp32 [T, N] converted afterwards, one thread, cost 2.2 ms of a 10 ms 2,048 x 3,072 GEMM).
inline void store_row16(const Problem& p, int64_t t, int64_t n, __mmask16 m, __m512 v) {
  if (p.out_bf16)
    _mm256_mask_storeu_epi16(p.out_bf16 + t * p.N + n, m, (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_mask_storeu_ps(p.out + t * p.N + n, m, v);
}

// Row n's 32 weights from k = 32c on as bf16 in natural k order: 16 dwords, dword j = (w[k + 2j], w[k + 2j + 1]).
template <int BITS>
inline __m512i dequant32_bf16(const Problem& p, int64_t n, int64_t c) {
  const int64_t gi = c * 32 / p.g;
  const __m512 s = _mm512_set1_ps(param(p, p.scales, n * p.G + gi));
  const __m512 z = _mm512_set1_ps(p.zeros ? param(p, p.zeros, n * p.G + gi) : 0.f);
  const uint8_t* w = p.w + n * p.w_row;
  if constexpr (BITS == 4) {  // byte j: k + 2j in the low nibble, k + 2j + 1 in the high one
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 16)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), s, z);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, z);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // (lo_j, hi_j) per dword
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w) + c * 32;
    const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                         reinterpret_cast<const __m128i*>(q)))), s, z);
    const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                         reinterpret_cast<const __m128i*>(q + 16)))), s, z);
    return (__m512i)_mm512_cvtne2ps_pbh(b, a);
  }
}

// Rows n0 .. n0 + kPanelRows - 1 (zeros past N) into panel[K / 2][kPanelRows] dwords; tiles (AMX): the same 16 x 16
// blocks of dwords contiguous instead, [K / 32][kPanelRows / 16][16 pairs of k][16 rows], each a B tile's 1 KB.
template <int BITS, bool TILES>
void dequant_panel(const Problem& p, int64_t n0, uint32_t* panel) {
  __m512i r[16];
  for (int h = 0; h < kPanelRows / 16; ++h)
    for (int64_t c = 0; c < p.K / 32; ++c) {
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + h * 16 + i;
        r[i] = n < p.N ? dequant32_bf16<BITS>(p, n, c) : _mm512_setzero_si512();
      }
      cpu_vec::transpose16(r);
      for (int j = 0; j < 16; ++j)
        _mm512_store_si512(panel + (TILES ? ((c * (kPanelRows / 16) + h) * 16 + j) * 16
                                          : (c * 16 + j) * kPanelRows + h * 16), r[j]);
    }
}

// out[t0 .. t0 + MT - 1][n0 .. n0 + kPanelRows - 1] = x[t] . panel (+ bias), columns past N not stored.
template <int MT>
void panel_tile(const Problem& p, const uint32_t* panel, const uint32_t* x, int64_t t0, int64_t n0) {
  constexpr int NV = kPanelRows / 16;
  const int64_t J = p.K / 2;
  __m512 acc[MT][NV];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
  const uint32_t* xt = x + t0 * J;
  for (int64_t j = 0; j < J; ++j) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_load_si512(panel + j * kPanelRows + 16 * v);
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[t * J + j]));
      for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], xv, w[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t valid = std::clamp<int64_t>(p.N - n0 - 16 * v, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int t = 0; t < MT; ++t) store_row16(p, t0 + t, n0 + 16 * v, m, _mm512_add_ps(acc[t][v], bv));
  }
}

// The last tile, of t1 - t0 < kTokenTile tokens (none: nothing)
template <int MT>
void tail_tile(const Problem& p, const uint32_t* panel, const uint32_t* x, int64_t t0, int64_t t1, int64_t n0) {
  if constexpr (MT > 0) {
    if (t1 - t0 == MT) return panel_tile<MT>(p, panel, x, t0, n0);
    tail_tile<MT - 1>(p, panel, x, t0, t1, n0);
  }
}

#if defined(GRAPHINFER_AMX)
// On AMX the panel is the B operand's layout (per pair of k, the rows' dwords; dequant_panel's tiles: each B tile's
// 1 KB contiguous): its 32 rows are two B tiles of 16 columns, 16 pairs of k (32 k) a tile, and x's rows as they lie
// are the A tiles (16 tokens x 32 k). A task multiplies 32 tokens by the panel as 2 x 2 tile products per 32 k (each
// tile loaded once for two products), fp32 sums in four C tiles (vdpbf16ps's arithmetic: exact bf16 products).
// Tiles: 0-3 C, 4-5 A, 6-7 B. On the 2-vCPU AMX VM (2026-12-01): level with oneDNN's prepacked bf16 linear a layer
// on cold weights at 64 and 256 tokens (tools/cpu_quant_bench.py); in the model (weights in its 480 MB L3) the
// GGUF's wo_linear still took 1.6x the dense linears' time at batch-64 decode and 3.3x at a 10k-token prefill, and
// the batch-64 step ran at 0.68-0.72x bf16 dense (0.27x on the vdpbf16ps tiles).
constexpr int64_t kAmxTokens = 32;

void amx_configure_gemm() {
  cpu_amx::TileConfig c;
  for (int tile = 0; tile < 8; ++tile) c.set(tile, 16, 64);  // C 16 x 16 fp32, A 16 x 32 bf16, B 16 x 16 dwords
  c.load();
}

// out[t0 .. t0 + rows)[n0 .. n0 + kPanelRows) = x . panel (+ bias), x: kAmxTokens rows of K bf16 (those past `rows`
// computed, not stored), columns past N not stored.
void amx_panel_tile(const Problem& p, const uint32_t* panel, const at::BFloat16* x, int64_t t0, int64_t rows,
                    int64_t n0) {
  static_assert(kPanelRows == 32, "two B tiles of 16 columns");
  const int64_t ldx = p.K * static_cast<int64_t>(sizeof(at::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < p.K / 32; ++kc) {
    const uint32_t* b = panel + kc * 16 * kPanelRows;  // dequant_panel's tiles: two contiguous B tiles
    // each load just before its first product, so a tile is reloaded as soon as its last product of the previous
    // step has read it (tiles are not renamed): 2,048-token GEMMs 5-9 % faster than four loads, then four products
    _tile_loadd(4, x + kc * 32, ldx);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 256, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, x + 16 * p.K + kc * 32, ldx);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[kAmxTokens * kPanelRows];
  _tile_stored(0, c, kPanelRows * 4);
  _tile_stored(1, c + 16, kPanelRows * 4);
  _tile_stored(2, c + 16 * kPanelRows, kPanelRows * 4);
  _tile_stored(3, c + 16 * kPanelRows + 16, kPanelRows * 4);
  for (int v = 0; v < kPanelRows / 16; ++v) {
    const int64_t valid = std::clamp<int64_t>(p.N - n0 - 16 * v, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int64_t t = 0; t < rows; ++t)
      store_row16(p, t0 + t, n0 + 16 * v, m, _mm512_add_ps(_mm512_load_ps(c + t * kPanelRows + 16 * v), bv));
  }
}

// Tokens [t0, t1) of x [T][K] against one panel: whole tiles of kAmxTokens tokens in place, the rest from pad
// (kAmxTokens rows, zero past them).
void amx_panel(const Problem& p, const uint32_t* panel, const at::BFloat16* x, at::BFloat16* pad, int64_t n0,
               int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + kAmxTokens <= t1; t += kAmxTokens) amx_panel_tile(p, panel, x + t * p.K, t, kAmxTokens, n0);
  if (t < t1) {
    std::memset(static_cast<void*>(pad), 0, kAmxTokens * p.K * sizeof(at::BFloat16));
    std::memcpy(static_cast<void*>(pad), x + t * p.K, (t1 - t) * p.K * sizeof(at::BFloat16));
    amx_panel_tile(p, panel, pad, t, t1 - t, n0);
  }
}

#endif

// A task's panels [b0, b1): up to kBlockTokens tokens (batched decode), each panel dequantized, then used by all
// the tokens while in L1 / L2. More (prefill): every panel dequantized once, then x in blocks of kBlockTokens tokens,
// each block against all the panels while it stays in L2 (each panel re-reading all of x from L3 took 3.9x oneDNN's
// time at 10k tokens on AMX, 1.24x at 2,048 tokens on the vdpbf16ps tiles). tokens(panel, n0, t0, t1) multiplies.
constexpr int64_t kBlockTokens = 256;  // 256 x 576 bf16 = 288 KB of x (768 KB at K = 1,536)

template <int BITS, bool TILES, typename Tokens>
void gemm_task(const Problem& p, int64_t b0, int64_t b1, Tokens&& tokens) {
  const bool blocked = p.T > kBlockTokens;
  const int64_t panel_dwords = p.K / 2 * kPanelRows;
  uint32_t* panels = static_cast<uint32_t*>(std::aligned_alloc(64, (blocked ? b1 - b0 : 1) * panel_dwords * 4));
  if (blocked) {
    for (int64_t b = b0; b < b1; ++b) dequant_panel<BITS, TILES>(p, b * kPanelRows, panels + (b - b0) * panel_dwords);
    for (int64_t t0 = 0; t0 < p.T; t0 += kBlockTokens)
      for (int64_t b = b0; b < b1; ++b)
        tokens(panels + (b - b0) * panel_dwords, b * kPanelRows, t0, std::min(p.T, t0 + kBlockTokens));
  } else {
    for (int64_t b = b0; b < b1; ++b) {
      dequant_panel<BITS, TILES>(p, b * kPanelRows, panels);
      tokens(panels, b * kPanelRows, 0, p.T);
    }
  }
  std::free(panels);
}

#if defined(GRAPHINFER_AMX)
// From this many tokens on (long prefills), AMX builds dequantize the whole weight as dequant32_bf16 rounds it into a
// [N, K] bf16 buffer and hand it to oneDNN's bf16 linear: at 8,192 tokens amx_panel_tile's loop took 1.4-1.5x
// oneDNN's time on the attention and gate_up shapes, the buffer and oneDNN together 0.89-1.02x (the weight written
// out costs < 3 % there); at 1,024 tokens neither won consistently, at 512 the tiles are faster (2-vCPU AMX VM,
// tools/cpu_quant_bench.py, warm weights, 2026-12-02; docs/bench/cpu_gemm_bf16_2026-12-02_amx.json).
constexpr int64_t kAmxDenseTokens = 2048;

template <int BITS>
at::Tensor dense_bf16(const Problem& p) {
  at::Tensor w = at::empty({p.N, p.K}, at::kBFloat16);
  uint32_t* dst = static_cast<uint32_t*>(w.data_ptr());  // [N][K / 2] pairs
  at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t c = 0; c < p.K / 32; ++c)
        _mm512_storeu_si512(dst + n * (p.K / 2) + c * 16, dequant32_bf16<BITS>(p, n, c));
  });
  return w;
}
#endif

template <int BITS>
void gemm_bf16(const Problem& p, const at::Tensor& x_bf16) {
  const uint32_t* x = static_cast<const uint32_t*>(x_bf16.data_ptr());  // [T][K / 2] pairs
  const int64_t panels = (p.N + kPanelRows - 1) / kPanelRows;
#if defined(GRAPHINFER_AMX)
  if (cpu_amx::ready()) {
    at::parallel_for(0, panels, 1, [&](int64_t b0, int64_t b1) {
      std::vector<at::BFloat16> pad(kAmxTokens * p.K);
      amx_configure_gemm();
      gemm_task<BITS, true>(p, b0, b1, [&](const uint32_t* panel, int64_t n0, int64_t t0, int64_t t1) {
        amx_panel(p, panel, x_bf16.const_data_ptr<at::BFloat16>(), pad.data(), n0, t0, t1);
      });
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t b0, int64_t b1) {
    gemm_task<BITS, false>(p, b0, b1, [&](const uint32_t* panel, int64_t n0, int64_t t0, int64_t t1) {
      int64_t t = t0;
      for (; t + kTokenTile <= t1; t += kTokenTile) panel_tile<kTokenTile>(p, panel, x, t, n0);
      tail_tile<kTokenTile - 1>(p, panel, x, t, t1, n0);
    });
  });
}
#endif

// x [T, K] -> fp32 with each chunk of 2L elements reordered: its L even elements, then its L odd ones.
template <typename scalar_t>
void permute_x(const at::Tensor& x, float* dst, int64_t L) {
  const int64_t T = x.size(0), K = x.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* xs = src + t * K;
      float* xd = dst + t * K;
      for (int64_t c = 0; c < K; c += 2 * L)
        for (int64_t j = 0; j < L; ++j) {
          xd[c + j] = static_cast<float>(xs[c + 2 * j]);
          xd[c + L + j] = static_cast<float>(xs[c + 2 * j + 1]);
        }
    }
  });
}

int vector_lanes(int64_t bits, int64_t g) {
  // the widest vector whose chunk (2L codes for bits 4, L for bits 8) divides the group
  auto fits = [&](int L) { return g % (bits == 4 ? 2 * L : L) == 0; };
#if defined(__AVX512F__)
  if (fits(16)) return 16;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (fits(8)) return 8;
#endif
  (void)fits;
  return 0;
}

template <int BITS>
void run_decode(const Problem& p, int lanes) {
#if defined(__AVX512F__)
  if (lanes == 16) return decode_vec<V16, BITS>(p);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (lanes == 8) return decode_vec<V8, BITS>(p);
#endif
  (void)lanes;
  decode_generic(p);
}

template <int BITS>
void (*row_dequantizer(int lanes))(const Problem&, int64_t, float*) {
#if defined(__AVX512F__)
  if (lanes == 16) return &dequant_row_vec<V16, BITS>;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (lanes == 8) return &dequant_row_vec<V8, BITS>;
#endif
  (void)lanes;
  return &dequant_row_generic;
}

// t as a contiguous fp32 tensor (itself when it is one: no dispatcher round trips on the decode path)
inline at::Tensor as_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

at::Tensor wo_linear(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scales_in,
                     const std::optional<at::Tensor>& zeros_in, int64_t bits, const std::optional<at::Tensor>& bias_in,
                     bool bf16_gemm) {
  TORCH_CHECK(bits == 4 || bits == 8, "wo_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_floating_point(), "wo_linear: x must be a float [T, K] tensor");
  TORCH_CHECK(qweight_in.dim() == 2 && scales_in.dim() == 2, "wo_linear: qweight [N, K(/2)], scales [N, G]");
  TORCH_CHECK(qweight_in.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "wo_linear: bits 4 needs uint8 qweight [N, K / 2], bits 8 int8 [N, K]");
  const int64_t T = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0), G = scales_in.size(1);
  TORCH_CHECK(qweight_in.size(1) * (bits == 4 ? 2 : 1) == K, "wo_linear: qweight ", qweight_in.sizes(),
              " does not match K = ", K);
  TORCH_CHECK(scales_in.size(0) == N && G > 0 && K % G == 0, "wo_linear: scales ", scales_in.sizes(),
              " must be [N, G] with G dividing K = ", K);
  const bool half = scales_in.scalar_type() == at::kHalf &&  // GGUF's width, read as it is
                    (!zeros_in.has_value() || zeros_in->scalar_type() == at::kHalf);
  const at::Tensor qweight = qweight_in.contiguous(), scales = half ? scales_in.contiguous() : as_float(scales_in);
  at::Tensor zeros, bias;
  if (zeros_in.has_value()) {
    zeros = half ? zeros_in->contiguous() : as_float(*zeros_in);
    TORCH_CHECK(zeros.sizes() == scales.sizes(), "wo_linear: zeros must have the shape of scales");
  }
  if (bias_in.has_value()) {
    bias = as_float(*bias_in);
    TORCH_CHECK(bias.numel() == N, "wo_linear: bias must have N = ", N, " elements");
  }
  if (T == 0 || N == 0 || K == 0) {
    at::Tensor out = at::zeros({T, N}, x_in.options().dtype(at::kFloat));
    if (bias.defined()) out.add_(bias);
    return cpu_vec::float_to(out, x_in.scalar_type());
  }

  const int64_t g = K / G;
#if defined(__AVX512BF16__)
  if (bf16_gemm && T >= kGemmMinTokens && K % 32 == 0 && g % 32 == 0) {
    const at::Tensor xb = x_in.to(at::kBFloat16).contiguous();  // round to nearest even, as the weights
    const bool bf16_out = x_in.scalar_type() == at::kBFloat16;
    Problem p{static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), scales.data_ptr(),
              zeros.defined() ? zeros.data_ptr() : nullptr, half, bias.defined() ? bias.data_ptr<float>() : nullptr,
              nullptr, nullptr, nullptr, N, K, G, g, T, bits};
#if defined(GRAPHINFER_AMX)
    // bf16 in and out, no bias: oneDNN's result is then the tiles' (fp32 sums rounded once); an fp32 out or bias
    // would be rounded to bf16 on its way through at::linear
    if (T >= kAmxDenseTokens && bf16_out && !bias.defined() && cpu_amx::ready())
      return at::linear(xb, bits == 4 ? dense_bf16<4>(p) : dense_bf16<8>(p));
#endif
    at::Tensor out = at::empty({T, N}, x_in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
    if (bf16_out) p.out_bf16 = out.data_ptr<at::BFloat16>();
    else p.out = out.data_ptr<float>();
    if (bits == 4) gemm_bf16<4>(p, xb);
    else gemm_bf16<8>(p, xb);
    return bf16_out ? out : cpu_vec::float_to(out, x_in.scalar_type());
  }
#endif
  const int lanes = vector_lanes(bits, g);
  at::Tensor out = at::empty({T, N}, x_in.options().dtype(at::kFloat));
  at::Tensor x;  // fp32 [T, K], in the vector kernels' k order
  if (bits == 4 && lanes) {
    const at::Tensor xc = x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16
                              ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
    x = at::empty({T, K}, x_in.options().dtype(at::kFloat));
    if (xc.scalar_type() == at::kFloat) permute_x<float>(xc, x.data_ptr<float>(), lanes);
    else permute_x<at::BFloat16>(xc, x.data_ptr<float>(), lanes);
  } else {
    x = as_float(x_in);
  }

  Problem p{static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(1), scales.data_ptr(),
            zeros.defined() ? zeros.data_ptr() : nullptr, half, bias.defined() ? bias.data_ptr<float>() : nullptr,
            x.data_ptr<float>(), nullptr, out.data_ptr<float>(), N, K, G, g, T, bits};

  if (T >= kGemmMinTokens) {
#if defined(__AVX2__) && defined(__FMA__)
    if (lanes == 8) {
      if (bits == 4) gemm_f32<4>(p);
      else gemm_f32<8>(p);
      return cpu_vec::float_to(out, x_in.scalar_type());
    }
#endif
    gemm_chunks(p, x, out, bits == 4 ? row_dequantizer<4>(lanes) : row_dequantizer<8>(lanes), kGemmChunkBytes);
  } else {
    std::vector<float> xsum;
    if (zeros.defined() && lanes) {  // per-group sums of x for the factored kernels' zero term
      xsum.resize(T * G);
      for (int64_t i = 0; i < T * G; ++i) {
        const float* xg = p.x + i * g;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < g; ++k) acc += xg[k];
        xsum[i] = acc;
      }
      p.xsum = xsum.data();
    }
    if (bits == 4) run_decode<4>(p, lanes);
    else run_decode<8>(p, lanes);
  }
  return cpu_vec::float_to(out, x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY(graphinfer_cpu_quant, m) {
  m.def("wo_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int bits, Tensor? bias, "
        "bool bf16_gemm=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu_quant, CPU, m) {
  m.impl("wo_linear", &wo_linear);
}
