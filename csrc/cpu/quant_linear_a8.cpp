// graphinfer_cpu_quant::wo_linear_a8: the weight-only linear with llama.cpp's decode arithmetic
// (ggml_vec_dot_q4_1_q8_1, ggml_vec_dot_q8_0_q8_0): activations rounded to int8 per block of 32 once per call, the
// code dot products in integer SIMD, each block's scale / zero applied in fp32. Faster than wo_linear's exact fp32
// GEMV (fewer vector ops per weight byte) but not exact: each activation moves by at most half its block's step
// d = amax / 127.
//
// Form (ops/quant.py, group 32, K a multiple of 64): qweight uint8 [N, K / 2] (bits 4, even k in the low nibble) or
// int8 [N, K] (bits 8, the activations then in natural order), scales
// [N, K / 32] and zeros [N, K / 32] (or none) in fp16 (GGUF's width: 5 bits of traffic per weight for Q4_1) or fp32.
// out[t, n] = sum_g s[n, g] * dx[t, g] * sum_{k in g} q[n, k] * xq[t, k] + z[n, g] * xs[t, g] + bias[n], with
// xq = round(x / dx) in [-127, 127] and xs the exact fp32 sum of x over the group (llama.cpp uses dx * sum xq).
//
// The activations are quantized into the order the vector kernels read: per pair of groups A, B (64 elements),
// [A even k, B even k, A odd k, B odd k] (16 each): 32 weight bytes of a pair, their low nibbles then their high ones,
// line up with it byte for byte. Paths, picked at run time from what this build has and the caller's cap (max_isa:
// the tests run each path on one machine): 2 AVX-512 VNNI (_mm512_dpbusd_epi32: one pair per instruction),
// 1 AVX2 (_mm256_maddubs_epi16 + _mm256_madd_epi16), 0 scalar. From 64 tokens on, builds with AVX-512 VNNI run
// gemm_vnni instead (below): the same arithmetic with the lanes over weight rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kGroup = 32, kPair = 64;
constexpr int64_t kRows = 8;  // rows per task unit
constexpr int kMaxTokens = 8;  // tokens per register tile
constexpr int64_t kGemmTokens = 64;  // from here on VNNI builds run gemm_vnni
constexpr int kHaddOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // the AVX2 bits-4 kernel's group order in a step of 8

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kBuiltIsa = 2;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kBuiltIsa = 1;
#else
constexpr int kBuiltIsa = 0;
#endif

struct Acts {  // the activations of one call, quantized
  std::vector<int8_t> q;  // [T, K] in pair order
  std::vector<float> d;   // [T, Gp] block steps (Gp: G rounded up to 16, zero padded)
  std::vector<float> s;   // [T, Gp] exact block sums
  std::vector<float> dh;  // bits 4: d with each 8 groups in the AVX2 kernel's order kHaddOrder
  int64_t Gp;
};

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8f(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8f(const at::BFloat16* x) {  // bf16 -> fp32: the 16 bits shifted up
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// One block of 32: its amax and sum (the sum in lanes, then across: the order differs from the scalar loop's, within
// fp32 rounding), and its 32 codes round(x * id) in natural order (cvtps rounds to nearest even, as nearbyint)
template <typename scalar_t>
inline __m256i quantize_block(const scalar_t* xg, float& d, float& sum) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps(), vs = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8f(xg + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    vs = _mm256_add_ps(vs, v[i]);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  sum = _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  d = _mm_cvtss_f32(m) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
  // packs interleave the 128-bit lanes: [0-3 8-11 16-19 24-27 | 4-7 12-15 20-23 28-31] in 4-byte units; undone
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// The activations of one call, quantized into this thread's buffers (reused: no allocation per call; the kernel's
// worker threads read the caller's).
template <typename scalar_t>
const Acts& quantize_acts(const scalar_t* x, int64_t T, int64_t K, int bits, bool gemm) {
  static thread_local Acts tls;
  Acts& a = tls;  // the caller's, in the workers too (a thread_local named in the lambda would be each worker's own)
  const int64_t G = K / kGroup, Gp = (G + 15) / 16 * 16;
  a.Gp = Gp;
  a.q.resize(T * K);
  a.d.assign(T * Gp, 0.f);
  a.s.assign(T * Gp, 0.f);
  // prefill-sized calls on all threads (one token's row is ~1 us of work)
  at::parallel_for(0, T, 32, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
#if defined(__AVX2__) && defined(__FMA__)
      // bits 4: pairs of blocks A, B into the pair order [A even k, B even k, A odd k, B odd k]: each block's even
      // codes then its odd ones in each 128-bit lane, lanes' halves gathered, then the two blocks' halves interleaved
      const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                  0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      for (int64_t gi = 0; gi < G; gi += 2) {
        float* d = a.d.data() + t * Gp + gi;
        float* s = a.s.data() + t * Gp + gi;
        const __m256i qa = quantize_block(x + t * K + gi * kGroup, d[0], s[0]);
        const __m256i qb = quantize_block(x + t * K + (gi + 1) * kGroup, d[1], s[1]);
        int8_t* dst = a.q.data() + t * K + gi * kGroup;
        if (bits == 8) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), qa);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kGroup), qb);
          continue;
        }
        const __m256i ha = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(qa, evens_odds), 0xD8);  // [A even, A odd]
        const __m256i hb = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(qb, evens_odds), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(ha, hb, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(ha, hb, 0x31));
      }
#else
      for (int64_t gi = 0; gi < G; ++gi) {
        const scalar_t* xg = x + t * K + gi * kGroup;
        float amax = 0.f, sum = 0.f;
        for (int j = 0; j < kGroup; ++j) {
          const float v = static_cast<float>(xg[j]);
          amax = std::max(amax, std::abs(v));
          sum += v;
        }
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        a.d[t * Gp + gi] = d;
        a.s[t * Gp + gi] = sum;
        if (bits == 8) {  // the codes' own order
          int8_t* dst = a.q.data() + t * K + gi * kGroup;
          for (int j = 0; j < kGroup; ++j) dst[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xg[j]) * id));
          continue;
        }
        // element j of group gi -> its place in the pair order (B: the pair's second group, +16)
        int8_t* dst = a.q.data() + t * K + (gi / 2) * kPair + (gi % 2) * 16;
        for (int j = 0; j < kGroup; ++j)
          dst[(j % 2) * 32 + j / 2] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xg[j]) * id));
      }
#endif
    }
  });
  if (bits == 4 && !gemm) {  // the AVX2 row kernel's group order (gemm_vnni reads d as it is)
    a.dh.resize(T * Gp);
    for (int64_t i = 0; i < T * Gp; ++i) a.dh[i] = a.d[i / 8 * 8 + kHaddOrder[i % 8]];
  }
  return a;
}

struct Problem {
  const uint8_t* w;  // [N, K / 2] (bits 4) or int8 [N, K] (bits 8)
  const void* scales;
  const void* zeros;  // or nullptr
  bool half;          // scales / zeros fp16 (else fp32)
  const float* bias;  // or nullptr
  const Acts* a;
  float* out;  // [T, N]
  int64_t N, K, G, T, row_bytes;
};

inline float scalar_at(const Problem& p, const void* base, int64_t i) {
  if (!p.half) return static_cast<const float*>(base)[i];
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))  // (immintrin.h included)
  return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
#else
  return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
#endif
}

template <int BITS>
void row_scalar(const Problem& p, int64_t n, int64_t t0, int mt) {
  const uint8_t* w = p.w + n * p.row_bytes;
  for (int t = t0; t < t0 + mt; ++t) {
    const int8_t* xq = p.a->q.data() + t * p.K;
    const float* d = p.a->d.data() + t * p.a->Gp;
    const float* s = p.a->s.data() + t * p.a->Gp;
    float acc = 0.f;
    for (int64_t pi = 0; pi < p.K / kPair; ++pi) {
      const uint8_t* wp = w + pi * 32;
      const int8_t* xp = xq + pi * kPair;
      for (int h = 0; h < 2; ++h) {  // groups A (bytes 0..15 of bits 4) and B (16..31)
        int32_t dot = 0;
        if constexpr (BITS == 4) {
          for (int b = h * 16; b < h * 16 + 16; ++b) dot += (wp[b] & 15) * xp[b] + (wp[b] >> 4) * xp[32 + b];
        } else {
          const int8_t* wq = reinterpret_cast<const int8_t*>(w) + pi * kPair + h * kGroup;
          for (int j = 0; j < kGroup; ++j) dot += wq[j] * xp[h * kGroup + j];
        }
        const int64_t gi = 2 * pi + h;
        acc += scalar_at(p, p.scales, n * p.G + gi) * d[gi] * static_cast<float>(dot);
        if (p.zeros) acc += scalar_at(p, p.zeros, n * p.G + gi) * s[gi];
      }
    }
    p.out[t * p.N + n] = acc + (p.bias ? p.bias[n] : 0.f);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 scales (or zeros) of groups i0.. of row n as fp32, those past the row's end (left < 8) zero: read past it into
// the next row's, or from a copy on the last row
__attribute__((always_inline)) inline __m256 load8(const Problem& p, const void* base, int64_t n, int64_t i0,
                                                   int64_t left) {
  if (__builtin_expect(left < 8 && n + 1 == p.N, 0)) {
    alignas(32) float buf[8] = {};
    for (int64_t i = 0; i < left; ++i) buf[i] = scalar_at(p, base, i0 + i);
    return _mm256_load_ps(buf);
  }
  const __m256 v = p.half ? _mm256_cvtph_ps(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i0)))
                          : _mm256_loadu_ps(static_cast<const float*>(base) + i0);
  if (left >= 8) return v;
  return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
}

// Eight int32 vectors, u[i] all of group i's partial sums -> one vector of the eight sums in group order
inline __m256i sum8(const __m256i u[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(u[4], u[5]), _mm256_hadd_epi32(u[6], u[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Rows [n0, n1) (a block a call: the loop's state stays in registers), each against MT tokens, 8 groups (4 pairs) a
// step: the code dots of each group in int32 (maddubs + madd), the 8 groups' sums gathered into one vector by a hadd
// tree, then one fp32 FMA with the 8 scale x step products
// (llama.cpp's AVX2 kernel scales each group by itself: a broadcast and an FMA per 32 codes).
// bits 4: a pair's madd lanes are [A x4, B x4], so the tree's 3 hadds leave groups in the order
// kHaddOrder: the weight scales are permuted to it, the activation steps stored in it (Acts::dh).
// bits 8 (signed codes): llama.cpp's sign trick, |w| (unsigned) times x with w's sign, so maddubs's int16 sums stay
// within 2 * 128 * 127; one vector per group, summed in group order by sum8.
template <int BITS, int MT>
void rows_avx2(const Problem& p, int64_t n0, int64_t n1, int64_t t0) {
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kHaddOrder));
  const int64_t Gp = p.a->Gp, pairs = p.K / kPair;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = p.w + n * p.row_bytes;
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < p.G; g0 += 8) {
      const int64_t p0 = g0 / 2, np = std::min<int64_t>(4, pairs - p0);
      __m256 sw = load8(p, p.scales, n, n * p.G + g0, p.G - g0);
      if constexpr (BITS == 4) sw = _mm256_permutevar8x32_ps(sw, order);
      if (p.zeros) {  // the zero terms (any lane order: all lanes are summed at the end)
        const __m256 zw = load8(p, p.zeros, n, n * p.G + g0, p.G - g0);
        for (int t = 0; t < MT; ++t)
          acc[t] = _mm256_fmadd_ps(zw, _mm256_loadu_ps(p.a->s.data() + (t0 + t) * Gp + g0), acc[t]);
      }
      __m256i wa[8];  // bits 4: pair j's low nibbles wa[j], high ones wa[4 + j]; bits 8: group i's codes
      for (int j = 0; j < 4; ++j) {
        __m256i a = _mm256_setzero_si256(), b = a;  // zero past the row's last pair
        if (j < np && BITS == 4) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p0 + j) * 32));
          a = _mm256_and_si256(wv, nib), b = _mm256_and_si256(_mm256_srli_epi16(wv, 4), nib);
        } else if (j < np) {
          a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p0 + j) * kPair));
          b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p0 + j) * kPair + 32));
        }
        wa[BITS == 4 ? j : 2 * j] = a, wa[BITS == 4 ? 4 + j : 2 * j + 1] = b;
      }
      for (int t = 0; t < MT; ++t) {
        const int8_t* xp = p.a->q.data() + (t0 + t) * p.K + p0 * kPair;
        __m256i dot;
        if constexpr (BITS == 4) {
          __m256i v[4];
          for (int j = 0; j < 4; ++j) {
            if (j >= np) { v[j] = _mm256_setzero_si256(); continue; }
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + j * kPair));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + j * kPair + 32));
            // int16 pair sums stay within 2 * 2 * 15 * 127: no saturation
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(wa[j], x0), _mm256_maddubs_epi16(wa[4 + j], x1));
            v[j] = _mm256_madd_epi16(s16, ones);
          }
          dot = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        } else {
          __m256i u[8];
          for (int i = 0; i < 8; ++i) {
            if (i >= 2 * np) { u[i] = _mm256_setzero_si256(); continue; }
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + i * kGroup));
            u[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wa[i], wa[i]), _mm256_sign_epi8(xv, wa[i])),
                                     ones);
          }
          dot = sum8(u);
        }
        const float* d = (BITS == 4 ? p.a->dh : p.a->d).data() + (t0 + t) * Gp + g0;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, _mm256_loadu_ps(d)), acc[t]);
      }
    }
    for (int t = 0; t < MT; ++t) p.out[(t0 + t) * p.N + n] = hsum8(acc[t]) + (p.bias ? p.bias[n] : 0.f);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 16 scales (or zeros) of groups g0.. as fp32, those past G zero
inline __m512 load16(const Problem& p, const void* base, int64_t i0, int64_t left) {
  const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  if (p.half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i0));
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i0);
}

// bits 8: dpbusd of |w| (unsigned) and x negated where w < 0 (the sign trick, as the AVX2 path)
template <int BITS, int MT>
void row_vnni(const Problem& p, int64_t n, int64_t t0) {
  const uint8_t* w = p.w + n * p.row_bytes;
  const __m512i nib = _mm512_set1_epi8(15);
  // lanes of pair j (groups 2j, 2j + 1 of a block of 16): bits 4 [2j x4, 2j+1 x4, 2j x4, 2j+1 x4]; bits 8 [2j x8,
  // 2j+1 x8]
  const __m512i idx0 = BITS == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                 : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i two = _mm512_set1_epi32(2);
  const int64_t Gp = p.a->Gp, pairs = p.K / kPair;
  __m512 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < p.G; g0 += 16) {  // blocks of 16 groups (8 pairs)
    const __m512 sw = load16(p, p.scales, n * p.G + g0, p.G - g0);
    __m512 sc[MT];  // weight scale x activation step per group
    for (int t = 0; t < MT; ++t) {
      sc[t] = _mm512_mul_ps(sw, _mm512_loadu_ps(p.a->d.data() + (t0 + t) * Gp + g0));
      if (p.zeros)  // the zero terms, in any lanes (all lanes are summed at the end)
        acc[t] = _mm512_fmadd_ps(load16(p, p.zeros, n * p.G + g0, p.G - g0),
                                 _mm512_loadu_ps(p.a->s.data() + (t0 + t) * Gp + g0), acc[t]);
    }
    __m512i idx = idx0;
    const int64_t p1 = std::min(pairs, (g0 + 16) / 2);
    for (int64_t pi = g0 / 2; pi < p1; ++pi, idx = _mm512_add_epi32(idx, two)) {
      __m512i wq;
      __mmask64 neg = 0;
      if constexpr (BITS == 4) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + pi * 32));
        wq = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(wv), _mm256_srli_epi16(wv, 4), 1), nib);
      } else {
        const __m512i wv = _mm512_loadu_si512(w + pi * kPair);
        wq = _mm512_abs_epi8(wv);
        neg = _mm512_movepi8_mask(wv);
      }
      for (int t = 0; t < MT; ++t) {
        __m512i xq = _mm512_loadu_si512(p.a->q.data() + (t0 + t) * p.K + pi * kPair);
        if constexpr (BITS == 8) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(idx, sc[t]), acc[t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    p.out[(t0 + t) * p.N + n] = _mm512_reduce_add_ps(acc[t]) + (p.bias ? p.bias[n] : 0.f);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Many tokens (batched decode, prefill): gemm_vnni, a GEMM on the int8 activations whose vector lanes run over 16
// weight rows (row_vnni's run over k, which costs a reduction per group and token). Each task takes a panel of
// kPanelRows rows and rearranges its codes once, as they are, into vpdpbusd's unsigned operand: per group, 8 steps
// of 4 codes (a dword) for each of the panel's rows, bits 4 split into nibbles (0..15), bits 8 offset by 128 (the
// offset comes back out as a zero term, -128 s * d * sum xq); the groups' scales (and zeros) as fp32 beside them.
// Then tiles of kTileTokens tokens x 48 rows: per step, one broadcast dword of 4 activation codes per token against
// the 3 vectors of rows (64 multiply-adds a vpdpbusd, vs vdpbf16ps's 32 in wo_linear's gemm_bf16), int32 sums per
// group, flushed into fp32 with the group's weight scale x activation step (and the zero term s_x * z).
constexpr int kPanelRows = 48, kPanelVecs = 3;
constexpr int kTileTokens = 4;  // 4 tokens x 3 vectors x (int32 + fp32 sums) = 24 of the 32 registers

// Rows n0 .. n0 + 15 (zero past N), `bytes` (<= 64, a multiple of 4) of each from byte off: out[j] = dword j of every
// row (one load a row and one 16 x 16 transpose for up to 4 groups of bits 4, 2 of bits 8)
inline void rows16_dwords(const Problem& p, int64_t n0, int64_t off, int64_t bytes, __m512i out[16]) {
  const __mmask16 m = static_cast<__mmask16>((1u << (bytes / 4)) - 1);
  for (int i = 0; i < 16; ++i)
    out[i] = n0 + i < p.N ? _mm512_maskz_loadu_epi32(m, p.w + (n0 + i) * p.row_bytes + off) : _mm512_setzero_si512();
  cpu_vec::transpose16(out);
}

struct VnniPanel {  // one panel's rows as gemm_vnni reads them
  uint32_t* codes;  // [G][8 steps][kPanelRows] dwords, 64-byte aligned
  float* s;         // [G][kPanelRows] weight scales
  float* z;         // [G][kPanelRows] zero terms' weights (zeros; bits 8: -128 s), or nullptr (bits 4 without zeros)
};

// Byte offset in a token's quantized row of group gi's step j (4 codes). Bits 4 (Acts' pair order [A even, B even,
// A odd, B odd]): steps 0-3 the group's even k, which the low nibbles of its weight bytes 4j .. 4j + 3 hold, steps
// 4-7 its odd k (the high nibbles); bits 8: natural order.
template <int BITS>
inline int64_t act_offset(int64_t gi, int j) {
  if constexpr (BITS == 4) return (gi / 2) * kPair + (j / 4) * 32 + (gi % 2) * 16 + (j % 4) * 4;
  return gi * kGroup + 4 * j;
}

template <int BITS>
void vnni_panel(const Problem& p, int64_t n0, const VnniPanel& pn) {
  const __m512i nib = _mm512_set1_epi8(15), bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
  constexpr int64_t kChunkGroups = BITS == 4 ? 4 : 2, kGroupBytes = kGroup * BITS / 8;  // 64 bytes of a row
  for (int64_t g0 = 0; g0 < p.G; g0 += kChunkGroups) {
    const int64_t groups = std::min(kChunkGroups, p.G - g0);
    for (int h = 0; h < kPanelVecs; ++h) {
      __m512i d[16];
      rows16_dwords(p, n0 + 16 * h, g0 * kGroupBytes, groups * kGroupBytes, d);
      for (int64_t c = 0; c < groups; ++c) {
        uint32_t* dst = pn.codes + (g0 + c) * 8 * kPanelRows + 16 * h;
        for (int j = 0; j < 4; ++j) {
          if constexpr (BITS == 4) {  // a group's 16 bytes: 4 dwords of low nibbles (steps 0-3), of high ones (4-7)
            _mm512_store_si512(dst + j * kPanelRows, _mm512_and_si512(d[4 * c + j], nib));
            _mm512_store_si512(dst + (4 + j) * kPanelRows, _mm512_and_si512(_mm512_srli_epi16(d[4 * c + j], 4), nib));
          } else {  // a group's 32 bytes: its 8 steps
            _mm512_store_si512(dst + j * kPanelRows, _mm512_xor_si512(d[8 * c + j], bias128));
            _mm512_store_si512(dst + (4 + j) * kPanelRows, _mm512_xor_si512(d[8 * c + 4 + j], bias128));
          }
        }
      }
    }
  }
  for (int r = 0; r < kPanelRows; ++r) {
    const int64_t n = n0 + r;
    for (int64_t gi = 0; gi < p.G; ++gi) {
      const float s = n < p.N ? scalar_at(p, p.scales, n * p.G + gi) : 0.f;
      pn.s[gi * kPanelRows + r] = s;
      if (BITS == 8) pn.z[gi * kPanelRows + r] = -128.f * s;
      else if (pn.z) pn.z[gi * kPanelRows + r] = n < p.N ? scalar_at(p, p.zeros, n * p.G + gi) : 0.f;
    }
  }
}

// out[t0 .. t0 + MT)[n0 .. n0 + kPanelRows) = the panel's rows against those tokens (+ bias), columns past N not
// stored. xs: the zero terms' per-group activation sums [T][Gp] (bits 4: exact sums of x; bits 8: d * sum xq).
template <int BITS, int MT>
void vnni_tile(const Problem& p, const VnniPanel& pn, const float* xs, int64_t t0, int64_t n0) {
  const int64_t Gp = p.a->Gp;
  __m512 acc[MT][kPanelVecs];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < kPanelVecs; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const uint32_t* w = pn.codes + gi * 8 * kPanelRows;
    const int8_t* xg = p.a->q.data() + t0 * p.K + act_offset<BITS>(gi, 0);
    __m512i dot[MT][kPanelVecs];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // unrolled: the offsets are constants, the first step starts the sums
      __m512i wv[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) wv[v] = _mm512_load_si512(w + j * kPanelRows + 16 * v);
      const int64_t off = act_offset<BITS>(0, j);
      for (int t = 0; t < MT; ++t) {
        int32_t x4;
        std::memcpy(&x4, xg + t * p.K + off, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        for (int v = 0; v < kPanelVecs; ++v)
          dot[t][v] = j == 0 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[v], xb)
                             : _mm512_dpbusd_epi32(dot[t][v], wv[v], xb);
      }
    }
    for (int t = 0; t < MT; ++t) {
      const __m512 dx = _mm512_set1_ps(p.a->d[(t0 + t) * Gp + gi]);
      for (int v = 0; v < kPanelVecs; ++v) {
        const __m512 sc = _mm512_mul_ps(_mm512_load_ps(pn.s + gi * kPanelRows + 16 * v), dx);
        acc[t][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][v]), sc, acc[t][v]);
      }
      if (pn.z) {
        const __m512 sx = _mm512_set1_ps(xs[(t0 + t) * Gp + gi]);
        for (int v = 0; v < kPanelVecs; ++v)
          acc[t][v] = _mm512_fmadd_ps(_mm512_load_ps(pn.z + gi * kPanelRows + 16 * v), sx, acc[t][v]);
      }
    }
  }
  for (int v = 0; v < kPanelVecs; ++v) {
    const int64_t valid = std::clamp<int64_t>(p.N - n0 - 16 * v, 0, 16);
    const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int t = 0; t < MT; ++t)
      _mm512_mask_storeu_ps(p.out + (t0 + t) * p.N + n0 + 16 * v, m, _mm512_add_ps(acc[t][v], bv));
  }
}

// The next panel's codes (contiguous rows) on their way into L1, a slice per tile: vnni_panel's loads go across 16
// rows at once and stalled on cold weights (perf, a 64-token gate_up); prefetching a whole panel in one burst
// measured no faster
struct Prefetch {
  const char* begin = nullptr;
  int64_t lines = 0, done = 0;
  void slice(int64_t parts) {
    const int64_t to = std::min(lines, done + (lines + parts - 1) / parts);
    for (; done < to; ++done) _mm_prefetch(begin + done * 64, _MM_HINT_T0);
  }
};

// Tokens [t0, t1) against one panel: tiles of kTileTokens, then the rest in one smaller tile
template <int BITS>
void vnni_tokens(const Problem& p, const VnniPanel& pn, const float* xs, int64_t n0, int64_t t0, int64_t t1,
                 Prefetch& next) {
  const int64_t tiles = (t1 - t0 + kTileTokens - 1) / kTileTokens;
  int64_t t = t0;
  for (; t + kTileTokens <= t1; t += kTileTokens) {
    next.slice(tiles);
    vnni_tile<BITS, kTileTokens>(p, pn, xs, t, n0);
  }
  next.slice(1);
  switch (t1 - t) {
    case 3: vnni_tile<BITS, 3>(p, pn, xs, t, n0); break;
    case 2: vnni_tile<BITS, 2>(p, pn, xs, t, n0); break;
    case 1: vnni_tile<BITS, 1>(p, pn, xs, t, n0); break;
    default: break;
  }
}

template <int BITS>
void gemm_vnni(const Problem& p) {
  const int64_t Gp = p.a->Gp, panels = (p.N + kPanelRows - 1) / kPanelRows;
  const bool zero_term = BITS == 8 || p.zeros;
  std::vector<float> xs8;  // bits 8: d * sum xq per group, the offset's correction
  if constexpr (BITS == 8) {
    xs8.assign(p.T * Gp, 0.f);
    at::parallel_for(0, p.T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t gi = 0; gi < p.G; ++gi) {
          const int8_t* q = p.a->q.data() + t * p.K + gi * kGroup;
          int32_t sum = 0;
          for (int j = 0; j < kGroup; ++j) sum += q[j];
          xs8[t * Gp + gi] = p.a->d[t * Gp + gi] * static_cast<float>(sum);
        }
    });
  }
  const float* xs = BITS == 8 ? xs8.data() : p.a->s.data();
  at::parallel_for(0, panels, 1, [&](int64_t b0, int64_t b1) {
    const int64_t code_dwords = p.G * 8 * kPanelRows, param_floats = p.G * kPanelRows;
    uint32_t* codes = static_cast<uint32_t*>(std::aligned_alloc(64, code_dwords * 4));
    float* params = static_cast<float*>(std::aligned_alloc(64, 2 * param_floats * 4));
    const VnniPanel pn{codes, params, zero_term ? params + param_floats : nullptr};
    for (int64_t b = b0; b < b1; ++b) {
      vnni_panel<BITS>(p, b * kPanelRows, pn);
      Prefetch next;
      if (b + 1 < b1) {
        const int64_t n1 = (b + 1) * kPanelRows;
        next.begin = reinterpret_cast<const char*>(p.w + n1 * p.row_bytes);
        next.lines = (std::min<int64_t>(kPanelRows, p.N - n1) * p.row_bytes + 63) / 64;
      }
      vnni_tokens<BITS>(p, pn, xs, b * kPanelRows, 0, p.T, next);
    }
    std::free(codes);
    std::free(params);
  });
}
#endif

// rows [n0, n1) against tokens t0 .. t0 + mt - 1 on path isa
template <int BITS>
void rows(const Problem& p, int isa, int64_t n0, int64_t n1, int64_t t0, int mt) {
#define GI_TILES(call)                               \
  switch (mt) {                                      \
    case 1: call(1); return;                         \
    case 2: call(2); return;                         \
    case 3: call(3); return;                         \
    case 4: call(4); return;                         \
    case 5: call(5); return;                         \
    case 6: call(6); return;                         \
    case 7: call(7); return;                         \
    default: call(8); return;                        \
  }
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GI_VNNI(MT) for (int64_t n = n0; n < n1; ++n) row_vnni<BITS, MT>(p, n, t0)
  if (isa >= 2) GI_TILES(GI_VNNI)
#undef GI_VNNI
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define GI_AVX2(MT) rows_avx2<BITS, MT>(p, n0, n1, t0)
  if (isa >= 1) GI_TILES(GI_AVX2)
#undef GI_AVX2
#endif
#undef GI_TILES
  (void)isa;
  for (int64_t n = n0; n < n1; ++n) row_scalar<BITS>(p, n, t0, mt);
}

at::Tensor wo_linear_a8(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scales_in,
                        const std::optional<at::Tensor>& zeros_in, const std::optional<at::Tensor>& bias_in,
                        int64_t max_isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_floating_point(), "wo_linear_a8: x must be a float [T, K] tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1), N = qweight_in.size(0);
  const int bits = qweight_in.scalar_type() == at::kChar ? 8 : 4;
  TORCH_CHECK(qweight_in.dim() == 2 && (qweight_in.scalar_type() == at::kByte || bits == 8) &&
                  qweight_in.size(1) * (bits == 4 ? 2 : 1) == K,
              "wo_linear_a8: qweight must be uint8 [N, K / 2] (bits 4) or int8 [N, K] (bits 8)");
  TORCH_CHECK(K % kPair == 0, "wo_linear_a8: K = ", K, " must be a multiple of 64");
  const int64_t G = K / kGroup;
  TORCH_CHECK(scales_in.dim() == 2 && scales_in.size(0) == N && scales_in.size(1) == G,
              "wo_linear_a8: scales must be [N, K / 32] (group 32)");
  const auto sdt = scales_in.scalar_type();
  TORCH_CHECK(sdt == at::kHalf || sdt == at::kFloat, "wo_linear_a8: scales must be fp16 or fp32");
  const at::Tensor qweight = qweight_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor zeros, bias;
  if (zeros_in.has_value()) {
    zeros = zeros_in->contiguous();
    TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.scalar_type() == sdt,
                "wo_linear_a8: zeros must have the shape and dtype of scales");
  }
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "wo_linear_a8: bias must have N = ", N, " elements");
  }
  at::Tensor out = at::empty({T, N}, x_in.options().dtype(at::kFloat));
  if (T > 0 && N > 0) {
    const at::Tensor xc = x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16
                              ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
    const int isa = static_cast<int>(std::min<int64_t>(max_isa, kBuiltIsa));
    const bool gemm = isa >= 2 && T >= kGemmTokens && (bits == 4 || !zeros.defined());  // gemm_vnni (VNNI builds)
    const Acts& acts = xc.scalar_type() == at::kFloat ? quantize_acts(xc.data_ptr<float>(), T, K, bits, gemm)
                                                     : quantize_acts(xc.data_ptr<at::BFloat16>(), T, K, bits, gemm);
    const Problem p{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(),
                    zeros.defined() ? zeros.data_ptr() : nullptr, sdt == at::kHalf,
                    bias.defined() ? bias.data_ptr<float>() : nullptr, &acts,
                    out.data_ptr<float>(), N, K, G, T, qweight.size(1)};
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (gemm) {
      if (bits == 4) gemm_vnni<4>(p);
      else gemm_vnni<8>(p);
      return cpu_vec::float_to(out, x_in.scalar_type());
    }
#endif
    const int64_t blocks = (N + kRows - 1) / kRows;
    const int64_t grain = cpu_vec::stream_chunk(blocks, kRows * K, 65536);
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t n = b0 * kRows; n < std::min(N, b1 * kRows); n += kRows)  // a block's rows stay in L1 over tiles
        for (int64_t t0 = 0; t0 < T; t0 += kMaxTokens)
          (bits == 4 ? rows<4> : rows<8>)(p, isa, n, std::min(N, n + kRows), t0,
                                          static_cast<int>(std::min<int64_t>(T - t0, kMaxTokens)));
    };
    cpu_vec::parallel_chunks(blocks, grain, run);
  }
  return cpu_vec::float_to(out, x_in.scalar_type());
}

int64_t wo_linear_a8_isa() { return kBuiltIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(graphinfer_cpu_quant, m) {
  m.def("wo_linear_a8(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int max_isa=2) -> Tensor");
  m.def("wo_linear_a8_isa() -> int", &wo_linear_a8_isa);  // the best path this build has
}

TORCH_LIBRARY_IMPL(graphinfer_cpu_quant, CPU, m) {
  m.impl("wo_linear_a8", &wo_linear_a8);
}
