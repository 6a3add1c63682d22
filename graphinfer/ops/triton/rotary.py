"""Rotary embedding kernel: rotate query and key heads by each token's position (neox or gptj pairs).

One program per token handles all its query heads and then all its key heads, each as a
[BLOCK_H, BLOCK_D] tile: grid = T, 1-D. cos_sin_cache is [max_position, rot_dim] = cat(cos, sin); the
first rot_dim channels of a head rotate, the rest (partial rotary) pass through. Rather than slicing
halves or interleaved pairs (strided slices and reshapes are awkward on Triton-Ascend), every channel d
loads its rotation partner p(d) and its frequency index directly:
  neox: p(d) = d +- rot_dim/2,  freq = d mod rot_dim/2,  out = x*cos - x[p]*sin (first half), + (second)
  gptj: p(d) = d xor 1,         freq = d // 2,           out = x*cos - x[p]*sin (even d),     + (odd d)
Outputs are new contiguous tensors of the input's shape ([T, H*D] or [T, H, D]), as the reference returns.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, n_heads, stride_t, stride_h, head_size, rot_dim, cos_ptr,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = rot_dim // 2
    if IS_NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        freq = tl.where(first, d, d - half)
    else:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    rotates = d < rot_dim
    # The reference casts cos/sin to the activation dtype before using them.
    act_dtype = src_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + freq, mask=rotates, other=1.0).to(act_dtype).to(tl.float32)
    sin = tl.load(cos_ptr + half + freq, mask=rotates, other=0.0).to(act_dtype).to(tl.float32)
    sin = tl.where(first, -sin, sin)

    head_mask = heads < n_heads
    mask = head_mask[:, None] & (d < head_size)[None, :]
    base = src_ptr + token * stride_t + heads[:, None] * stride_h
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_p = tl.load(base + partner[None, :], mask=head_mask[:, None] & rotates[None, :], other=0.0).to(tl.float32)
    out = x * cos[None, :] + x_p * sin[None, :]  # cos=1, sin=0 past rot_dim: the tail passes through
    dst = dst_ptr + token * n_heads * head_size + heads[:, None] * head_size + d[None, :]
    tl.store(dst, out.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
                   n_q_heads, n_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
                   head_size, rot_dim, IS_NEOX: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    cos_ptr = cache_ptr + tl.load(pos_ptr + token).to(tl.int64) * stride_cache
    _rotate_heads(q_ptr, q_out_ptr, token, n_q_heads, stride_qt, stride_qh, head_size, rot_dim, cos_ptr,
                  IS_NEOX, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, k_out_ptr, token, n_k_heads, stride_kt, stride_kh, head_size, rot_dim, cos_ptr,
                  IS_NEOX, BLOCK_HK, BLOCK_D)


def _heads_view(x: Tensor, head_size: int) -> Tensor:
    """[T, H*D] or [T, H, D] -> [T, H, D] with a unit last stride (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(x.shape[0], -1, head_size)
    except RuntimeError:
        return x.reshape(x.shape[0], -1, head_size)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor]:
    """Rotate query [T, Hq * head_size] (or [T, Hq, head_size]) and key likewise by each token's position."""
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    n_tokens = query.shape[0]
    if n_tokens == 0:
        return q_out, k_out
    q, k = _heads_view(query, head_size), _heads_view(key, head_size)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    _rotary_kernel[(n_tokens,)](
        positions, q, k, q_out, k_out, cos_sin_cache, q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        head_size, cos_sin_cache.shape[-1], IS_NEOX=bool(is_neox),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(head_size), num_warps=4)
    return q_out, k_out
