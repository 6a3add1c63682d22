"""Paged attention kernels: causal GQA attention of a flat batch of decode rows and prefill chunks.

Cache layout [num_blocks, block_size, Hkv, D]; request i owns query rows query_start_loc[i]:[i+1], and its
query row j of a q_len-row chunk sits at position seq_lens[i] - q_len + j (see graphinfer/ops/attention.py).
Scores use exp2 with scale*log2(e) folded in; softmax and accumulation run in fp32 (online softmax).

Decode kernel (capture-safe): one program per (request, kv head, kv split), 1-D grid of B * Hkv * splits.
  The program holds the whole GQA group as a [BLOCK_G >= 16, BLOCK_D] tile and walks its share of the
  context in BLOCK_N-token tiles, gathering each token's page from block_tables on the device; two tl.dots
  per tile. The number of splits comes from shapes only (batch, heads, block_tables.shape[1]); with more
  than one split a combine kernel (grid B * Hq) merges the partial (max, sum, acc). Nothing reads a
  tensor on the host, so it replays inside a CUDA/ACL graph; seq_len 0 writes zeros.
Prefill kernel (mixed batches; may sync the host): one program per (query tile, kv head). A tile packs
  BLOCK_M // BLOCK_G consecutive query rows of one request times its GQA group into BLOCK_M rows (the
  host builds the tile -> (request, first row) map), and walks the context up to its last row's position
  with a causal mask. In a mixed batch the decode kernel handles the q_len 1 requests.

Triton-Ascend: 1-D grids only; every ragged access masked; tl.dot operands are >= 16 in every dim (its
interpreter refuses smaller ones); no fp64 (scale is a fp32 argument); block sizes are parameters.
Both interpreters mis-compute bf16 tl.dot (numpy has no bf16), so on CPU the dots take fp32 operands
(DOT_F32); fp32 caches use fp32 'ieee' dots everywhere, bf16/fp16 caches native 16-bit dots on devices.
KV loops run between device-side bounds (from seq_lens), the efficient form both compilers and Triton-Ascend's
interpreter accept; upstream Triton 3.6's interpreter needs the backported fix in __init__.py for it.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # decode: split the context until about two waves of an H100's 132 SMs are busy
_MAX_SPLITS = 32  # e.g. 3 KV heads (SmolLM2) at batch 1 -> 96 programs
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so an empty split or padded row never makes inf - inf


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """fp32 accumulation; fp32 operands with exact products, or b's 16-bit dtype (tensor cores / cube)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _attend_tile(q, m, l, acc, allowed, tok, tok_mask, page_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, d, d_mask,
                 qk_scale, block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 DOT_F32: tl.constexpr):
    """One online-softmax step over the cache tokens `tok` ([BLOCK_N]); allowed: [rows, BLOCK_N] mask."""
    page = tl.load(page_row_ptr + tok // block_size, mask=tok_mask, other=0).to(tl.int64)
    slot = tok % block_size
    kv_mask = tok_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), DOT_F32) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _decode_row(qsl_ptr, req, MIXED: tl.constexpr):
    """(query row of request req, whether it is a decode). Mixed batch: only q_len 1 requests are the decode
    kernels' (the prefill kernel writes the others). Pure decode: row i is request i, whatever query_start_loc
    says about padded requests."""
    if MIXED:
        row = tl.load(qsl_ptr + req)
        is_decode = tl.load(qsl_ptr + req + 1) - row == 1
    else:
        row = req
        is_decode = req >= 0
    return row, is_decode


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
                   part_acc_ptr, part_ml_ptr, qk_scale, n_kv_heads, group, head_size, block_size, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   SPLIT: tl.constexpr, MIXED: tl.constexpr, DOT_F32: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % num_splits
    kv_head = (pid // num_splits) % n_kv_heads
    req = pid // num_splits // n_kv_heads
    row, is_decode = _decode_row(qsl_ptr, req, MIXED)
    seq_len = tl.where(is_decode, tl.load(seq_lens_ptr + req), 0)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < head_size
    q_heads = kv_head * group + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + row * stride_qt + q_heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    # This split's share of the context, in whole tiles, from the device-side seq_len.
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    m = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    page_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < seq_len
        m, l, acc = _attend_tile(q, m, l, acc, tok_mask[None, :], tok, tok_mask, page_row_ptr, k_cache_ptr,
                                 v_cache_ptr, kv_head, d, d_mask, qk_scale, block_size, stride_kb, stride_ks,
                                 stride_kh, stride_vb, stride_vs, stride_vh, DOT_F32)

    if SPLIT:  # unnormalised partials; the combine kernel weighs them by exp2(m - max m)
        part = (req * n_kv_heads * group + q_heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * head_size + d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_mask)
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len 0: acc is 0, so the row is 0
        tl.store(out_ptr + row * stride_ot + q_heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask & is_decode)


@triton.jit
def _combine_kernel(part_acc_ptr, part_ml_ptr, qsl_ptr, out_ptr, n_q_heads, head_size, num_splits,
                    stride_ot, stride_oh, MIXED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)  # = request * Hq + head, the partials' row
    req = pid // n_q_heads
    head = pid % n_q_heads
    row, is_decode = _decode_row(qsl_ptr, req, MIXED)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_size
    part = pid * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=_NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_size + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # empty splits have l = 0 and acc = 0: they add nothing
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask & is_decode)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr, tile_req_ptr,
                    tile_q0_ptr, out_ptr, qk_scale, n_kv_heads, group, head_size, block_size,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // n_kv_heads
    kv_head = pid % n_kv_heads
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)  # first query row of this tile, within the request's chunk
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # cached prefix before the chunk

    # Row r of the tile = query row q0 + r // BLOCK_G, head kv_head * group + r % BLOCK_G.
    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // BLOCK_G
    g = r % BLOCK_G
    row_mask = (qi < q_len) & (g < group)
    q_pos = ctx + qi
    heads = kv_head * group + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_size
    io_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)

    kv_end = tl.minimum(seq_len, ctx + tl.minimum(q0 + BLOCK_Q, q_len))  # last row's position + 1
    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(0, tl.cdiv(kv_end, BLOCK_N)):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < kv_end
        causal = (tok[None, :] <= q_pos[:, None]) & tok_mask[None, :]
        m, l, acc = _attend_tile(q, m, l, acc, causal, tok, tok_mask, page_row_ptr, k_cache_ptr, v_cache_ptr,
                                 kv_head, d, d_mask, qk_scale, block_size, stride_kb, stride_ks, stride_kh,
                                 stride_vb, stride_vs, stride_vh, DOT_F32)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def _num_splits(n_reqs: int, n_kv_heads: int, max_context: int, block_n: int) -> int:
    """Shape-only choice (capture-safe): split the context while the grid is below _TARGET_PROGRAMS."""
    max_tiles = max(1, triton.cdiv(max_context, block_n))
    return max(1, min(_MAX_SPLITS, max_tiles, _TARGET_PROGRAMS // max(1, n_reqs * n_kv_heads)))


def paged_attention_impl(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                         query_start_loc: Tensor, seq_lens: Tensor, scale: float, *, num_splits: int | None = None,
                         decode_block_n: int | None = None, prefill_block_m: int | None = None,
                         prefill_block_n: int | None = None) -> Tensor:
    """paged_attention with the tiling exposed (tests pin splits / block sizes; None = the default choice)."""
    n_rows, n_q_heads, head_size = query.shape
    n_reqs = seq_lens.shape[0]
    block_size, n_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = n_q_heads // n_kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a contiguous head dim"
    # Every request has exactly one row iff the row count equals the request count (0-row requests are
    # never scheduled): the capture-safe path, decided from shapes alone.
    pure_decode = n_rows == n_reqs
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if pure_decode else torch.zeros(
        query.shape, dtype=query.dtype, device=query.device)
    if n_rows == 0 or n_reqs == 0:
        return out.zero_()

    qk_scale = float(scale) * _LOG2E
    fp32_cache = key_cache.dtype == torch.float32
    dot_f32 = fp32_cache or query.device.type == "cpu"  # CPU = interpreter: no bf16 dot
    # Tiles sized so that sm_90 builds keep everything in registers (fp32 'ieee' dots are FMA-based, bulkier).
    decode_block_n = decode_block_n or (32 if head_size > (64 if fp32_cache else 128) else 64)
    prefill_block_m = prefill_block_m or (32 if fp32_cache else 64)
    prefill_block_n = prefill_block_n or 64
    prefill_warps = 8 if fp32_cache else 4
    block_d = max(16, triton.next_power_of_2(head_size))
    strides = dict(stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0),
                   stride_oh=out.stride(1), stride_bt=block_tables.stride(0),
                   stride_kb=key_cache.stride(0), stride_ks=key_cache.stride(1), stride_kh=key_cache.stride(2),
                   stride_vb=value_cache.stride(0), stride_vs=value_cache.stride(1), stride_vh=value_cache.stride(2))

    has_decode, n_prefill_tiles = True, 0
    if not pure_decode:  # host sync allowed here: this path never runs inside a graph
        block_g = triton.next_power_of_2(group)
        block_m = max(prefill_block_m, block_g)
        block_q = block_m // block_g
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        tiles = torch.where(q_lens > 1, (q_lens + block_q - 1) // block_q, 0)
        n_decode, n_prefill_tiles = (int(v) for v in torch.stack([(q_lens == 1).sum(), tiles.sum()]).tolist())
        has_decode = n_decode > 0

    if has_decode:
        splits = num_splits or _num_splits(n_reqs, n_kv_heads, block_tables.shape[1] * block_size, decode_block_n)
        split = splits > 1
        part_acc = torch.empty((n_reqs * n_q_heads * splits * head_size) if split else 1, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty((n_reqs * n_q_heads * splits * 2) if split else 1, dtype=torch.float32,
                              device=query.device)
        _decode_kernel[(n_reqs * n_kv_heads * splits,)](
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, part_acc, part_ml,
            qk_scale, n_kv_heads, group, head_size, block_size, splits, **strides,
            SPLIT=split, MIXED=not pure_decode, DOT_F32=dot_f32,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=decode_block_n, BLOCK_D=block_d, num_warps=4)
        if split:
            _combine_kernel[(n_reqs * n_q_heads,)](
                part_acc, part_ml, query_start_loc, out, n_q_heads, head_size, splits, out.stride(0), out.stride(1),
                MIXED=not pure_decode, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)

    if not pure_decode and n_prefill_tiles:
        tile_req = torch.repeat_interleave(torch.arange(n_reqs, device=query.device), tiles,
                                           output_size=n_prefill_tiles)
        first_tile = torch.cumsum(tiles, 0) - tiles
        tile_q0 = (torch.arange(n_prefill_tiles, device=query.device) - first_tile[tile_req]) * block_q
        _prefill_kernel[(n_prefill_tiles * n_kv_heads,)](
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, tile_req.to(torch.int32),
            tile_q0.to(torch.int32), out, qk_scale, n_kv_heads, group, head_size, block_size, **strides,
            DOT_F32=dot_f32, BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=prefill_block_n,
            BLOCK_D=block_d, num_warps=prefill_warps, num_stages=2)
    return out


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """Causal GQA attention of query [T, Hq, D] over each request's paged context -> [T, Hq, D]."""
    return paged_attention_impl(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
