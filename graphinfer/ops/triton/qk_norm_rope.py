"""QK-norm + RoPE kernel: one launch for qk_norm_rope (split the fused qkv, RMSNorm q/k heads, rotate, copy v).

A token's row of the fused qkv output is (num_heads + 2 * num_kv_heads) heads of head_size contiguous
channels: q heads, then k heads, then v heads. A program takes BLOCK_H consecutive heads of one token as a
[BLOCK_H, BLOCK_D] tile, whichever of q, k, v they are: grid = T * cdiv(total heads, BLOCK_H), 1-D. Each
head row is normalised with its own rstd and its weight (q's or k's, chosen per row), rotated as the rotary
kernel does (every channel d loads its partner p(d) directly, see rotary.py), and stored to q_out or
k_out; v rows are copied to v_out. Rounding follows the reference chain: normalise in fp32, cast to the
activation dtype, scale by the weight and cast again (the unfused graph materialises both), cos/sin cast
to the activation dtype; the rotation itself in fp32 with one final rounding, as the rotary kernel.
WRITE_CACHE (qk_norm_rope_cache): k and v rows go to the paged caches at the token's slot instead of k_out /
v_out, as reshape_and_cache writes them (cast to the cache dtype; slot -1 a masked-off store, no branch).
Triton-Ascend: 1-D grid kept <= 65535 by widening BLOCK_H, masked head/channel tails, clamped (masked-off)
addresses, no control flow but the constexpr WRITE_CACHE; a tile of 2,048 elements keeps the few fp32
temporaries well inside the UB.
"""
import functools

import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2
from graphinfer.ops.triton.rotary import rotary_layout

_TILE = 2048  # elements per program: 16 heads of 128 (Qwen3), 32 of 64
_MAX_GRID = 65535  # Triton-Ascend's grid limit


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, cache_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                         key_cache_ptr, value_cache_ptr, slot_ptr,
                         n_q_heads, n_kv_heads, head_size, rot_dim, n_head_blocks, stride_t, stride_cache, eps,
                         block_size, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                         IS_NEOX: tl.constexpr, WRITE_CACHE: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    token = (pid // n_head_blocks).to(tl.int64)
    heads = (pid % n_head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n_qk = n_q_heads + n_kv_heads
    is_q = heads < n_q_heads
    is_k = (heads >= n_q_heads) & (heads < n_qk)
    is_v = (heads >= n_qk) & (heads < n_qk + n_kv_heads)
    in_head = d < head_size
    half = rot_dim // 2
    first, partner, freq, rotates = rotary_layout(d, rot_dim, IS_NEOX)

    row = qkv_ptr + token * stride_t + heads[:, None] * head_size
    x = tl.load(row + d[None, :], mask=(is_q | is_k | is_v)[:, None] & in_head[None, :], other=0.0).to(tl.float32)
    x_p = tl.load(row + partner[None, :], mask=(is_q | is_k)[:, None] & rotates[None, :], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / head_size + eps)

    act = q_out_ptr.dtype.element_ty
    w = tl.where(is_q[:, None], tl.load(q_w_ptr + d, mask=in_head, other=0.0).to(tl.float32)[None, :],
                 tl.load(k_w_ptr + d, mask=in_head, other=0.0).to(tl.float32)[None, :])
    w_p = tl.where(is_q[:, None], tl.load(q_w_ptr + partner, mask=rotates, other=0.0).to(tl.float32)[None, :],
                   tl.load(k_w_ptr + partner, mask=rotates, other=0.0).to(tl.float32)[None, :])
    normed = ((x * rstd[:, None]).to(act).to(tl.float32) * w).to(act).to(tl.float32)
    normed_p = ((x_p * rstd[:, None]).to(act).to(tl.float32) * w_p).to(act).to(tl.float32)

    cos_ptr = cache_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cache
    cos = tl.load(cos_ptr + freq, mask=rotates, other=1.0).to(act).to(tl.float32)
    sin = tl.load(cos_ptr + half + freq, mask=rotates, other=0.0).to(act).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    out = (normed * cos[None, :] + normed_p * sin[None, :]).to(act)  # cos=1, sin=0 past rot_dim: tail passes

    q_dst = q_out_ptr + token * n_q_heads * head_size + heads[:, None] * head_size + d[None, :]
    tl.store(q_dst, out, mask=is_q[:, None] & in_head[None, :])
    k_heads = tl.maximum(heads - n_q_heads, 0)  # clamped: rows of other kinds stay in range (masked off)
    v_heads = tl.maximum(heads - n_qk, 0)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + token).to(tl.int64)  # int64: a layer's cache can exceed 2^31 elements
        keep = slot >= 0
        slot = tl.maximum(slot, 0)  # a skipped row's (masked-off) address stays in range
        block, offset = slot // block_size, slot % block_size
        k_dst = (key_cache_ptr + block * stride_kcb + offset * stride_kcs + k_heads[:, None] * stride_kch
                 + d[None, :])
        tl.store(k_dst, out.to(key_cache_ptr.dtype.element_ty), mask=keep & is_k[:, None] & in_head[None, :])
        v_dst = (value_cache_ptr + block * stride_vcb + offset * stride_vcs + v_heads[:, None] * stride_vch
                 + d[None, :])
        tl.store(v_dst, x.to(act).to(value_cache_ptr.dtype.element_ty), mask=keep & is_v[:, None] & in_head[None, :])
    else:
        k_dst = k_out_ptr + token * n_kv_heads * head_size + k_heads[:, None] * head_size + d[None, :]
        tl.store(k_dst, out, mask=is_k[:, None] & in_head[None, :])
        v_dst = v_out_ptr + token * n_kv_heads * head_size + v_heads[:, None] * head_size + d[None, :]
        tl.store(v_dst, x.to(act), mask=is_v[:, None] & in_head[None, :])


_QK_NORM_ROPE = Launcher(_qk_norm_rope_kernel)


@functools.lru_cache(maxsize=4096)
def _launch_params(n_tokens: int, n_heads: int, head_size: int) -> tuple[tuple[int], int, int, int]:
    """(grid, n_head_blocks, BLOCK_H, BLOCK_D), once per shape."""
    block_d = next_power_of_2(head_size)
    max_block_h = next_power_of_2(n_heads)
    block_h = max(1, min(_TILE // block_d, max_block_h))
    while n_tokens * cdiv(n_heads, block_h) > _MAX_GRID and block_h < max_block_h:
        block_h *= 2
    n_head_blocks = cdiv(n_heads, block_h)
    return (n_tokens * n_head_blocks,), n_head_blocks, block_h, block_d


def _launch(qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor, k_weight: Tensor,
            eps: float, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool, q_out: Tensor, k_out: Tensor,
            v_out: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, write_cache: bool) -> None:
    """One launch of the kernel for either op (the outputs it does not write are stand-ins, never touched)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    kcs, vcs = key_cache.stride(), value_cache.stride()
    grid, n_head_blocks, block_h, block_d = _launch_params(qkv.shape[0], num_heads + 2 * num_kv_heads, head_size)
    _QK_NORM_ROPE.launch(grid, qkv, q_weight, k_weight, positions, cos_sin_cache, q_out, k_out, v_out, key_cache,
                         value_cache, slot_mapping, num_heads, num_kv_heads, head_size, cos_sin_cache.shape[-1],
                         n_head_blocks, qkv.stride(0), cos_sin_cache.stride(0), eps, key_cache.shape[1],
                         kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2], IS_NEOX=bool(is_neox),
                         WRITE_CACHE=write_cache, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


def qk_norm_rope(qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor,
                 k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                 is_neox: bool) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [T, (num_heads + 2 * num_kv_heads) * head_size] -> q [T, num_heads * head_size], k and v
    [T, num_kv_heads * head_size]: q and k RMSNormed per head then rotated; v copied."""
    n_tokens = qkv.shape[0]
    q_out = qkv.new_empty((n_tokens, num_heads * head_size))
    k_out = qkv.new_empty((n_tokens, num_kv_heads * head_size))
    v_out = qkv.new_empty((n_tokens, num_kv_heads * head_size))
    if n_tokens:
        stand_in = k_out.view(n_tokens, 1, num_kv_heads, head_size)  # for the caches: 4-D strides, never written
        _launch(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox,
                q_out, k_out, v_out, stand_in, stand_in, positions, write_cache=False)
    return q_out, k_out, v_out


def qk_norm_rope_cache(qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor,
                       k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
                       key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """qk_norm_rope whose k and v go into the paged caches [num_blocks, block_size, num_kv_heads, head_size] at
    slot_mapping [T] (slot -1 skipped) instead of out; returns q [T, num_heads * head_size]."""
    n_tokens = qkv.shape[0]
    q_out = qkv.new_empty((n_tokens, num_heads * head_size))
    if n_tokens:
        assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a contiguous head dim"
        _launch(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox,
                q_out, q_out, q_out, key_cache, value_cache, slot_mapping, write_cache=True)
    return q_out
