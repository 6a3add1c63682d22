"""MLA latent attention kernel (graphinfer::mla_latent_attention, graphinfer/ops/mla.py): DeepSeek's absorbed form.

H query heads attend, multi-query, over the latent cache rows [c (L), k_pe (R)] of a paged cache
[num_blocks, block_size, 1, L + R]: score = q_latent . c + q_pe . k_pe, value = c. Batch layout: paged_attention's
(graphinfer/ops/attention.py). The design is vLLM's `triton_decode_attention` (`_fwd_grouped_kernel_stage1` /
`_fwd_kernel_stage2`, after lightllm's and SGLang's), in this repo's Triton subset:

Stage 1, one program per (query row, head tile, context split), 1-D grid of T * cdiv(H, BLOCK_H) * splits:
  - the program holds BLOCK_H (>= 16) query heads of one row as a [BLOCK_H, BLOCK_L] latent tile and a
    [BLOCK_H, BLOCK_R] rope tile, and walks its share of the row's visible context in BLOCK_N-token tiles, gathering
    each token's page from block_tables on the device;
  - per KV tile it loads the latent rows c [BLOCK_N, BLOCK_L] and k_pe [BLOCK_N, BLOCK_R] ONCE: the scores are
    q_latent @ c^T + q_pe @ k_pe^T (two tl.dots into one fp32 [BLOCK_H, BLOCK_N] tile) and the value product P @ c
    reuses the same c tile, so every cached row is read once per head tile (paged_attention with the cache as K and
    V reads it twice, and its value tail R is computed and thrown away);
  - with one split the program normalises and writes the output; with more it writes the unnormalised partial
    (acc, running max m, sum l) of its split, also for a split without tiles (m = -1e30, l = 0, acc = 0).
Stage 2 (splits > 1), one program per (row, head): the log-sum-exp combine of the row's splits (each weighed by
  exp2(m - max m)); a row that attended to nothing comes out 0.
  It is this module's own combine rather than attention.py's `_combine_kernel`, which derives each request's active
  splits from its seq_len; here a program is a query row whose context is its causal position, and every split
  writes its partial, so the combine needs no context arithmetic at all.

Which rows (decided from shapes only, no host reads: capture-safe, as attention.py's kernels):
  - pure decode (T == B, as paged_attention's decode kernel): row i is request i's only row, visible context
    seq_lens[i] (0 for the padded requests of a captured batch: zeros).
  - any other batch (prefill chunks, chunked prefill over a cached prefix, mixed prefill + decode, spec-verify rows,
    rows past query_start_loc[-1]): the same kernel, each query row on its own: the program finds its request by
    counting the entries of query_start_loc[1:] at or below its row (one vector load per BLOCK_R requests), and row j
    of a q_len-row chunk sees the positions 0 .. seq_len - q_len + j (causal mask = a per-row context length). Rows
    past query_start_loc[-1] and rows of seq_len-0 requests write zeros. Rows of one chunk do not share KV tiles, so a
    long prefill reads its context once per row: right for decode, spec-verify and short chunks; steps of long prefills
    take the expanded form instead (graphinfer::mla_attention_auto, which absorb_mla writes).
Splits: attention.py's `_num_splits` on (rows, head tiles, the block table's width): shapes only.

Triton-Ascend (see attention.py): 1-D grids; every ragged access masked; tl.dot operands >= 16 in every dimension
(BLOCK_H >= 16, BLOCK_N >= 16, BLOCK_R >= 16); no fp64 (scale is an fp32 argument); no while loops; DOT_F32 on CPU
(the interpreters mis-compute 16-bit dots); KV loops between device-side bounds (upstream Triton's interpreter needs
the fix backported in __init__.py).
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.attention import _LOG2E, _NEG_BIG, _dot, _num_splits
from graphinfer.ops.triton.launch import cdiv, launch_kernel, next_power_of_2

_BLOCK_H = 16  # query heads per program: vLLM's BLOCK_H; tl.dot needs >= 16 rows
_BLOCK_R = 128  # query_start_loc entries a program scans per vector load to find its request (mixed batches)


@triton.jit
def _row_request(qsl_ptr, row, n_reqs, BLOCK_R: tl.constexpr):
    """The request owning query row `row`: the number of i in [1, n_reqs] with query_start_loc[i] <= row
    (n_reqs: a row past query_start_loc[-1], padding)."""
    count = row * 0
    for start in range(0, n_reqs + 1, BLOCK_R):
        i = start + tl.arange(0, BLOCK_R)
        valid = (i > 0) & (i <= n_reqs)
        ends = tl.load(qsl_ptr + i, mask=valid, other=0)
        count += tl.sum((valid & (ends <= row)).to(tl.int32), axis=0)
    return count


@triton.jit(do_not_specialize=["n_reqs"])
def _mla_kernel(ql_ptr, qpe_ptr, cache_ptr, block_tables_ptr, qsl_ptr, seq_lens_ptr, out_ptr, part_acc_ptr,
                part_ml_ptr, qk_scale, n_reqs, n_heads, num_splits,
                stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs,
                LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr,
                SPLIT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_L: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    n_htiles = tl.cdiv(n_heads, BLOCK_H)
    split = pid % num_splits
    htile = (pid // num_splits) % n_htiles
    row = pid // num_splits // n_htiles

    # The row's request and visible context (positions 0 .. ctx - 1), on the device.
    if DECODE:
        req = row
        ctx = tl.load(seq_lens_ptr + req)
    else:
        req = _row_request(qsl_ptr, row, n_reqs, BLOCK_R)
        is_req = req < n_reqs
        safe = tl.minimum(req, n_reqs - 1)
        seq_len = tl.load(seq_lens_ptr + safe)
        q_end = tl.load(qsl_ptr + safe + 1)
        # row j of a q_len-row chunk sits at seq_len - q_len + j: it sees seq_len - (q_end - 1 - row) positions
        ctx = tl.where(is_req & (seq_len > 0), tl.maximum(seq_len - (q_end - 1 - row), 0), 0)
        req = safe

    h = htile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < n_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_DR)
    dl_mask = dl < LATENT
    dr_mask = dr < ROPE
    row64 = row.to(tl.int64)
    q_lat = tl.load(ql_ptr + row64 * stride_qlt + h[:, None] * stride_qlh + dl[None, :],
                    mask=h_mask[:, None] & dl_mask[None, :], other=0.0)
    q_pe = tl.load(qpe_ptr + row64 * stride_qpt + h[:, None] * stride_qph + dr[None, :],
                   mask=h_mask[:, None] & dr_mask[None, :], other=0.0)

    # This split's share of the context, in whole tiles (attention.py's decode kernel's arithmetic).
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    m = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    page_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < ctx
        page = tl.load(page_row_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cb + (tok % BLOCK_SIZE) * stride_cs  # [BLOCK_N] row starts
        c = tl.load(rows[:, None] + dl[None, :], mask=tok_mask[:, None] & dl_mask[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + LATENT + dr[None, :], mask=tok_mask[:, None] & dr_mask[None, :], other=0.0)
        s = (_dot(q_lat, tl.trans(c), DOT_F32) + _dot(q_pe, tl.trans(k_pe), DOT_F32)) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None] + _dot(p, c, DOT_F32)  # the value is the same latent tile
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    io_mask = h_mask[:, None] & dl_mask[None, :]
    if SPLIT:  # every split writes its partial (an empty one: m = -1e30, l = 0, acc = 0, which weighs nothing)
        part = (row64 * n_heads + h) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * LATENT + dl[None, :], acc, mask=io_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=h_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=h_mask)
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # nothing visible: acc is 0, so the row is 0
        tl.store(out_ptr + row64 * stride_ot + h[:, None] * stride_oh + dl[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=io_mask)


@triton.jit
def _mla_combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, n_heads, num_splits, stride_ot, stride_oh,
                        LATENT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):
    pid = tl.program_id(0)  # = row * H + head: the partials' (row, head)
    row = pid // n_heads
    head = pid % n_heads
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_L)
    s_mask = s < num_splits
    d_mask = d < LATENT
    part = pid.to(tl.int64) * num_splits + s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=_NEG_BIG)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * LATENT + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def mla_latent_attention_impl(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                              query_start_loc: Tensor, seq_lens: Tensor, scale: float, *,
                              num_splits: int | None = None, block_n: int | None = None,
                              num_warps: int | None = None, num_stages: int | None = None) -> Tensor:
    """mla_latent_attention with the launch choices exposed (tests and benchmarks pin them; None = the default)."""
    n_rows, n_heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    n_reqs = seq_lens.shape[0]
    block_size = kv_cache.shape[1]
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != latent + rope:
        raise ValueError(f"latent cache [num_blocks, block_size, 1, L + R = {latent + rope}] expected, "
                         f"got {tuple(kv_cache.shape)}")
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    assert kv_cache.stride(-1) == 1, "the latent cache needs contiguous rows"
    # Every row is written (zeros where nothing is visible): no memset.
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if n_rows == 0:
        return out
    if n_reqs == 0:  # every row is padding
        return out.zero_()
    decode = n_rows == n_reqs  # shapes only, as paged_attention's kernel choice
    fp32_cache = kv_cache.dtype == torch.float32
    dot_f32 = fp32_cache or q_latent.device.type == "cpu"  # CPU = interpreter: no 16-bit dot
    # UNTUNED on a GPU: vLLM's MLA decode tile (BLOCK_H 16 x BLOCK_N 32 at L 512, 4 warps); fp32 halves BLOCK_N.
    block_n = block_n or (16 if fp32_cache else 32)
    n_htiles = cdiv(n_heads, _BLOCK_H)
    splits = num_splits or _num_splits(n_rows, n_htiles, block_tables.shape[1] * block_size, block_n)
    split = splits > 1
    part_acc = torch.empty((n_rows * n_heads * splits * latent) if split else 1, dtype=torch.float32,
                           device=q_latent.device)
    part_ml = torch.empty((n_rows * n_heads * splits * 2) if split else 1, dtype=torch.float32,
                          device=q_latent.device)
    block_l = max(16, next_power_of_2(latent))
    launch_kernel(_mla_kernel, (n_rows * n_htiles * splits,),
        q_latent, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, out, part_acc, part_ml,
        float(scale) * _LOG2E, n_reqs, n_heads, splits,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        LATENT=latent, ROPE=rope, BLOCK_SIZE=block_size, DECODE=decode, SPLIT=split, DOT_F32=dot_f32,
        BLOCK_H=_BLOCK_H, BLOCK_N=block_n, BLOCK_L=block_l, BLOCK_DR=max(16, next_power_of_2(rope)),
        BLOCK_R=_BLOCK_R, num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}))
    if split:
        launch_kernel(_mla_combine_kernel, (n_rows * n_heads,),
            part_acc, part_ml, out, n_heads, splits, out.stride(0), out.stride(1),
            LATENT=latent, BLOCK_S=next_power_of_2(splits), BLOCK_L=block_l, num_warps=4)
    return out


def mla_latent_attention(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                         query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """Causal multi-query attention of q_latent [T, H, L] / q_pe [T, H, R] over the latent cache rows -> [T, H, L]."""
    return mla_latent_attention_impl(q_latent, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale)
