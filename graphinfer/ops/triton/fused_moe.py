"""Triton fused MoE (`graphinfer::fused_moe`), in the style of vLLM's fused_moe, within the Triton-Ascend subset.

What it computes
----------------
``fused_moe(hidden [T,H], router_logits [T,E], w13 [E,2I,H], w2 [E,H,I], top_k, renormalize) -> [T,H]``::

    probs = softmax(router_logits.float(), -1); w, ids = topk(probs, top_k)
    if renormalize: w = w / w.sum(-1, keepdim=True)
    w = w.to(hidden.dtype)
    out[t] = sum_k w[t,k] * expert_{ids[t,k]}(hidden[t])
    expert_e(x) = (silu(x @ w13[e,:I].T) * (x @ w13[e,I:].T)) @ w2[e].T      (w13 = [gate; up])

Pipeline (no host syncs, no data-dependent shapes -> CUDA/ACL-graph capturable)
-------------------------------------------------------------------------------
1. routing: softmax / topk / renormalise with torch ops.
2. ``moe_align_block_size`` (torch ops): the T*K flat (token, k) rows are stably sorted by expert and
   every expert's segment is padded up to a multiple of BLOCK_M, as vLLM's moe_align_block_size does.
   The padded row count is upper-bounded by ``T*K + min(E, T*K) * (BLOCK_M - 1)`` so the buffers and the
   grids depend only on shapes; padding rows hold the sentinel ``T*K`` and blocks past the real end get
   expert id -1 and exit at once.
   ``sorted_ids[P]`` (flat row index t*K+k, or T*K = padding), ``block_expert[P / BLOCK_M]``.
3. kernel 1 ``_moe_gate_up_kernel``: grouped GEMM hidden x w13 per (block of BLOCK_M sorted rows, N tile of
   the intermediate dim): gate and up tiles are accumulated side by side in fp32 with ``tl.dot`` and
   ``silu(gate) * up`` is written (cast to the activation dtype) to ``inter[T*K, I]`` at each row's flat index.
4. kernel 2 ``_moe_down_kernel``: grouped GEMM inter x w2[e]^T per (block, N tile of H), fp32 accumulator
   scaled by the row's routing weight, written to ``out_k[T*K, H]`` at the flat (t, k) row; every flat row is
   written by exactly one program, so no atomics.
5. ``out_k.view(T, K, H).sum(1)`` with torch (fp32 accumulation inside torch's reduction).

Small T (decode): for T <= DECODE_MAX_TOKENS, steps 2-4 are replaced by two kernels without sorting or
padding, over a 1-D grid of (routed slot s = t*K + k, output tile): ``_moe_decode_gate_up_kernel``
(T*K * cdiv(I, 16) programs) and ``_moe_decode_down_kernel`` (T*K * cdiv(H, 16) programs). Each program
reads its slot's expert id from ``topk_ids`` on the device, streams the 16 weight rows of its tile once
in 256-wide K steps, and reduces them against the token's activation row with elementwise products
(fp32 partials, one reduction at the end; a 1-row tl.dot would pad M to 16). At T=1 that reads exactly
the K routed experts' weights (Qwen3-30B-A3B: 8 x 9.4 MB) with 384 + 1,024 programs, where the grouped
path pays the sort (a dozen small torch ops) and 16-row blocks for one real row. The grid depends only on
T*K, so it is capture-safe; a token routed with another to the same expert re-reads its weights (from L2
at these sizes), which is why the grouped path wins once T*K nears E.

Grids: both kernels use a 1-D grid of ``num_m_blocks * cdiv(N, BLOCK_N)`` programs (N = I for kernel 1,
N = H for kernel 2). The program id is decoded into (m block, n tile) with vLLM's GROUP_M swizzle: GROUP_M
consecutive m blocks (usually the same expert) sweep one n tile before moving on, so a weight tile is
re-read from L2 rather than HBM when an expert spans several blocks.

Block parameters (all ``tl.constexpr``): BLOCK_M (sorted rows per program, also the padding granule),
BLOCK_N, BLOCK_K (reduction step), GROUP_M (swizzle width); plus H, I, TOP_K (shapes), DOT_PRECISION and
UPCAST (see the accommodations below). ``get_default_config`` picks them from the
average number of rows per expert, ``T*K/E``:

* <= 16 rows/expert (decode; Qwen3-30B-A3B at T=1/64/256 gives 0.06/4/16): BLOCK_M=16 (smallest tl.dot
  tile, least padding waste), BLOCK_N=64, BLOCK_K=64, GROUP_M=1. The op is weight-bandwidth bound here;
  BLOCK_N=64 gives 12 n tiles for I=768 and 32 for H=2048, i.e. enough programs to cover 132 SMs
  even at T=1 (8 active blocks -> 96 / 256 programs) while each program streams two 64x64 weight tiles per K step.
* <= 48 rows/expert: BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4.
* larger (prefill): BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8 (compute bound, tensor-core sized tiles).
These are starting points for the H100 tuning; pass an explicit config to ``fused_experts`` to override.

Triton-Ascend accommodations
----------------------------
* 1-D grids only (the (m, n) grid is flattened and decoded from ``tl.program_id(0)``); the grid is
  ``<= 65535`` programs for the model sizes we target (Ascend's coreDim limit).
* no fp64 anywhere; ``tl.arange`` only over int ranges; every ragged access (token rows past the segment,
  the H / I tails, the padding rows) is masked, ``other=0``.
* block sizes are constexpr parameters (auto-tunable on Ascend), ``num_warps`` / ``num_stages`` are only
  passed on CUDA (Ascend ignores them).
* the weight base offset (expert * stride) is computed in int64 (stacked expert weights can exceed 2**31
  elements); all other index math stays int32 (Ascend's int64 vector ops degrade to scalar).
* H, I (and TOP_K) are constexpr, so the K-loop trip counts are compile-time ints: upstream Triton 3.6's
  interpreter refuses ``range(tl.cdiv(runtime_int, BLOCK))`` (under numpy 2 it cannot ``int()`` the
  1-element array it keeps for a scalar). They are fixed per model, so this costs one compile per layer shape.
* ``tl.dot``'s ``input_precision`` is "ieee" for fp32 and left at the backend default otherwise (Triton-Ascend
  rejects "tf32" and offers "hf32" instead).
* interpreter only (UPCAST constexpr, chosen when the kernels were decorated under TRITON_INTERPRET=1): both
  interpreters' ``tl.dot`` multiplies bf16 operands as their raw uint16 bit patterns, so bf16 tiles are cast
  to fp32 before the dot there; the products are exact in fp32 so the result is what the bf16 dot computes.
  Compiled kernels keep the native bf16 dot.
* the per-block early exit is an ``if expert >= 0:`` around the body (no early ``return``); blocks past the
  last used one have only padding rows, so with the body skipped they write nothing.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (m block, n tile) with GROUP_M m blocks sharing each n sweep."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    pid_m = first_m + local % group_size
    pid_n = local // group_size
    return pid_m, pid_n


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["num_rows", "num_m"])
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, inter_ptr, sorted_ids_ptr, block_expert_ptr,
    num_rows, num_m,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_it, stride_ii,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """inter[r, n] = silu(x[r // K] . w13[e, n]) * (x[r // K] . w13[e, I + n]) for the rows r of one block."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_m, num_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ids_ptr + offs_m)  # flat (t, k) index; num_rows marks padding
        row_mask = rows < num_rows
        tok = rows // TOP_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
        u_ptrs = g_ptrs + I * stride_wn

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(H, BLOCK_K)):
            k_mask = offs_k < H - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(g_ptrs, mask=w_mask, other=0.0)
            u = tl.load(u_ptrs, mask=w_mask, other=0.0)
            if UPCAST:  # interpreter only: its tl.dot multiplies bf16's raw uint16 bits
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K * stride_wh
            u_ptrs += BLOCK_K * stride_wh

        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        o_ptrs = inter_ptr + rows[:, None] * stride_it + offs_n[None, :] * stride_ii
        tl.store(o_ptrs, act.to(inter_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["num_rows", "num_m"])
def _moe_down_kernel(
    inter_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
    num_rows, num_m,
    stride_it, stride_ii, stride_we, stride_wn, stride_wk, stride_ot, stride_oh,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[r, n] = weight[r] * (inter[r] . w2[e, n]) for the rows r of one block."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_m, num_n, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(sorted_ids_ptr + offs_m)
        row_mask = rows < num_rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = inter_ptr + rows[:, None] * stride_it + offs_k[None, :] * stride_ii
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(I, BLOCK_K)):
            k_mask = offs_k < I - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ii
            w_ptrs += BLOCK_K * stride_wk

        rw = tl.load(weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
        o_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_oh
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _decode_slot_tile(N: tl.constexpr, BLOCK_N: tl.constexpr):
    """The small-T kernels' program: (routed slot, its BLOCK_N output rows of N, their mask)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid // num_n, offs_n, offs_n < N


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr, w13_ptr, inter_ptr, topk_ids_ptr,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_it, stride_ii,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small T: inter[s, n] = silu(x[s // K] . w13[e, n]) * (x[s // K] . w13[e, I + n]), e = topk_ids[s], for the
    BLOCK_N rows n of one output tile of one routed slot s = t * K + k."""
    slot, offs_n, n_mask = _decode_slot_tile(I, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K) * stride_xt
    g_ptrs = w13_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wh
    u_ptrs = g_ptrs + I * stride_wn
    # Products summed per lane across the K loop, reduced once at the end: [BLOCK_N, BLOCK_K] fp32 partials.
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in range(0, tl.cdiv(H, BLOCK_K)):
        k_mask = offs_k < H - kk * BLOCK_K
        x = tl.load(x_row + (kk * BLOCK_K + offs_k) * stride_xh, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc_g += g * x[None, :]
        acc_u += u * x[None, :]
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    gate = tl.sum(acc_g, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * tl.sum(acc_u, axis=1)
    tl.store(inter_ptr + slot * stride_it + offs_n * stride_ii, act.to(inter_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _moe_decode_down_kernel(
    inter_ptr, w2_ptr, out_ptr, weights_ptr, topk_ids_ptr,
    stride_it, stride_ii, stride_we, stride_wn, stride_wk, stride_ot, stride_oh,
    H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Small T: out[s, n] = weight[s] * (inter[s] . w2[e, n]), e = topk_ids[s], for one output tile of slot s."""
    slot, offs_n, n_mask = _decode_slot_tile(H, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
    a_row = inter_ptr + slot * stride_it
    w_ptrs = w2_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in range(0, tl.cdiv(I, BLOCK_K)):
        k_mask = offs_k < I - kk * BLOCK_K
        a = tl.load(a_row + (kk * BLOCK_K + offs_k) * stride_ii, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * a[None, :]
        w_ptrs += BLOCK_K * stride_wk
    rw = tl.load(weights_ptr + slot).to(tl.float32)
    tl.store(out_ptr + slot * stride_ot + offs_n * stride_oh, (tl.sum(acc, axis=1) * rw).to(out_ptr.dtype.element_ty),
             mask=n_mask)


DECODE_MAX_TOKENS = 8  # the small-T path up to this many tokens (see the module docstring)
_DECODE_BLOCK_N = 16  # output rows per small-T program
_DECODE_BLOCK_K = 256  # reduction step of the small-T kernels

_GATE_UP = Launcher(_moe_gate_up_kernel)
_DOWN = Launcher(_moe_down_kernel)
_DECODE_GATE_UP = Launcher(_moe_decode_gate_up_kernel)
_DECODE_DOWN = Launcher(_moe_decode_down_kernel)


def _interpreted() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (triton decides at @jit time)."""
    return not isinstance(_moe_gate_up_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=1024)
def _default_config(num_tokens: int, top_k: int, num_experts: int) -> tuple:
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return (("BLOCK_M", 16), ("BLOCK_N", 64), ("BLOCK_K", 64), ("GROUP_M", 1), ("num_warps", 4), ("num_stages", 4))
    if rows_per_expert <= 48:
        return (("BLOCK_M", 32), ("BLOCK_N", 64), ("BLOCK_K", 64), ("GROUP_M", 4), ("num_warps", 4), ("num_stages", 4))
    return (("BLOCK_M", 64), ("BLOCK_N", 128), ("BLOCK_K", 64), ("GROUP_M", 8), ("num_warps", 8), ("num_stages", 3))


def get_default_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """Block sizes by average rows per expert (see the module docstring for the reasoning)."""
    return dict(_default_config(num_tokens, top_k, num_experts))


@functools.lru_cache(maxsize=64)
def _launch_options(device_type: str, dtype: torch.dtype, num_warps: int, num_stages: int) -> tuple:
    """(num_warps/num_stages kwargs, DOT_PRECISION, UPCAST) for a device type and activation dtype, once.
    num_warps / num_stages are only passed on CUDA (Ascend ignores them). fp32 must not silently become tf32
    on GPUs; for 16-bit inputs leave the backend default (Ascend refuses "tf32", CUDA ignores the setting for
    bf16/fp16)."""
    launch = dict(num_warps=num_warps, num_stages=num_stages) if device_type == "cuda" else {}
    precision = "ieee" if dtype == torch.float32 else None
    return launch, precision, _interpreted() and dtype == torch.bfloat16


def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Sort the flat (token, k) rows by expert, padding every expert's segment to a multiple of block_m.

    Returns ``sorted_ids`` [num_blocks * block_m] int32 (flat row index t*K+k, or T*K for padding) and
    ``block_expert`` [num_blocks] int32 (the expert of each block, -1 past the last used block), where
    num_blocks = cdiv(T*K + min(E, T*K) * (block_m - 1), block_m) depends only on shapes.
    Torch ops only, no host sync.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    dest = pad_start[sorted_e] + torch.arange(num_rows, device=dev) - cnt_start[sorted_e]

    max_rows = num_rows + min(num_experts, num_rows) * (block_m - 1)
    num_blocks = cdiv(max_rows, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(num_blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _decode_experts(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The small-T path: one program per (routed slot, output tile), no sorting (see the module docstring)."""
    T, H = hidden.shape
    K = topk_ids.shape[1]
    I = w13.shape[1] // 2
    num_slots = T * K
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    ids, weights = (t if t.stride(0) == 1 else t.contiguous() for t in (ids, weights))
    launch = {"num_warps": 4} if hidden.device.type == "cuda" else {}
    hs, w13s, w2s = hidden.stride(), w13.stride(), w2.stride()

    inter = hidden.new_empty((num_slots, I))
    bn, bk = _DECODE_BLOCK_N, min(_DECODE_BLOCK_K, next_power_of_2(H))
    _DECODE_GATE_UP.launch((num_slots * cdiv(I, bn),), hidden, w13, inter, ids, hs[0], hs[1],
                           w13s[0], w13s[1], w13s[2], I, 1, H=H, I=I, TOP_K=K, BLOCK_N=bn, BLOCK_K=bk, **launch)
    out_k = hidden.new_empty((num_slots, H))
    bk = min(_DECODE_BLOCK_K, next_power_of_2(I))
    _DECODE_DOWN.launch((num_slots * cdiv(H, bn),), inter, w2, out_k, weights, ids, I, 1,
                        w2s[0], w2s[1], w2s[2], H, 1, H=H, I=I, BLOCK_N=bn, BLOCK_K=bk, **launch)
    return out_k.view(T, K, H).sum(dim=1)


def fused_experts(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                  config: dict | None = None, decode: bool | None = None) -> Tensor:
    """out[t] = sum_k topk_weights[t,k] * expert_{topk_ids[t,k]}(hidden[t]) with two Triton kernels.

    decode: the small-T path (True) or the grouped one (False); None picks the small-T path for
    T <= DECODE_MAX_TOKENS unless a grouped `config` is given. T is a static shape, so the choice is fixed
    per captured graph.
    """
    T, H = hidden.shape
    K = topk_ids.shape[1]
    E, two_i, H13 = w13.shape
    I = two_i // 2
    assert H13 == H and w2.shape == (E, H, I), (hidden.shape, w13.shape, w2.shape)
    if T == 0:
        return hidden.new_empty(0, H)
    if decode is None:
        decode = T <= DECODE_MAX_TOKENS and not config
    if decode:
        return _decode_experts(hidden, topk_weights, topk_ids, w13, w2)
    if not config:
        bm, bn, bk, gm, num_warps, num_stages = (v for _, v in _default_config(T, K, E))
    else:
        bm, bn, bk, gm = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["GROUP_M"]
        num_warps, num_stages = config.get("num_warps", 4), config.get("num_stages", 3)
    launch, precision, upcast = _launch_options(hidden.device.type, hidden.dtype, num_warps, num_stages)

    num_rows = T * K
    sorted_ids, block_expert = moe_align_block_size(topk_ids, E, bm)
    num_m = block_expert.shape[0]
    weights = topk_weights.reshape(-1)
    if weights.stride(0) != 1:
        weights = weights.contiguous()
    hs, w13s, w2s = hidden.stride(), w13.stride(), w2.stride()

    inter = hidden.new_empty((num_rows, I))
    _GATE_UP.launch(
        (num_m * cdiv(I, bn),), hidden, w13, inter, sorted_ids, block_expert, num_rows, num_m,
        hs[0], hs[1], w13s[0], w13s[1], w13s[2], I, 1,
        H=H, I=I, TOP_K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, DOT_PRECISION=precision, UPCAST=upcast,
        **launch)
    out_k = hidden.new_empty((num_rows, H))
    _DOWN.launch(
        (num_m * cdiv(H, bn),), inter, w2, out_k, weights, sorted_ids, block_expert, num_rows, num_m,
        I, 1, w2s[0], w2s[1], w2s[2], H, 1,
        H=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, DOT_PRECISION=precision, UPCAST=upcast, **launch)
    return out_k.view(T, K, H).sum(dim=1)


def fused_experts_op(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The `graphinfer::fused_experts` contract (routing given: expert parallel's local experts)."""
    return fused_experts(hidden, topk_weights, topk_ids, w13, w2)


def fused_moe(hidden: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool) -> Tensor:
    """The `graphinfer::fused_moe` contract: softmax/top-k routing (torch) + the Triton expert GEMMs."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    topk_weights = topk_weights.to(hidden.dtype)
    return fused_experts(hidden, topk_weights, topk_ids, w13, w2)
