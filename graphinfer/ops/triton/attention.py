"""Paged attention kernels: causal GQA attention of a flat batch of decode rows and prefill chunks.

Cache layout [num_blocks, block_size, Hkv, D]; request i owns query rows query_start_loc[i]:[i+1], and its
query row j of a q_len-row chunk sits at position seq_lens[i] - q_len + j (see graphinfer/ops/attention.py).
Scores use exp2 with scale*log2(e) folded in; softmax and accumulation run in fp32 (online softmax).

Which kernel runs when (decided from shapes alone, so the choice itself reads nothing on the host):
  - pure decode (as many query rows as requests, T == B: every row is one request's decode, padded
    requests of a captured batch have seq_len 0): the split-K decode kernel (+ combine). It splits long
    contexts across programs, which one-row queries need to fill the GPU, and is faster there.
  - anything else (prefill only, mixed prefill chunks + decode rows, chunked prefill over a cached prefix,
    decode rows padded past query_start_loc[-1]): the flash-attention kernel, one launch for the batch.
Neither reads a tensor on the host (no .item()/.tolist()): both are CUDA/ACL-graph capture-safe and let
async scheduling run ahead of mixed steps too. tests/test_no_host_sync.py checks this in whole models.

Decode kernel: one program per (request, kv head, kv split), 1-D grid of B * Hkv * splits.
  The program holds the whole GQA group as a [BLOCK_G >= 16, BLOCK_D] tile and walks its share of the
  context in BLOCK_N-token tiles, gathering each token's page from block_tables on the device; two tl.dots
  per tile. The number of splits comes from shapes only (batch, heads, block_tables.shape[1]); with more
  than one split a combine kernel (grid B * Hq) merges the partial (max, sum, acc); seq_len 0 writes zeros.
  Each request's tiles are spread over cdiv(tiles, per-split tiles) splits, computed on the device from its
  seq_len; the splits past them (short contexts under a wide block table) write nothing and the combine
  reads only the active ones. With one split the decode kernel writes the output itself (no combine): on
  the H100 that is the rule from batch 32 (Qwen3-0.6B); at batch 1 splitting pays for the combine from
  ~128 tokens on (docs/benchmarks.md, the split sweep).
Flash-attention kernel (prefill and mixed batches; the design of vLLM's kernel_unified_attention_2d):
  one program per (query tile, kv head). A query tile packs BLOCK_Q = BLOCK_M // group consecutive query
  rows of one request times the GQA group of one KV head into the BLOCK_M rows of the tile, so a KV tile
  read from the cache serves every query head that shares it. The grid is T // BLOCK_Q + B + 1 tiles
  times Hkv, a bound from shapes: request i's tiles start at query_start_loc[i] // BLOCK_Q + i, each
  program finds its request on the device by counting the requests whose first tile is at or below its
  own (one vector load of query_start_loc per 128 requests), and programs past their request's rows
  compute nothing. Pseudo-request B covers the rows past query_start_loc[-1] (padding of a piecewise
  graph) and writes zeros there, as does any request with seq_len 0, so no memset runs before the kernel.
  Per tile: Q @ K^T and P @ V with tl.dot, K and V gathered page by page through the block table; KV tiles
  wholly below the causal diagonal run without masks, the diagonal tiles with the causal mask, and the
  loop stops at the tile's last query position (fully masked KV tiles are never visited). Programs are
  issued heaviest (latest) tile first. Decode rows of a mixed batch are one-row queries of the same kernel.

Tile sizes (BLOCK_M/BLOCK_N/num_warps/num_stages, _flash_config) are picked per dtype, head dim, token and
request count. 16-bit at head dim <= 128 is tuned on an H200 (36 configs swept, `tools/gpu_check.py
--prefill-tune`): BLOCK_M 128 x BLOCK_N 64, 4 warps, 3 stages for long prompts, else 64 x 64, 4 warps, 2 stages.
Other dtypes and head dims are untuned. On that H200 (2026-11-28, the configs before tuning) the kernel ran
1 x 8,192 causal at 310 TFLOP/s (SDPA's flash backend 287), 4 x 256 rows over 1,024 at 176 (SDPA 191), 16 x 512
at 148 (166), 1 x 2,048 at 226 (162): the issue-19 targets (>= 300, >= 100) are met
(`python tools/gpu_check.py --prefill-attention`).

Sliding window, softcap, sinks (the op's optional arguments, graphinfer/ops/attention.py), each a constexpr switch
so plain attention compiles as before:
  - sliding window W: decode programs split only the tiles from the one holding position seq_len - W on, and
    mask the positions below it; a flash program visits KV tiles from the one holding its first row's first
    visible position, masks the tiles before the first one every row sees whole (the window's lower edge) as it
    masks the diagonal's, and runs the tiles between unmasked.
  - softcap c: logits tanh(dot * scale / c) * c * log2(e), tanh from exp2 (no tanh is common to upstream's and
    Triton-Ascend's libdevice and both interpreters).
  - sinks: fp32 logits per query head, folded into the online softmax's running max and denominator after the
    last KV tile (decode without splits, flash), or into the combine's reduction over the splits.

Triton-Ascend: 1-D grids only; every ragged access masked (loads of whole tiles below the diagonal are
unmasked because every index is in range); tl.dot operands are >= 16 in every dim (its interpreter refuses
smaller ones); no fp64 (scale is a fp32 argument); block sizes are parameters; no while loops. Both
interpreters mis-compute bf16 tl.dot (numpy has no bf16), so on CPU the dots take fp32 operands (DOT_F32);
fp32 caches use fp32 'ieee' dots everywhere, bf16/fp16 caches native 16-bit dots on devices. KV loops
(and the flash kernel's request search) run between device-side bounds, the efficient form both compilers
and Triton-Ascend's interpreter accept; upstream Triton 3.6's interpreter needs the backported fix in
__init__.py for it.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import cdiv, launch_kernel, next_power_of_2

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # decode: split the context until about two waves of an H100's 132 SMs are busy
_MAX_SPLITS = 32  # e.g. 3 KV heads (SmolLM2) at batch 1 -> 96 programs
_FLASH_SEARCH_BLOCK = 128  # flash: query_start_loc entries a program scans per vector load to find its request
_FLASH_MIN_PROGRAMS = 512  # flash: below this many BLOCK_M 128 programs (~4 per H100 SM), use BLOCK_M 64
_FLASH_LONG_ROWS = 2048  # flash: and below this many rows per request (16 x 512 is faster at BLOCK_M 64 on an H200)
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so an empty split or padded row never makes inf - inf
_LOG2E_C = tl.constexpr(_LOG2E)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """fp32 accumulation; fp32 operands with exact products, or b's 16-bit dtype (tensor cores / cube)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _tanh(x):
    """tanh(x) from exp2 of -2|x| (never overflows), sign restored."""
    e = tl.exp2(-2.0 * _LOG2E_C * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, qk_scale, cap, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
    """Logits in log2 units: q.k * scale * log2(e); with a softcap c, tanh(q.k * scale / c) * c * log2(e)
    (the host passes qk_scale = scale / c and cap = c * log2(e) then)."""
    s = _dot(q, k, DOT_F32) * qk_scale
    if SOFTCAP:
        s = _tanh(s) * cap
    return s


@triton.jit
def _fold_sink(m, l, acc, sink):
    """Add a sink logit (log2 units, one per row) to an online softmax's (max, sum, acc): a term of the
    denominator with no value."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    return l * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


# ---- decode: split-K over the context, pure-decode batches ----------------------------------------------------

@triton.jit
def _attend_tile(q, m, l, acc, allowed, tok, tok_mask, page_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, d, d_mask,
                 qk_scale, cap, block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step over the cache tokens `tok` ([BLOCK_N]); allowed: [rows, BLOCK_N] mask."""
    page = tl.load(page_row_ptr + tok // block_size, mask=tok_mask, other=0).to(tl.int64)
    slot = tok % block_size
    kv_mask = tok_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=kv_mask, other=0.0)
    s = _scores(q, tl.trans(k), qk_scale, cap, SOFTCAP, DOT_F32)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr,
                   part_acc_ptr, part_ml_ptr, qk_scale, cap, window, n_kv_heads, group, head_size, block_size,
                   num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
                   DOT_F32: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pure decode: query row `req` is request req's only row (whatever query_start_loc says of padding)."""
    pid = tl.program_id(0)
    split = pid % num_splits
    kv_head = (pid // num_splits) % n_kv_heads
    req = pid // num_splits // n_kv_heads
    seq_len = tl.load(seq_lens_ptr + req)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_size
    q_heads = kv_head * group + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + req * stride_qt + q_heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    # This split's share of the visible context (the window's tiles), in whole tiles, from the device-side seq_len.
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)  # the first visible position
    else:
        lo = seq_len * 0
    t_first = lo // BLOCK_N
    per_split = tl.cdiv(n_tiles - t_first, num_splits)
    t_lo = t_first + split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    m = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    page_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < seq_len
        if SLIDING:
            tok_mask = tok_mask & (tok >= lo)
        m, l, acc = _attend_tile(q, m, l, acc, tok_mask[None, :], tok, tok_mask, page_row_ptr, k_cache_ptr,
                                 v_cache_ptr, kv_head, d, d_mask, qk_scale, cap, block_size, stride_kb, stride_ks,
                                 stride_kh, stride_vb, stride_vs, stride_vh, SOFTCAP, DOT_F32)

    if SPLIT:  # unnormalised partials; the combine kernel weighs them by exp2(m - max m)
        # Splits past the context's last tile (short contexts) write nothing; the combine reads only the others.
        has_tiles = t_lo < n_tiles
        part = (req * n_kv_heads * group + q_heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * head_size + d[None, :], acc, mask=q_mask & has_tiles)
        tl.store(part_ml_ptr + part * 2, m, mask=g_mask & has_tiles)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_mask & has_tiles)
    else:
        if HAS_SINKS:
            l, acc = _fold_sink(m, l, acc, tl.load(sinks_ptr + q_heads, mask=g_mask, other=0.0) * _LOG2E_C)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len 0: acc is 0, so the row is 0
        tl.store(out_ptr + req * stride_ot + q_heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, sinks_ptr, window, n_q_heads, head_size,
                    num_splits, stride_ot, stride_oh, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
                    SPLIT_BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # = request * Hq + head, the partials' row; the request's row is the request
    req = pid // n_q_heads
    head = pid % n_q_heads
    # The splits the decode kernel gave tiles to (the same arithmetic; none for seq_len 0: the row is 0).
    seq_len = tl.load(seq_lens_ptr + req)
    n_tiles = tl.cdiv(seq_len, SPLIT_BLOCK_N)
    if SLIDING:
        n_tiles -= tl.maximum(seq_len - window, 0) // SPLIT_BLOCK_N  # those from the window's first on
    n_active = tl.cdiv(n_tiles, tl.maximum(tl.cdiv(n_tiles, num_splits), 1))
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < n_active
    d_mask = d < head_size
    part = pid * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=_NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_size + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    # masked splits have l = 0 and acc = 0: they add nothing
    if HAS_SINKS:  # the sink: a term of the denominator with no value
        sink = tl.load(sinks_ptr + head) * _LOG2E_C
        m_max = tl.maximum(tl.max(m, axis=0), sink)
        w = tl.exp2(m - m_max)
        total = tl.sum(w * l, axis=0) + tl.exp2(sink - m_max)
    else:
        w = tl.exp2(m - tl.max(m, axis=0))
        total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


# ---- flash attention: prefill, chunked prefill and mixed batches ------------------------------------------------

@triton.jit
def _find_request(qsl_ptr, tile, n_reqs, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr):
    """The request owning query tile `tile`: the largest i in [0, n_reqs] whose first tile,
    query_start_loc[i] // BLOCK_Q + i, is <= tile (i = n_reqs: the padding rows past query_start_loc[-1]).

    First tiles increase with i, so that i is the count of i' in [1, n_reqs] at or below the tile: one
    vector load and a sum per BLOCK_R requests (a single pass up to BLOCK_R - 1 requests) rather than a
    chain of dependent loads of a binary search.
    """
    count = tile * 0
    for start in range(0, n_reqs + 1, BLOCK_R):
        i = start + tl.arange(0, BLOCK_R)
        valid = (i > 0) & (i <= n_reqs)
        first = tl.load(qsl_ptr + i, mask=valid, other=0) // BLOCK_Q + i
        count += tl.sum((valid & (first <= tile)).to(tl.int32), axis=0)
    return count


@triton.jit
def _flash_step(q, m, l, acc, t, q_pos, kv_start, kv_end, window, page_row_ptr, k_base, v_base, d, d_mask, qk_scale,
                cap, stride_kb, stride_ks, stride_vb, stride_vs, DIAGONAL: tl.constexpr, EVEN_D: tl.constexpr,
                SOFTCAP: tl.constexpr, SLIDING: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Online softmax over KV tile t. DIAGONAL: the tile crosses the causal diagonal, the context end or the
    sliding window's lower edge (masked loads, causal and window masks); otherwise every token of it is visible to
    every row of the query tile. Positions outside [kv_start, kv_end) are never read."""
    tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tok % BLOCK_SIZE
    if DIAGONAL:
        tok_mask = tok < kv_end
        if SLIDING:
            tok_mask = tok_mask & (tok >= kv_start)
        page = tl.load(page_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    else:
        page = tl.load(page_row_ptr + tok // BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_base + page[None, :] * stride_kb + slot[None, :] * stride_ks + d[:, None]  # K^T: [BLOCK_D, BLOCK_N]
    v_ptrs = v_base + page[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :]  # V: [BLOCK_N, BLOCK_D]
    if DIAGONAL:
        k = tl.load(k_ptrs, mask=d_mask[:, None] & tok_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=tok_mask[:, None] & d_mask[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    s = _scores(q, k, qk_scale, cap, SOFTCAP, DOT_F32)
    if DIAGONAL:  # a valid row's position is < kv_end, so this also hides the tokens past the context
        visible = tok[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & (tok[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["n_reqs", "n_rows", "n_tiles"])
def _flash_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr, sinks_ptr, out_ptr,
                  qk_scale, cap, window, n_reqs, n_rows, n_tiles,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
                  DOT_F32: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = pid % N_KV_HEADS
    tile = n_tiles - 1 - pid // N_KV_HEADS  # latest (longest) query tiles first: causal load balance
    req = _find_request(qsl_ptr, tile, n_reqs, BLOCK_Q, BLOCK_R)
    is_pad = req == n_reqs  # the rows past query_start_loc[-1]: zeros
    q_start = tl.load(qsl_ptr + req)
    q_end = tl.where(is_pad, n_rows, tl.load(qsl_ptr + tl.minimum(req + 1, n_reqs)))
    seq_len = tl.where(is_pad, 0, tl.load(seq_lens_ptr + tl.minimum(req, n_reqs - 1)))
    q_len = q_end - q_start
    ctx = seq_len - q_len  # cached prefix before this chunk
    q0 = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # this tile's first row within the chunk

    # Row r of the tile = query row q0 + r // GROUP, query head kv_head * GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // GROUP
    row_mask = (qi < q_len) & (r < BLOCK_Q * GROUP)
    q_pos = ctx + qi
    heads = kv_head * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_SIZE
    io_mask = row_mask[:, None] & d_mask[None, :]
    rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)

    # KV bounds: tokens < kv_end (the tile's last position + 1) are visible to some row; tiles below
    # n_full hold only tokens <= the tile's first position, visible to every row. Empty tiles: none.
    has_rows = q0 < q_len
    kv_end = tl.where(has_rows, tl.maximum(tl.minimum(seq_len, ctx + tl.minimum(q0 + BLOCK_Q, q_len)), 0), 0)
    n_full = tl.minimum(tl.where(has_rows, tl.maximum(ctx + q0 + 1, 0), 0), kv_end) // BLOCK_N
    n_kv = tl.cdiv(kv_end, BLOCK_N)
    # Sliding window: tiles before t_lo hold no position any row sees; tiles [t_lo, t_win) cross some row's window
    # edge (masked); from t_win on every position is inside every row's window (the last row's, kv_end - 1, starts
    # latest), so tiles [t_win, n_full) run unmasked.
    if SLIDING:
        kv_start = tl.maximum(ctx + q0 - window + 1, 0)  # the first row's first visible position
        t_lo = tl.minimum(kv_start // BLOCK_N, n_kv)
        t_win = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N), t_lo), n_kv)
        n_full = tl.maximum(n_full, t_win)
    else:
        kv_start = n_kv * 0
        t_lo = kv_start
        t_win = t_lo

    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if SLIDING:
        for t in range(t_lo, t_win):
            m, l, acc = _flash_step(q, m, l, acc, t, q_pos, kv_start, kv_end, window, page_row_ptr, k_base, v_base, d,
                                    d_mask, qk_scale, cap, stride_kb, stride_ks, stride_vb, stride_vs, True,
                                    BLOCK_D == HEAD_SIZE, SOFTCAP, SLIDING, DOT_F32, BLOCK_SIZE, BLOCK_N)
    for t in range(t_win, n_full):
        m, l, acc = _flash_step(q, m, l, acc, t, q_pos, kv_start, kv_end, window, page_row_ptr, k_base, v_base, d,
                                d_mask, qk_scale, cap, stride_kb, stride_ks, stride_vb, stride_vs, False,
                                BLOCK_D == HEAD_SIZE, SOFTCAP, SLIDING, DOT_F32, BLOCK_SIZE, BLOCK_N)
    for t in range(n_full, n_kv):
        m, l, acc = _flash_step(q, m, l, acc, t, q_pos, kv_start, kv_end, window, page_row_ptr, k_base, v_base, d,
                                d_mask, qk_scale, cap, stride_kb, stride_ks, stride_vb, stride_vs, True,
                                BLOCK_D == HEAD_SIZE, SOFTCAP, SLIDING, DOT_F32, BLOCK_SIZE, BLOCK_N)
    if HAS_SINKS:
        l, acc = _fold_sink(m, l, acc, tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * _LOG2E_C)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len 0 or padding: acc is 0, so the row is 0
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


# ---- launch ------------------------------------------------------------------------------------------------------

def _num_splits(n_reqs: int, n_kv_heads: int, max_context: int, block_n: int) -> int:
    """Shape-only choice (capture-safe): split the context while the grid is below _TARGET_PROGRAMS."""
    max_tiles = max(1, cdiv(max_context, block_n))
    return max(1, min(_MAX_SPLITS, max_tiles, _TARGET_PROGRAMS // max(1, n_reqs * n_kv_heads)))


def _flash_config(dtype: torch.dtype, head_size: int, n_rows: int, n_q_heads: int,
                  n_reqs: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from shapes.

    16-bit, head dim <= 128: tuned on an H200 (`tools/gpu_check.py --prefill-tune`, 36 configs on Qwen3-0.6B's
    heads, docs/bench/h200_prefill_tune_2026-11-28.json): long prompts (at least _FLASH_MIN_PROGRAMS BLOCK_M 128
    programs and >= _FLASH_LONG_ROWS rows per request; 1 x 8,192) take BLOCK_M 128 x BLOCK_N 64 with 4 warps and
    3 stages (759 us against 887 for the 8-warp config); everything else (4 x 256 over 1,024, 16 x 512, 1 x 2,048,
    decode rows with a chunk) BLOCK_M 64 x BLOCK_N 64, 4 warps, 2 stages, within 9 % of each case's best (16 x 512:
    105.9 us against 97.9 for 64 x 32).
    UNTUNED (chosen for Hopper, compiled offline without spills, not measured): head dim 256 halves the tiles;
    fp32 'ieee' dots are FMA-based and bulkier in registers: BLOCK_M 32 (16 x 16 tiles at head dim 256).
    """
    if dtype == torch.float32:
        return (32, 64, 8, 2) if head_size <= 128 else (16, 16, 4, 2)
    if head_size > 128:
        return 64, 32, 8, 2
    if n_rows * n_q_heads >= _FLASH_MIN_PROGRAMS * 128 and n_rows >= _FLASH_LONG_ROWS * n_reqs:
        return 128, 64, 4, 3
    return 64, 64, 4, 2


def paged_attention_impl(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                         query_start_loc: Tensor, seq_lens: Tensor, scale: float, sliding_window: int = 0,
                         softcap: float = 0.0, sinks: Tensor | None = None, *, kernel: str | None = None,
                         num_splits: int | None = None, decode_block_n: int | None = None, block_m: int | None = None,
                         block_n: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None) -> Tensor:
    """paged_attention with the choices exposed (tests and benchmarks pin them; None = the default choice).

    sliding_window / softcap / sinks: the op's (graphinfer/ops/attention.py); 0 / 0.0 / None: off.
    kernel: "decode" (split-K; only for pure-decode batches, T == B) or "flash"; None picks decode for
    T == B, else flash. num_splits / decode_block_n: the decode kernel's; block_m / block_n: the flash kernel's
    (block_m is rounded up to the next power of 2 >= the GQA group); num_warps / num_stages: either kernel's (decode:
    4 warps and Triton's default stages unless given).
    """
    n_rows, n_q_heads, head_size = query.shape
    n_reqs = seq_lens.shape[0]
    block_size, n_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = n_q_heads // n_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a contiguous head dim"
    # Every request has exactly one row iff the row count equals the request count (0-row requests are
    # never scheduled; a captured batch's padded requests have one row and seq_len 0): decided from shapes.
    pure_decode = n_rows == n_reqs
    kernel = kernel or ("decode" if pure_decode else "flash")
    if kernel not in ("decode", "flash") or (kernel == "decode" and not pure_decode):
        raise ValueError(f"kernel={kernel!r}: 'decode' needs one query row per request (T == B), else 'flash'")
    # Both kernels write every row (zeros where nothing is attended), so no memset.
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if n_rows == 0:
        return out
    if n_reqs == 0:  # every row is padding
        return out.zero_()

    if sinks is not None:
        if sinks.shape != (n_q_heads,):
            raise ValueError(f"sinks: one logit per query head, shape ({n_q_heads},), got {tuple(sinks.shape)}")
        sinks = sinks.float().contiguous()  # no copy for fp32 sinks
    # softcap c: the kernels take tanh(dot * scale / c) * c * log2(e) (see _scores)
    qk_scale, cap = (float(scale) / softcap, float(softcap) * _LOG2E) if softcap > 0 else (float(scale) * _LOG2E, 1.0)
    features = dict(SOFTCAP=softcap > 0, SLIDING=sliding_window > 0, HAS_SINKS=sinks is not None)
    sinks_arg = sinks if sinks is not None else seq_lens  # never read without sinks
    fp32_cache = key_cache.dtype == torch.float32
    dot_f32 = fp32_cache or query.device.type == "cpu"  # CPU = interpreter: no bf16 dot
    block_d = max(16, next_power_of_2(head_size))
    strides = dict(stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0),
                   stride_oh=out.stride(1), stride_bt=block_tables.stride(0),
                   stride_kb=key_cache.stride(0), stride_ks=key_cache.stride(1), stride_kh=key_cache.stride(2),
                   stride_vb=value_cache.stride(0), stride_vs=value_cache.stride(1), stride_vh=value_cache.stride(2))

    if kernel == "decode":
        # Tiles sized so that sm_90 builds keep everything in registers (fp32 'ieee' dots are FMA-based, bulkier).
        decode_block_n = decode_block_n or (32 if head_size > (64 if fp32_cache else 128) else 64)
        max_context = block_tables.shape[1] * block_size
        if sliding_window > 0:  # a window's positions span at most this many tokens of whole tiles
            max_context = min(max_context, sliding_window + decode_block_n)
        splits = num_splits or _num_splits(n_reqs, n_kv_heads, max_context, decode_block_n)
        split = splits > 1
        part_acc = torch.empty((n_reqs * n_q_heads * splits * head_size) if split else 1, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((n_reqs * n_q_heads * splits * 2) if split else 1, dtype=torch.float32,
                              device=query.device)
        launch_kernel(_decode_kernel, (n_reqs * n_kv_heads * splits,),
            query, key_cache, value_cache, block_tables, seq_lens, sinks_arg, out, part_acc, part_ml,
            qk_scale, cap, sliding_window, n_kv_heads, group, head_size, block_size, splits, **strides,
            SPLIT=split, **features, DOT_F32=dot_f32,
            BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=decode_block_n, BLOCK_D=block_d,
            num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}))
        if split:
            launch_kernel(_combine_kernel, (n_reqs * n_q_heads,),
                part_acc, part_ml, out, seq_lens, sinks_arg, sliding_window, n_q_heads, head_size, splits,
                out.stride(0), out.stride(1), SLIDING=features["SLIDING"], HAS_SINKS=features["HAS_SINKS"],
                SPLIT_BLOCK_N=decode_block_n, BLOCK_S=next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)
        return out

    cfg_m, cfg_n, cfg_warps, cfg_stages = _flash_config(key_cache.dtype, head_size, n_rows, n_q_heads, n_reqs)
    bm = max(next_power_of_2(block_m or cfg_m), next_power_of_2(group), 16)
    block_q = bm // group
    n_tiles = n_rows // block_q + n_reqs + 1  # >= sum over requests of cdiv(q_len, BLOCK_Q), + the padding rows
    launch = dict(num_warps=num_warps or cfg_warps, num_stages=num_stages or cfg_stages)
    launch_kernel(_flash_kernel, (n_tiles * n_kv_heads,),
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, sinks_arg, out, qk_scale, cap,
        sliding_window, n_reqs, n_rows, n_tiles, **strides, N_KV_HEADS=n_kv_heads, GROUP=group, HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size, **features, DOT_F32=dot_f32, BLOCK_R=_FLASH_SEARCH_BLOCK,
        BLOCK_M=bm, BLOCK_Q=block_q, BLOCK_N=block_n or cfg_n, BLOCK_D=block_d, **launch)
    return out


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float, sliding_window: int = 0,
                    softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """Causal GQA attention of query [T, Hq, D] over each request's paged context -> [T, Hq, D] (optionally a
    sliding window, softcap, sinks: graphinfer/ops/attention.py)."""
    return paged_attention_impl(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                sliding_window, softcap, sinks)
