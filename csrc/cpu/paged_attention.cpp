// The cpu platform's paged KV-cache kernels. Paged attention: every decode row and every prefill chunk of a batch
// attends over its own context, reading K and V in place from the paged cache (no gather copy, no padding to the
// longest context).
//
// Built by `make` (graphinfer/ops/cpu/ext.py) into graphinfer/ops/cpu/_cpu_kernels.so and loaded with
// torch.ops.load_library; graphinfer/ops/cpu/attention.py falls back to gather + ATen flash when it is absent.
//
// Layouts as in graphinfer/ops/attention.py: query [T, Hq, D] (stride 1 over D), caches [num_blocks,
// block_size, Hkv, D] contiguous, block_tables [B, W] int32, query_start_loc [B + 1] int32, seq_lens [B] int32.
// The caches share the query's dtype, or are bf16 / fp16 under an fp32 query (kv_cache_dtype: half the bytes read per
// token; rows widened to fp32 as they are read, written narrowed by reshape_and_cache).
// Request b's rows are written unless it is a prefill chunk (more than one row) over more than max_chunk_context
// tokens: those rows are left untouched and their number of chunks returned (the caller runs them); padding rows
// (a context of 0 tokens, or past the last request) are zeroed.
// Work is cut into tasks of one KV head's GQA group, handed to the threads costliest first; all run an online
// softmax in fp32 block by block, so K and V are read once per group:
// - a decode row: its G query heads; in batches of at least 8 decode rows a thread, the G heads of every KV head, so
//   each block's K and V rows are read whole rather than a third of each token's row a task. A block ahead is
//   prefetched into L2 a few lines at a time between the steps of the work on the current one (Trickle; past a
//   row's last block, the first blocks of the task its thread claimed next), and on AVX2 builds each block's rows
//   are first touched (a load a cache line, Batch::touch) so they come in at streaming speed, then scored; the
//   values pass loads each V vector once for up to 3 heads. On
//   AVX-512 or AVX2 with heads of 64 or 128, each token's scores are one vector of products per head, a vector's
//   worth of tokens summed at once (sum16, sum_lanes); bf16 caches on AVX512-BF16
//   multiply bf16 pairs (vdpbf16ps: exact products, fp32 sums) for the scores and for the values (V rows
//   interleaved by token pairs, probabilities rounded to bf16). Elsewhere a block's K rows are widened (ATen's
//   conversion, vec.h) and transposed, so scores, exp and the sum over V all run as float vectors.
// - a prefill tile: up to 3 vectors' lanes of query vectors (16 rows x 3 heads on AVX-512), scores as a small GEMM
//   over K rows as they lie (each K value broadcast against a vector of queries), the causal softmax down the lanes.
// The op's optional arguments (graphinfer/ops/attention.py) are handled here too: a sliding window starts the block
// loop at the block holding the first visible position (blocks wholly before it are never read) and hides the
// positions below each row's window in the blocks it crosses; a softcap caps each block's scores (c * tanh(s / c))
// before the softmax; sinks (fp32, one per query head) join each row's final denominator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using cpu_vec::fVec;
using cpu_vec::kVec;
constexpr int64_t kHeads = 4;   // query heads whose scores one pass over K^T accumulates (independent FMA chains)
constexpr int64_t kChains = 4;  // vectors of a head's output accumulated together (independent FMA chains)

// A block's K and V rows prefetched into L2 a few cache lines at a time, between the steps of the work on another
// block (decode_row's scores and values call step()): a burst of a block's 768 prefetches stalled the core once the
// fill buffers were full, the work waiting behind them (perf on the AMX VM: half of decode_row's samples on
// prefetcht1).
struct Trickle {
  const char* side[2] = {nullptr, nullptr};  // the block's first row in K and in V
  int64_t stride = 0, row_bytes = 0, rows = 0, per = 0;  // per: lines a step
  int64_t s = 2, r = 0, off = 0;  // the next line: side s (2: none left), row r, byte off
  void start(const char* k, const char* v, int64_t stride_, int64_t row_bytes_, int64_t rows_, int64_t steps) {
    side[0] = k, side[1] = v, stride = stride_, row_bytes = row_bytes_, rows = rows_;
    per = (2 * rows * ((row_bytes + 63) / 64) + steps - 1) / std::max<int64_t>(steps, 1);
    s = 0, r = 0, off = 0;
  }
  void step(int64_t lines) {
    for (; lines > 0 && s < 2; --lines) {
      __builtin_prefetch(side[s] + r * stride + off, 0, 2);
      if ((off += 64) >= row_bytes) {
        off = 0;
        if (++r == rows) r = 0, ++s;
      }
    }
  }
  void step() { step(per); }
  void finish() { step(std::numeric_limits<int64_t>::max()); }
};

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

// Decode scores without transposing K (AVX-512 or AVX2, heads of 64 or 128): per token and head one vector of
// products (vdpbf16ps over bf16 pairs for bf16 caches), a vector's worth of tokens then summed at once by a
// transposing reduction (sum16 on AVX-512, 16 tokens; sum_lanes below).
#if defined(CPU_CAPABILITY_AVX512)

inline __mmask16 mask16(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1; }

// r[i] = the sum of v[i]'s 16 lanes: a transposing reduction, 45 instructions for 16 sums.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // lane-local pairs: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: the lane's sums of 4 vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes added in pairs
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#if defined(__AVX512BF16__)
// bf16: qp [nh, D2] the heads as bf16 pairs, unscaled; Chunks = D / 32.
template <int Chunks>
inline void row_scores_bf16(const uint32_t* qp, int64_t D2, int64_t nh, const at::BFloat16* k, int64_t ld, int64_t n,
                            float scale, float* out, int64_t out_stride, Trickle& tr) {
  for (int64_t g = 0; g < nh; ++g) {
    tr.step();
    __m512bh qv[Chunks];
    __m512 part[16];
    for (int c = 0; c < Chunks; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qp + g * D2 + 16 * c);
    for (int t = 0; t < 16; ++t) {
      const at::BFloat16* kr = k + std::min<int64_t>(t, n - 1) * ld;
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < Chunks; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
      part[t] = a;
    }
    _mm512_storeu_ps(out + g * out_stride, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
  }
}

// bf16 values by token pairs: two V rows interleaved (vpunpck{l,h}wd) are multiplied with a pair of probabilities
// rounded to bf16 (as ATen's flash attention rounds them before its bf16 GEMM) and summed into fp32 lanes by
// vdpbf16ps. acc holds NH heads' sums, [NH, acc_stride], 2 * Chunks vectors each (Chunks = D / 32), lanes in the
// interleaved order (pair_lane); pp the heads' probabilities as bf16 pairs, [NH, ld_pp].
template <int Chunks, int NH>
inline void pair_values_bf16(const uint32_t* pp, int64_t ld_pp, const at::BFloat16* v, int64_t ld, int64_t n,
                             float* acc, int64_t acc_stride, Trickle& tr) {
  __m512 a[NH][2 * Chunks];
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < 2 * Chunks; ++c) a[g][c] = _mm512_loadu_ps(acc + g * acc_stride + 16 * c);
  for (int64_t t = 0; t < n; t += 2) {
    if (t % 8 == 0) tr.step();
    const at::BFloat16* r0 = v + t * ld;
    const at::BFloat16* r1 = t + 1 < n ? r0 + ld : r0;  // an odd last row pairs with itself, at probability 0
    __m512i lo[Chunks], hi[Chunks];
    for (int c = 0; c < Chunks; ++c) {
      const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(x0, x1);
      hi[c] = _mm512_unpackhi_epi16(x0, x1);
    }
    for (int g = 0; g < NH; ++g) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * ld_pp + t / 2]));
      for (int c = 0; c < Chunks; ++c) {
        a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], (__m512bh)lo[c], p);
        a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], (__m512bh)hi[c], p);
      }
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < 2 * Chunks; ++c) _mm512_storeu_ps(acc + g * acc_stride + 16 * c, a[g][c]);
}

// Where pair_values_bf16 keeps element d of a head's sums: per 32 d, vector 2c holds lanes 0-3 of each 8-d group
// (d = 8L + i, i < 4, at lane 4L + i), vector 2c + 1 the other four.
inline int64_t pair_lane(int64_t d) {
  const int64_t c = d / 32, L = d % 32 / 8, i = d % 8;
  return (2 * c + (i >= 4)) * 16 + 4 * L + i % 4;
}

// A block's scores of G heads (qp [G, D / 2] as bf16 pairs) over its n rows k (ld apart), D = 64 or 128 -> s [G, bsp].
inline void bf16_row_scores(const uint32_t* qp, int64_t D, int64_t G, const at::BFloat16* k, int64_t ld, int64_t n,
                            float scale, float* s, int64_t bsp, Trickle& tr) {
  for (int64_t t = 0; t < n; t += 16) {
    if (D == 64) row_scores_bf16<2>(qp, D / 2, G, k + t * ld, ld, n - t, scale, s + t, bsp, tr);
    else row_scores_bf16<4>(qp, D / 2, G, k + t * ld, ld, n - t, scale, s + t, bsp, tr);
  }
}

// acc [G, Dp] (pair_lane order) += the block's values v (n rows, ld apart) weighted by the probabilities s [G, bsp],
// D = 64 or 128; pp: scratch for the probabilities as bf16 pairs, [G * bsp / 2 + 16].
template <int Chunks>
inline void bf16_pair_values_d(const uint32_t* pp, int64_t ld_pp, int64_t G, const at::BFloat16* v, int64_t ld,
                               int64_t n, float* acc, int64_t Dp, Trickle& tr) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t nh = std::min<int64_t>(4, G - g0);
    const uint32_t* p = pp + g0 * ld_pp;
    float* a = acc + g0 * Dp;
    if (nh == 4) pair_values_bf16<Chunks, 4>(p, ld_pp, v, ld, n, a, Dp, tr);
    else if (nh == 3) pair_values_bf16<Chunks, 3>(p, ld_pp, v, ld, n, a, Dp, tr);
    else if (nh == 2) pair_values_bf16<Chunks, 2>(p, ld_pp, v, ld, n, a, Dp, tr);
    else pair_values_bf16<Chunks, 1>(p, ld_pp, v, ld, n, a, Dp, tr);
  }
}
inline void bf16_pair_values(const float* s, int64_t bsp, int64_t G, const at::BFloat16* v, int64_t ld, int64_t n,
                             int64_t D, uint32_t* pp, float* acc, int64_t Dp, Trickle& tr) {
  for (int64_t g = 0; g < G; ++g) {  // past n, s is stale: zeros from the masked loads (a head's 16 pairs may spill
    for (int64_t t = 0; t < n; t += 32) {  // into the next head's, which is written after it)
      const __m512 p0 = _mm512_maskz_loadu_ps(mask16(n - t), s + g * bsp + t);
      const __m512 p1 = _mm512_maskz_loadu_ps(mask16(n - t - 16), s + g * bsp + t + 16);
      _mm512_storeu_si512(pp + g * bsp / 2 + t / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
  }
  if (D == 64) bf16_pair_values_d<2>(pp, bsp / 2, G, v, ld, n, acc, Dp, tr);
  else bf16_pair_values_d<4>(pp, bsp / 2, G, v, ld, n, acc, Dp, tr);
}
#endif
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kRowScores = true;
#if defined(CPU_CAPABILITY_AVX512)
using RawVec = __m512;
inline __m512 sum_lanes(const __m512* v) { return sum16(v); }
#else
using RawVec = __m256;
// r[i] = the sum of v[i]'s 8 lanes: three rounds of pairwise adds (hadd), the 128-bit halves added last.
inline __m256 sum_lanes(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 | v0..v3], [v4..v7 | v4..v7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
// nh heads' scores of the kVec tokens from k (rows ld apart; those past n repeat row n - 1) to out + g * out_stride.
// fp32: q [nh, Dp] pre-scaled, Chunks = D / kVec: per token and head one vector of products, then sum_lanes.
template <int Chunks>
inline void row_scores(const float* q, int64_t Dp, int64_t nh, const float* k, int64_t ld, int64_t n, float* out,
                       int64_t out_stride) {
  for (int64_t g = 0; g < nh; ++g) {
    fVec qv[Chunks];
    RawVec part[kVec];
    for (int c = 0; c < Chunks; ++c) qv[c] = fVec::loadu(q + g * Dp + kVec * c);
    for (int t = 0; t < kVec; ++t) {
      const float* kr = k + std::min<int64_t>(t, n - 1) * ld;
      fVec a = qv[0] * fVec::loadu(kr);
      for (int c = 1; c < Chunks; ++c) a = at::vec::fmadd(qv[c], fVec::loadu(kr + kVec * c), a);
      part[t] = a;
    }
    fVec(sum_lanes(part)).store(out + g * out_stride);
  }
}
#else
constexpr bool kRowScores = false;
template <int Chunks>
inline void row_scores(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t) {}
#endif
#if !defined(CPU_CAPABILITY_AVX512) || !defined(__AVX512BF16__)
inline int64_t pair_lane(int64_t d) { return d; }
inline void bf16_row_scores(const uint32_t*, int64_t, int64_t, const at::BFloat16*, int64_t, int64_t, float, float*,
                            int64_t, Trickle&) {}
inline void bf16_pair_values(const float*, int64_t, int64_t, const at::BFloat16*, int64_t, int64_t, int64_t,
                             uint32_t*, float*, int64_t, Trickle&) {}
#endif

// Prefill tiles: a tile's query vectors (rows x heads) sit in the lanes of kTileCols vectors ("columns"), so its
// scores are a small GEMM: each K value broadcast against a column of queries, with K rows read as they lie in the cache
// (no transpose), and the softmax runs down the columns, kVec query vectors at a time.
// Register blocking for the vector registers there are (AVX-512 32, AVX2 16): tile_scores keeps kTileTokens x
// kTileCols accumulators, the columns and a broadcast; tile_values kPvVecs x kChains accumulators, kChains V vectors
// and a broadcast. 8 x 3 and 4 x 4 spill on AVX2 (tools/cpu_attention_bench.py, 162-token prefill: 0.57 ms a layer
// at 7312d77, 0.47 with 4 x 3 and 3 x 4; docs/bench/cpu_attention_2026-11-28_*_avx2_graphinfer.json).
constexpr int64_t kTileCols = 3;                    // query columns a tile holds (kTileCols * kVec query vectors)
constexpr int64_t kTileTokens = kVec >= 16 ? 8 : 4;  // tokens per pass of tile_scores
constexpr int64_t kPvVecs = kVec >= 16 ? 4 : 3;      // query vectors per pass of tile_values

// sT[t][c * kVec + i] = q_(c, i) . k_t for the kTileTokens tokens from t0 (those past n not stored): qT [D][ldq] holds
// the queries transposed and scaled, k the block's rows (ldk apart; a row past n reads the last one).
template <int Cols>
inline void tile_scores(const float* qT, int64_t ldq, int64_t D, const float* k, int64_t ldk, int64_t n, int64_t t0,
                        float* sT, int64_t lds) {
  fVec acc[kTileTokens][Cols];
  const float* kr[kTileTokens];
  for (int64_t tt = 0; tt < kTileTokens; ++tt) {
    kr[tt] = k + std::min(t0 + tt, n - 1) * ldk;
    for (int c = 0; c < Cols; ++c) acc[tt][c] = fVec(0.f);
  }
  for (int64_t d = 0; d < D; ++d) {
    fVec qc[Cols];
    for (int c = 0; c < Cols; ++c) qc[c] = fVec::loadu(qT + d * ldq + c * kVec);
    for (int64_t tt = 0; tt < kTileTokens; ++tt) {
      const fVec kb(kr[tt][d]);
      for (int c = 0; c < Cols; ++c) acc[tt][c] = at::vec::fmadd(kb, qc[c], acc[tt][c]);
    }
  }
  for (int64_t tt = 0; tt < kTileTokens && t0 + tt < n; ++tt)
    for (int c = 0; c < Cols; ++c) acc[tt][c].store(sT + (t0 + tt) * lds + c * kVec);
}

// O[v0 + i][d0, d0 + kChains * kVec) = O[..] * corr[v0 + i] + sum_t<n pT[t][v0 + i] * V[t][same], for Vecs query
// vectors: the online softmax's rescale of the old sums rides on their load (no pass of its own over O).
template <int Vecs>
inline void tile_values(const float* pT, int64_t ldp, int64_t v0, const float* corr, const float* V, int64_t ldv,
                        int64_t n, float* O, int64_t ldo, int64_t d0, int64_t nc) {
  fVec a[Vecs][kChains];
  for (int i = 0; i < Vecs; ++i) {
    const fVec ci(corr[v0 + i]);
    for (int64_t c = 0; c < kChains; ++c) a[i][c] = fVec::loadu(O + (v0 + i) * ldo + d0 + c * kVec) * ci;
  }
  for (int64_t t = 0; t < n; ++t) {
    fVec vr[kChains];
    for (int64_t c = 0; c < kChains; ++c) vr[c] = fVec::loadu(V + t * ldv + d0 + c * kVec);
    for (int i = 0; i < Vecs; ++i) {
      const fVec pv(pT[t * ldp + v0 + i]);
      for (int64_t c = 0; c < kChains; ++c) a[i][c] = at::vec::fmadd(pv, vr[c], a[i][c]);
    }
  }
  for (int i = 0; i < Vecs; ++i)
    for (int64_t c = 0; c < nc; ++c) a[i][c].store(O + (v0 + i) * ldo + d0 + c * kVec);
}

// Gemma 2's soft-capping of n scores, c * tanh(s / c), whole vectors (s is padded to them; lanes past n are never
// read); then the first `hidden` scores -inf (positions below a sliding window).
inline void cap_and_hide(float* s, int64_t n, float softcap, int64_t hidden) {
  if (softcap > 0.f) {
    const fVec c(softcap), inv(1.f / softcap);
    for (int64_t t = 0; t < n; t += kVec) ((fVec::loadu(s + t) * inv).tanh() * c).store(s + t);
  }
  std::fill_n(s, hidden, -std::numeric_limits<float>::infinity());
}

// acc[g] (NG heads, Dp apart) += sum_t<n p[g * ld_p + t] v[t], Dp a whole number of kChains vectors: each
// V vector loaded once for the NG heads, their NG x kChains sums in registers (3 x 4 and the V row fit AVX2's 16).
template <int NG>
inline void head_values(const float* p, int64_t ld_p, const float* v, int64_t ldv, int64_t n, float* acc,
                        int64_t Dp) {
  for (int64_t d0 = 0; d0 < Dp; d0 += kChains * kVec) {
    fVec a[NG][kChains];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < kChains; ++c) a[g][c] = fVec::loadu(acc + g * Dp + d0 + c * kVec);
    for (int64_t t = 0; t < n; ++t) {
      fVec vv[kChains];
      for (int c = 0; c < kChains; ++c) vv[c] = fVec::loadu(v + t * ldv + d0 + c * kVec);
      for (int g = 0; g < NG; ++g) {
        const fVec pg(p[g * ld_p + t]);
        for (int c = 0; c < kChains; ++c) a[g][c] = at::vec::fmadd(pg, vv[c], a[g][c]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < kChains; ++c) a[g][c].store(acc + g * Dp + d0 + c * kVec);
  }
}

// A task: `rows` consecutive query rows of request b, from row `row0` of its chunk, with the G query heads of KV head
// h (of the nh KV heads from h, for a decode row). A decode row (rows = 1) runs as G query vectors per KV head, block
// by block; prefill chunks are cut into tiles of as many rows as kTileCols columns hold, so each K and V block is
// read once per tile, not once per row.
struct Task {
  int64_t b, h, row0, rows, cost, nh = 1;
  int64_t j0 = 0, j1 = 0, part = -1;  // a decode row's blocks [j0, j1) (j1 0: all); part >= 0: its slot's offset
};

// A decode task's blocks [j0, j1) of request b, KV heads h..h+nh (b < 0: none): the one a thread claimed next, whose
// first blocks decode_row prefetches as it ends the current one.
struct Blocks {
  int64_t b = -1, h = 0, nh = 0, j0 = 0, j1 = 0;
};

// How many blocks ahead decode_row prefetches (trickled over the current block's work), and whether it first touches
// each block's rows (Batch::touch). AVX-512 builds: the next block, no touch. Batch-64 decode,
// tools/cpu_attention_bench.py, env-switched builds alternating in the same minutes: the 2-vCPU AMX VM (2026-12-02)
// bf16 0.71-0.73 ms a layer, with the touch 0.99-1.13; the Zen 5 VM (2026-12-02) bf16 0.39 against 0.43-0.45 with
// the touch, fp32 0.76-0.78 against 0.79-0.87 (two blocks ahead without the touch: the same within the noise).
// AVX2 builds as measured on the Zen 3 VM before the trickle: the block after next, and the touch.
#if defined(__AVX512F__)
constexpr int64_t kAhead = 1;
constexpr bool kTouch = false;
#else
constexpr int64_t kAhead = 2;
constexpr bool kTouch = true;
#endif

// Decode rows split over the threads when a batch has fewer tasks than this many per thread (batch 1 has Hkv tasks:
// 3 for SmolLM2 on 2 threads left one thread idle half the call), each part at least kSplitBlocks blocks; the parts'
// running maxima, sums and unnormalised outputs merge after the parallel loop (as flash-decoding's split-KV does).
constexpr int64_t kSplitTasksPerThread = 2;
constexpr int64_t kSplitBlocks = 4;

// One call's inputs, shared read-only by the threads: query and out in scalar_t, the caches in cache_t (the same, or
// bf16 / fp16 caches of an fp32 model: kv_cache_dtype; their rows are widened to fp32 as they are read).
template <typename scalar_t, typename cache_t = scalar_t>
struct Batch {
  const scalar_t* q;
  const cache_t *k, *v;
  scalar_t* o;
  const int32_t *bt, *qsl, *lens;
  int64_t G, D, Dp, bs, bsp, Hkv, W, q_row, q_head, o_row, o_head;
  float scale;
  int64_t window;       // sliding window (0: none)
  float softcap;        // 0: none
  const float* sinks;   // [Hq] or nullptr
  bool direct;  // fp32 caches whose rows are whole passes of kChains vectors: K and V read straight from the cache
  bool pairs;   // bf16 query and caches on AVX512-BF16: decode scores from bf16 pairs (bf16_pair_scores), K never
                // widened

  int64_t tok() const { return Hkv * D; }  // cache stride between consecutive tokens of a block
  int64_t base(int64_t b, int64_t h, int64_t j) const {  // block j of request b, KV head h: its first row
    return (static_cast<int64_t>(bt[b * W + j]) * bs * Hkv + h) * D;
  }
  // block j's rows of KV heads h..h+nh (adjacent in each token's row): scattered blocks defeat the hardware
  // prefetcher. prefetch: into L1 at once (a prefill tile's next block); trickle: into L2 over the given number of
  // steps (decode_row's block ahead; prefetching into L1 evicted the block in use on the AVX2 VM)
  void prefetch(int64_t b, int64_t h, int64_t j, int64_t nh = 1) const {
    const int64_t at = base(b, h, j), row_bytes = nh * D * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t t = 0; t < bs; ++t) {
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + at + t * tok()) + byte, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(v + at + t * tok()) + byte, 0, 3);
      }
    }
  }
  void trickle(Trickle& tr, int64_t b, int64_t h, int64_t j, int64_t nh, int64_t steps) const {
    const int64_t at = base(b, h, j), bytes = static_cast<int64_t>(sizeof(cache_t));
    tr.start(reinterpret_cast<const char*>(k + at), reinterpret_cast<const char*>(v + at), tok() * bytes,
             nh * D * bytes, bs, steps);
  }
  // Block j's first n rows of KV heads h..h+nh, K then V, read a word a cache line before they are used: a tight
  // loop of loads keeps many misses in flight and starts the hardware prefetcher on each block (a random address),
  // where the work on the rows issues them too slowly and prefetching the next block ahead evicted the current one
  // from L1 (perf on the AVX2 VM's batch-64 decode). The xor of the words, for the sink.
  uint32_t touch(int64_t b, int64_t h, int64_t j, int64_t n, int64_t nh) const {
    const int64_t at = base(b, h, j), row_bytes = nh * D * static_cast<int64_t>(sizeof(cache_t));
    uint32_t r[4] = {};  // independent chains
    for (const cache_t* c : {k, v}) {
      for (int64_t t = 0; t < n; ++t) {
        const char* row = reinterpret_cast<const char*>(c + at + t * tok());
        for (int64_t byte = 0, i = 0; byte < row_bytes; byte += 64, ++i) {
          uint32_t word;
          std::memcpy(&word, row + byte, sizeof(word));
          r[i & 3] ^= word;
        }
      }
    }
    return r[0] ^ r[1] ^ r[2] ^ r[3];
  }
  // n rows of a block (K or V) as floats: in place (direct), or widened into buf [n, Dp]; ld: their stride
  const float* rows(const cache_t* src, int64_t n, float* buf, int64_t& ld) const {
    if (direct) {
      ld = tok();
      return reinterpret_cast<const float*>(src);
    }
    for (int64_t t = 0; t < n; ++t) widen(src + t * tok(), buf + t * Dp, D);
    ld = Dp;
    return buf;
  }
};

// G query heads rounded up to whole groups of kHeads (float_scores scores kHeads heads at a time).
inline int64_t padded_heads(int64_t G) { return (G + kHeads - 1) / kHeads * kHeads; }

// A thread's scratch, zero-padded to whole vectors: a block's K rows widened [bs, Dp] and V rows widened [bs, Dp]
// (+ kChains vectors); for decode rows K transposed [Dp, bsp], the G query heads (scaled; or as bf16 pairs) and their
// accumulators [Gp, Dp] and scores [Gp, bsp]; for tiles the queries transposed [Dp, Nt], scores [bsp, Nt],
// accumulators [Nt, Dp] (+ kChains vectors), and running maxima, sums, rescales, causal limits and window starts [Nt].
struct Scratch {
  std::vector<float> kf, vf, kt, q, acc, s, m, l, qT, sT, O, tm, tl, corr, lim, low;
  std::vector<uint32_t> qp, pp;  // decode: the heads as bf16 pairs; probabilities as bf16 pairs [Gp, bsp / 2]
  uint32_t sink = 0;  // the xor of the words decode_row touched (Batch::touch)
  Scratch(int64_t bs, int64_t bsp, int64_t Dp, int64_t Gp, int64_t Nt, int64_t D2, int64_t Hkv)
      : kf(bs * Dp), vf(bs * Dp + kChains * kVec, 0.f), kt(Dp * bsp, 0.f), q(Hkv * Gp * Dp, 0.f),
        acc(Hkv * Gp * Dp), s(Gp * bsp), m(Hkv * Gp), l(Hkv * Gp), qT(Dp * Nt, 0.f), sT(bsp * Nt),
        O(Nt * Dp + kChains * kVec, 0.f), tm(Nt), tl(Nt), corr(Nt), lim(Nt), low(Nt), qp(Hkv * Gp * D2, 0u),
        pp(Gp * bsp / 2 + 16, 0u) {}
};

// One row r (a decode's, position ctx - 1) of request b with the G query heads of each of the KV heads h0..h0+nh:
// online softmax over the ctx tokens, block by block. Several KV heads a task read each block's rows whole (they lie
// side by side in a token's row of the cache) rather than a third of every token's row per task.
// Blocks [j0, j1) only where j1 > 0; with part (a split): that part's maxima, sums and unnormalised outputs
// [nh * G][2 + Dp] go there instead of the output (merge_parts finishes them).
template <typename scalar_t, typename cache_t>
__attribute__((flatten)) void decode_row(const Batch<scalar_t, cache_t>& x, Scratch& w, int64_t b, int64_t h0,
                                         int64_t nh, int64_t r, int64_t ctx, int64_t j0 = 0, int64_t j1 = 0,
                                         float* part = nullptr, const Blocks& next = {}) {
  const int64_t G = x.G, D = x.D, Dp = x.Dp, bs = x.bs, bsp = x.bsp, D2 = D / 2;
  const int64_t Gp = padded_heads(G);  // a KV head's share of the scratch's per-head arrays
  const bool bf16_rows = x.pairs && (D == 64 || D == 128);  // bf16 scores and values row by row (AVX-512)
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qg = x.q + r * x.q_row + ((h0 + hh) * G + g) * x.q_head;
      const int64_t i = hh * Gp + g;
      if (x.pairs) {
        std::memcpy(w.qp.data() + i * D2, qg, D * sizeof(scalar_t));
      } else {
        widen(qg, w.q.data() + i * Dp, D);
        for (int64_t d = 0; d < Dp; ++d) w.q[i * Dp + d] *= x.scale;
      }
    }
  }
  float* s = w.s.data();
  std::fill_n(w.acc.begin(), nh * Gp * Dp, 0.f);
  std::fill_n(w.m.begin(), nh * Gp, -std::numeric_limits<float>::infinity());
  std::fill_n(w.l.begin(), nh * Gp, 0.f);
  const int64_t lo = x.window > 0 ? std::max<int64_t>(ctx - x.window, 0) : 0;  // the first visible position
  const int64_t j_end = j1 > 0 ? j1 : (ctx + bs - 1) / bs;
  for (int64_t j = std::max(lo / bs, j0); j < j_end; ++j) {
    const int64_t n = std::min(bs, ctx - j * bs);
    if (kTouch) w.sink ^= x.touch(b, h0, j, n, nh);
    Trickle tr;  // the block kAhead on (past the row's last, the next task's), over the steps of this one's work
    const int64_t steps = nh * (bf16_rows ? G * ((n + 15) / 16) + (n + 7) / 8 : (n + kVec - 1) / kVec + 1);
    if (j + kAhead < j_end) x.trickle(tr, b, h0, j + kAhead, nh, steps);
    else if (next.b >= 0 && next.j0 + j + kAhead - j_end < next.j1)
      x.trickle(tr, next.b, next.h, next.j0 + j + kAhead - j_end, next.nh, steps);
    for (int64_t hh = 0; hh < nh; ++hh) {
      if (!bf16_rows) tr.step();
      const int64_t base = x.base(b, h0 + hh, j);
      const float* q = w.q.data() + hh * Gp * Dp;
      const uint32_t* qp = w.qp.data() + hh * Gp * D2;
      float* acc = w.acc.data() + hh * Gp * Dp;
      float* m = w.m.data() + hh * Gp;
      float* l = w.l.data() + hh * Gp;
      // Scores of the block's n tokens, [Gp, bsp]: row by row (AVX-512, heads of 64 or 128), else from K transposed.
      if (bf16_rows) {
        bf16_row_scores(qp, D, G, reinterpret_cast<const at::BFloat16*>(x.k + base), x.tok(), n, x.scale, s, bsp, tr);
      } else if (x.pairs) {  // 32-bit lanes moved, not converted: transpose_mxn only shuffles
        at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(x.k + base), x.tok() / 2, w.kt.data(), bsp,
                                      static_cast<int>(n), static_cast<int>(D2));
        const uint32_t* kt32 = reinterpret_cast<const uint32_t*>(w.kt.data());
        for (int64_t g0 = 0; g0 < G; g0 += kHeads)
          for (int64_t t = 0; t < n; t += kVec)
            bf16_pair_scores(qp + g0 * D2, D2, kt32, bsp, t, x.scale, s + g0 * bsp + t, bsp);
      } else {
        int64_t ld;
        const float* kr = x.rows(x.k + base, n, w.kf.data(), ld);
        if (kRowScores && (D == 64 || D == 128)) {
          for (int64_t t = 0; t < n; t += kVec) {
            tr.step();
            if (D == 64) row_scores<64 / kVec>(q, Dp, G, kr + t * ld, ld, n - t, s + t, bsp);
            else row_scores<128 / kVec>(q, Dp, G, kr + t * ld, ld, n - t, s + t, bsp);
          }
        } else {
          at::vec::transpose_mxn<float>(kr, ld, w.kt.data(), bsp, static_cast<int>(n), static_cast<int>(Dp));
          for (int64_t g0 = 0; g0 < G; g0 += kHeads)
            for (int64_t t = 0; t < n; t += kVec)
              float_scores(q + g0 * Dp, Dp, w.kt.data(), bsp, t, s + g0 * bsp + t, bsp);
        }
      }
      if (x.softcap > 0.f || j * bs < lo)
        for (int64_t g = 0; g < G; ++g) cap_and_hide(s + g * bsp, n, x.softcap, std::max<int64_t>(lo - j * bs, 0));
      for (int64_t g = 0; g < G; ++g) {
        // online softmax: probabilities against the new running maximum, the old sums rescaled to it; max and sum
        // over whole vectors of tokens as vectors (a scalar chain over a block cost as much as its scores)
        float* sg = s + g * bsp;
        const int64_t nv = n / kVec * kVec;
        fVec vmax(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < nv; t += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(sg + t));
        float mx = std::max(m[g], cpu_vec::reduce_max(vmax));
        for (int64_t t = nv; t < n; ++t) mx = std::max(mx, sg[t]);
        const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first block
        fVec vsum(0.f);
        for (int64_t t = 0; t < n; t += kVec) {
          const fVec p = (fVec::loadu(sg + t) - fVec(mx)).exp();
          p.store(sg + t);
          if (t < nv) vsum = vsum + p;
        }
        float sum = cpu_vec::reduce_sum(vsum);
        for (int64_t t = nv; t < n; ++t) sum += sg[t];
        l[g] = l[g] * corr + sum;
        m[g] = mx;
        float* ag = acc + g * Dp;
        for (int64_t d = 0; d < Dp; d += kVec) (fVec::loadu(ag + d) * fVec(corr)).store(ag + d);
      }
      if (bf16_rows) {  // values by token pairs
        bf16_pair_values(s, bsp, G, reinterpret_cast<const at::BFloat16*>(x.v + base), x.tok(), n, D, w.pp.data(),
                         acc, Dp, tr);
        continue;
      }
      // Values: acc_g += sum_t p_g[t] v[t], kChains vectors of a head's accumulator at a time kept in registers
      // (independent FMA chains; intrinsic stores may alias anything, so memory-resident sums reload every step)
      int64_t vld;
      const float* vr = x.rows(x.v + base, n, w.vf.data(), vld);
      if (Dp % (kChains * kVec) == 0) {  // whole passes of kChains vectors: each V vector loaded once per 3 heads
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
          const int64_t ng = std::min<int64_t>(3, G - g0);
          if (ng == 3) head_values<3>(s + g0 * bsp, bsp, vr, vld, n, acc + g0 * Dp, Dp);
          else if (ng == 2) head_values<2>(s + g0 * bsp, bsp, vr, vld, n, acc + g0 * Dp, Dp);
          else head_values<1>(s + g0 * bsp, bsp, vr, vld, n, acc + g0 * Dp, Dp);
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = s + g * bsp;
        float* ag = acc + g * Dp;
        for (int64_t d0 = 0; d0 < Dp; d0 += kChains * kVec) {
          const int64_t nc = std::min(kChains, (Dp - d0) / kVec);  // past nc: vf's padding, never stored
          fVec a[kChains] = {};
          for (int64_t c = 0; c < nc; ++c) a[c] = fVec::loadu(ag + d0 + c * kVec);
          for (int64_t t = 0; t < n; ++t) {
            const fVec p(pg[t]);
            const float* vt = vr + t * vld + d0;
            for (int64_t c = 0; c < kChains; ++c) a[c] = at::vec::fmadd(p, fVec::loadu(vt + c * kVec), a[c]);
          }
          for (int64_t c = 0; c < nc; ++c) a[c].store(ag + d0 + c * kVec);
        }
      }
    }
    tr.finish();
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = hh * Gp + g;
      if (part) {
        float* slot = part + (hh * G + g) * (2 + Dp);
        slot[0] = w.m[i];
        slot[1] = w.l[i];
        std::copy_n(w.acc.data() + i * Dp, Dp, slot + 2);
        continue;
      }
      scalar_t* dst = x.o + r * x.o_row + ((h0 + hh) * G + g) * x.o_head;
      const float sink = x.sinks ? std::exp(x.sinks[(h0 + hh) * G + g] - w.m[i]) : 0.f;  // a term with no value
      const float inv = 1.f / (w.l[i] + sink);
      for (int64_t d = 0; d < D; ++d)
        dst[d] = static_cast<scalar_t>(w.acc[i * Dp + (bf16_rows ? pair_lane(d) : d)] * inv);
    }
  }
}

// A split decode row's parts (decode_row's part slots, `parts` of them, `stride` floats apart) merged into its output:
// the heads of KV heads h0..h0+nh of row r.
template <typename scalar_t, typename cache_t>
void merge_parts(const Batch<scalar_t, cache_t>& x, const float* part, int64_t parts, int64_t stride, int64_t h0,
                 int64_t nh, int64_t r) {
  const int64_t G = x.G, D = x.D, Dp = x.Dp;
  const bool bf16_rows = x.pairs && (D == 64 || D == 128);  // as decode_row: its accumulators' lanes in pair order
  std::vector<float> acc(Dp);
  for (int64_t i = 0; i < nh * G; ++i) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, part[p * stride + i * (2 + Dp)]);
    float l = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* slot = part + p * stride + i * (2 + Dp);
      if (slot[1] == 0.f) continue;  // a part with no visible token (before a sliding window)
      const float c = std::exp(slot[0] - mx);
      l += slot[1] * c;
      for (int64_t d = 0; d < Dp; ++d) acc[d] += slot[2 + d] * c;
    }
    const int64_t hq = h0 * G + i;  // the query head
    const float sink = x.sinks ? std::exp(x.sinks[hq] - mx) : 0.f;
    const float inv = 1.f / (l + sink);
    scalar_t* dst = x.o + r * x.o_row + hq * x.o_head;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[bf16_rows ? pair_lane(d) : d] * inv);
  }
}

// A prefill tile: `rows` rows of request b from query row r0 (position pos0 on) with the G query heads of KV head h;
// query vector v = row * G + head sits in lane v of the tile's columns.
template <typename scalar_t, typename cache_t>
void prefill_tile(const Batch<scalar_t, cache_t>& x, Scratch& w, int64_t b, int64_t h, int64_t r0, int64_t rows,
                  int64_t pos0) {
  const int64_t G = x.G, D = x.D, Dp = x.Dp, bs = x.bs;
  const int64_t Nq = rows * G, cols = (Nq + kVec - 1) / kVec, Nc = cols * kVec, ctx = pos0 + rows;
  float* qT = w.qT.data();
  float* sT = w.sT.data();
  float* O = w.O.data();
  std::fill(w.qT.begin(), w.qT.end(), 0.f);
  for (int64_t v = 0; v < Nq; ++v) {
    const scalar_t* qv = x.q + (r0 + v / G) * x.q_row + (h * G + v % G) * x.q_head;
    for (int64_t d = 0; d < D; ++d) qT[d * Nc + v] = static_cast<float>(qv[d]) * x.scale;
  }
  const bool window = x.window > 0;
  for (int64_t v = 0; v < Nc; ++v) {  // padding lanes see every token (scores 0)
    w.lim[v] = static_cast<float>(v < Nq ? pos0 + v / G + 1 : ctx);
    w.low[v] = static_cast<float>(window && v < Nq ? pos0 + v / G - x.window + 1 : 0);
  }
  std::fill(w.O.begin(), w.O.end(), 0.f);
  // running maxima start finite: a lane whose window starts past a block sees none of it, and -inf - -inf is nan
  std::fill(w.tm.begin(), w.tm.end(), std::numeric_limits<float>::lowest());
  std::fill(w.tl.begin(), w.tl.end(), 0.f);
  const fVec neg_inf(-std::numeric_limits<float>::infinity());
  const int64_t lo = window ? std::max<int64_t>(pos0 - x.window + 1, 0) : 0;  // the first row's first visible position
  for (int64_t j = lo / bs; j * bs < ctx; ++j) {
    const int64_t n = std::min(bs, ctx - j * bs), base = x.base(b, h, j);
    if ((j + 1) * bs < ctx) x.prefetch(b, h, j + 1);
    int64_t kld;
    const float* kr = x.rows(x.k + base, n, w.kf.data(), kld);
    for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
      const int64_t nc = std::min(kTileCols, cols - c0);
      for (int64_t t0 = 0; t0 < n; t0 += kTileTokens) {
        if (nc == 3) tile_scores<3>(qT + c0 * kVec, Nc, D, kr, kld, n, t0, sT + c0 * kVec, Nc);
        else if (nc == 2) tile_scores<2>(qT + c0 * kVec, Nc, D, kr, kld, n, t0, sT + c0 * kVec, Nc);
        else tile_scores<1>(qT + c0 * kVec, Nc, D, kr, kld, n, t0, sT + c0 * kVec, Nc);
      }
    }
    if (x.softcap > 0.f)
      for (int64_t t = 0; t < n; ++t) cap_and_hide(sT + t * Nc, Nc, x.softcap, 0);
    // causal online softmax down each column: token t of the block counts for lanes whose limit exceeds j*bs + t
    // (and, under a sliding window, whose window start does not)
    for (int64_t c = 0; c < Nc; c += kVec) {
      const fVec limit = fVec::loadu(w.lim.data() + c) - fVec(static_cast<float>(j * bs));
      const fVec start = fVec::loadu(w.low.data() + c) - fVec(static_cast<float>(j * bs));
      fVec mx = neg_inf;
      for (int64_t t = 0; t < n; ++t) {
        const fVec tv(static_cast<float>(t));
        const fVec hide = window ? (tv >= limit) | (tv < start) : tv >= limit;
        const fVec sv = fVec::blendv(fVec::loadu(sT + t * Nc + c), neg_inf, hide);
        sv.store(sT + t * Nc + c);
        mx = at::vec::maximum(mx, sv);
      }
      const fVec old = fVec::loadu(w.tm.data() + c), mnew = at::vec::maximum(old, mx);
      fVec sum(0.f);
      for (int64_t t = 0; t < n; ++t) {
        const fVec pv = (fVec::loadu(sT + t * Nc + c) - mnew).exp();
        pv.store(sT + t * Nc + c);
        sum = sum + pv;
      }
      const fVec corr = (old - mnew).exp();  // 0 on the first block a lane sees
      (fVec::loadu(w.tl.data() + c) * corr + sum).store(w.tl.data() + c);
      mnew.store(w.tm.data() + c);
      corr.store(w.corr.data() + c);
    }
    int64_t vld;
    const float* vr = x.rows(x.v + base, n, w.vf.data(), vld);
    for (int64_t v0 = 0; v0 < Nq; v0 += kPvVecs) {
      for (int64_t d0 = 0; d0 < Dp; d0 += kChains * kVec) {
        const int64_t nc = std::min(kChains, (Dp - d0) / kVec), left = Nq - v0;
        if (left >= kPvVecs) tile_values<kPvVecs>(sT, Nc, v0, w.corr.data(), vr, vld, n, O, Dp, d0, nc);
        else if (left == 1) tile_values<1>(sT, Nc, v0, w.corr.data(), vr, vld, n, O, Dp, d0, nc);
        else if (left == 2) tile_values<2>(sT, Nc, v0, w.corr.data(), vr, vld, n, O, Dp, d0, nc);
        else tile_values<3>(sT, Nc, v0, w.corr.data(), vr, vld, n, O, Dp, d0, nc);
      }
    }
  }
  for (int64_t v = 0; v < Nq; ++v) {
    scalar_t* dst = x.o + (r0 + v / G) * x.o_row + (h * G + v % G) * x.o_head;
    const float sink = x.sinks ? std::exp(x.sinks[h * G + v % G] - w.tm[v]) : 0.f;  // a term with no value
    const float inv = 1.f / (w.tl[v] + sink);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(O[v * Dp + d] * inv);
  }
}

template <typename scalar_t, typename cache_t = scalar_t>
int64_t attend(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
            double scale, int64_t max_chunk_context, int64_t sliding_window, double softcap, const float* sinks) {
  const int64_t B = seq_lens.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = key_cache.size(1), Hkv = key_cache.size(2), G = Hq / Hkv;
  const int64_t Dp = (D + kVec - 1) / kVec * kVec, bsp = (bs + kVec - 1) / kVec * kVec;
  const Batch<scalar_t, cache_t> x{
      query.data_ptr<scalar_t>(), key_cache.data_ptr<cache_t>(), value_cache.data_ptr<cache_t>(),
      out.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      seq_lens.data_ptr<int32_t>(), G, D, Dp, bs, bsp, Hkv, block_tables.size(1), query.stride(0), query.stride(1),
      out.stride(0), out.stride(1), static_cast<float>(scale), sliding_window, static_cast<float>(softcap), sinks,
      std::is_same_v<cache_t, float> && D % (kChains * kVec) == 0,
      kBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16> && D % 2 == 0};
  // a prefill tile: R rows, R * G query vectors in Nt lanes (whole columns)
  const int64_t R = std::max<int64_t>(1, kTileCols * kVec / G), Nt = (R * G + kVec - 1) / kVec * kVec;
  std::vector<Task> tasks;
  std::vector<std::pair<int64_t, int64_t>> zero_rows{{B ? x.qsl[B] : 0, query.size(0)}};  // [begin, end): padding
  int64_t left = 0;  // prefill chunks over more than max_chunk_context tokens: the caller's
  // decode rows take all KV heads a task (each block read whole) where there are enough rows to share out
  int64_t decode_rows = 0;
  for (int64_t b = 0; b < B; ++b) decode_rows += x.qsl[b + 1] - x.qsl[b] == 1;
  const bool group_heads = decode_rows >= 8 * at::get_num_threads();
  // positions a task's rows attend over (its last row's context; under a window, at most the window and the rows)
  auto span = [&](int64_t ctx, int64_t rows) {
    return sliding_window > 0 ? std::min(ctx, sliding_window + rows - 1) : ctx;
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = x.qsl[b + 1] - x.qsl[b], L = x.lens[b];
    if (n > 0 && L <= 0) zero_rows.push_back({x.qsl[b], x.qsl[b + 1]});
    left += n > 1 && L > max_chunk_context;
    if (n <= 0 || L <= 0 || (n > 1 && L > max_chunk_context)) continue;
    TORCH_CHECK(n <= L, "request ", b, " has ", n, " query rows but a context of ", L, " tokens");
    for (int64_t row0 = 0; row0 < n; row0 += R) {
      const int64_t rows = std::min(R, n - row0);
      const int64_t cost = rows * span(L - n + row0 + rows, rows);
      if (rows == 1 && group_heads) tasks.push_back({b, 0, row0, 1, Hkv * cost, Hkv});
      else for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, row0, rows, cost});
    }
  }
  // too few tasks to keep the threads busy (a small decode batch): each decode row's blocks cut into parts
  const int64_t threads = at::get_num_threads();
  std::vector<float> parts;  // the parts' slots, each [nh * G][2 + Dp]
  struct Split { int64_t first, parts, stride, h0, nh, r; };
  std::vector<Split> splits;
  if (threads > 1 && static_cast<int64_t>(tasks.size()) < kSplitTasksPerThread * threads) {
    const int64_t want = (kSplitTasksPerThread * threads + static_cast<int64_t>(tasks.size()) - 1) /
                         std::max<int64_t>(1, static_cast<int64_t>(tasks.size()));
    std::vector<Task> cut;
    int64_t used = 0;
    for (const Task& t : tasks) {
      const int64_t L = x.lens[t.b], lo = sliding_window > 0 ? std::max<int64_t>(L - sliding_window, 0) : 0;
      const int64_t jb = lo / bs, je = (L + bs - 1) / bs;
      const int64_t n_parts = std::min(want, (je - jb) / kSplitBlocks);
      if (t.rows != 1 || n_parts < 2) {
        cut.push_back(t);
        continue;
      }
      const int64_t stride = t.nh * G * (2 + Dp);
      splits.push_back({used, n_parts, stride, t.h, t.nh, x.qsl[t.b] + t.row0});
      for (int64_t p = 0; p < n_parts; ++p) {
        Task part = t;
        part.j0 = jb + (je - jb) * p / n_parts;
        part.j1 = jb + (je - jb) * (p + 1) / n_parts;
        part.cost = t.cost / n_parts;
        part.part = used;
        used += stride;
        cut.push_back(part);
      }
    }
    tasks.swap(cut);
    parts.resize(used);
  }
  // the costliest first, handed out one at a time: threads finish together however uneven the tasks
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& p, const Task& q) { return p.cost > q.cost; });
  auto first_pos = [&](const Task& t) { return x.lens[t.b] - (x.qsl[t.b + 1] - x.qsl[t.b]) + t.row0; };
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_tasks), 1, [&](int64_t, int64_t) {
    Scratch w(bs, bsp, Dp, padded_heads(G), Nt, x.pairs ? D / 2 : 0, Hkv);
    // each thread claims its next task before it runs one, so that decode_row can prefetch that task's first blocks
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed), i2; i < n_tasks; i = i2) {
      i2 = next.fetch_add(1, std::memory_order_relaxed);
      const Task& t = tasks[i];
      const int64_t r0 = x.qsl[t.b] + t.row0, pos0 = first_pos(t);
      Blocks ahead;
      if (i2 < n_tasks && tasks[i2].rows == 1) {
        const Task& u = tasks[i2];
        const int64_t ctx = first_pos(u) + 1, lo = sliding_window > 0 ? std::max<int64_t>(ctx - sliding_window, 0) : 0;
        ahead = {u.b, u.h, u.nh, std::max(lo / bs, u.j0), u.j1 > 0 ? u.j1 : (ctx + bs - 1) / bs};
      }
      if (t.rows == 1)
        decode_row(x, w, t.b, t.h, t.nh, r0, pos0 + 1, t.j0, t.j1, t.part >= 0 ? parts.data() + t.part : nullptr,
                   ahead);
      else prefill_tile(x, w, t.b, t.h, r0, t.rows, pos0);
    }
    asm volatile("" : : "r"(w.sink));  // the touched words count as used: the loads are kept
  });
  for (const Split& sp : splits)
    merge_parts(x, parts.data() + sp.first, sp.parts, sp.stride, sp.h0, sp.nh, sp.r);
  for (const auto& [begin, end] : zero_rows)
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < Hq; ++h) std::fill_n(x.o + r * x.o_row + h * x.o_head, D, scalar_t(0));
  return left;
}

int64_t paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale, int64_t max_chunk_context, int64_t sliding_window,
                     double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T, Hq, D] and caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need stride 1 over the head dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and seq_lens must be contiguous int32");
  const at::ScalarType cache_type = key_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == cache_type &&
                  (cache_type == query.scalar_type() ||
                   (query.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf))),
              "query and out share one dtype, the caches one: the query's, or bf16 / fp16 under an fp32 query");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                         sinks->size(0) == query.size(1)),
              "sinks: contiguous float32, one per query head");
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  if (cache_type != query.scalar_type()) {  // fp32 query and out over bf16 / fp16 caches (kv_cache_dtype)
    return AT_DISPATCH_REDUCED_FLOATING_TYPES(cache_type, "paged_attention", [&] {
      return attend<float, scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                     scale, max_chunk_context, sliding_window, softcap, sink_ptr);
    });
  }
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    return attend<scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                            max_chunk_context, sliding_window, softcap, sink_ptr);
  });
}

// Every row on the kernel, however long its chunk (sliding window / softcap / sinks, which ATen's flash kernel lacks;
// decode batches, which it takes anyway). Returns nothing, so torch.jit.trace can record it (ops returning an int
// cannot be traced): the cpu decode graphs (graphinfer/platforms/cpu_graphs.py) call this one.
void paged_attention_all(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                         int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks) {
  paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                  std::numeric_limits<int64_t>::max(), sliding_window, softcap, sinks);
}

// n fp32 values to a bf16 / fp16 cache row, rounded to nearest even (as a tensor's .to() rounds).
template <typename cache_t>
inline void narrow_row(const float* src, cache_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) cpu_vec::store(dst + i, fVec::loadu(src + i));
  if (i < n) cpu_vec::store(dst + i, fVec::loadu(src + i, n - i), n - i);
}

// The cache write: token t's key and value rows [Hkv, D] go to slot slot_mapping[t] (< 0: padding, skipped), one
// memcpy each, tokens in parallel (index_copy_ copies row by row on one thread: 5 ms for a 2,500-token prefill). fp32
// rows under bf16 / fp16 caches (kv_cache_dtype) are narrowed as they are written.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2), "key and value need contiguous [Hkv, D] rows");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV caches must be contiguous");
  const at::ScalarType cache_type = key_cache.scalar_type();
  const bool narrow = key.scalar_type() != cache_type;
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == cache_type &&
                  (!narrow || (key.scalar_type() == at::kFloat &&
                               (cache_type == at::kBFloat16 || cache_type == at::kHalf))),
              "key/value share one dtype, the caches one: theirs, or bf16 / fp16 under fp32 key/value");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t T = key.size(0), n = key.size(1) * key.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (narrow) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(cache_type, "reshape_and_cache", [&] {
      const float* k = key.data_ptr<float>();
      const float* v = value.data_ptr<float>();
      scalar_t* kc = key_cache.data_ptr<scalar_t>();
      scalar_t* vc = value_cache.data_ptr<scalar_t>();
      at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          narrow_row(k + t * key.stride(0), kc + slots[t] * n, n);
          narrow_row(v + t * value.stride(0), vc + slots[t] * n, n);
        }
      });
    });
    return;
  }
  const int64_t bytes = n * key.element_size();
  const int64_t k_row = key.stride(0) * key.element_size(), v_row = value.stride(0) * value.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
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
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int max_chunk_context, int sliding_window=0, "
        "float softcap=0., Tensor? sinks=None) -> int");
  m.def("paged_attention_all(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int sliding_window=0, float softcap=0., "
        "Tensor? sinks=None) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(graphinfer_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_all", &paged_attention_all);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
