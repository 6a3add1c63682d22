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
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, next_power_of_2


@triton.jit
def rotary_layout(d, rot_dim, IS_NEOX: tl.constexpr):
    """For head-dim offsets d: (first half of a rotated pair, its partner offset, its frequency index, rotated)."""
    half = rot_dim // 2
    if IS_NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        freq = tl.where(first, d, d - half)
    else:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    return first, partner, freq, d < rot_dim


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, n_heads, stride_t, stride_h, head_size, rot_dim, cos_ptr,
                  IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = rot_dim // 2
    first, partner, freq, rotates = rotary_layout(d, rot_dim, IS_NEOX)
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


_ROTARY = Launcher(_rotary_kernel)


@functools.lru_cache(maxsize=256)
def _blocks(n_q_heads: int, n_k_heads: int, head_size: int) -> tuple[int, int, int]:
    return next_power_of_2(n_q_heads), next_power_of_2(n_k_heads), next_power_of_2(head_size)


def _heads(x: Tensor, head_size: int) -> tuple[Tensor, int, int, int]:
    """x [T, H*D] or [T, H, D] -> (x, H, token stride, head stride) with a unit last stride; no view made."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    strides = x.stride()
    if x.dim() == 2:
        return x, x.shape[1] // head_size, strides[0], head_size
    if x.dim() == 3 and x.shape[2] == head_size:
        return x, x.shape[1], strides[0], strides[1]
    try:
        x = x.view(x.shape[0], -1, head_size)
    except RuntimeError:
        x = x.reshape(x.shape[0], -1, head_size)
    return x, x.shape[1], x.stride(0), x.stride(1)


def _empty_like(x: Tensor) -> Tensor:
    """A new contiguous tensor of x's shape and dtype."""
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor]:
    """Rotate query [T, Hq * head_size] (or [T, Hq, head_size]) and key likewise by each token's position."""
    q_out, k_out = _empty_like(query), _empty_like(key)
    n_tokens = query.shape[0]
    if n_tokens == 0:
        return q_out, k_out
    q, n_q_heads, stride_qt, stride_qh = _heads(query, head_size)
    k, n_k_heads, stride_kt, stride_kh = _heads(key, head_size)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    block_hq, block_hk, block_d = _blocks(n_q_heads, n_k_heads, head_size)
    _ROTARY.launch((n_tokens,), positions, q, k, q_out, k_out, cos_sin_cache, n_q_heads, n_k_heads,
                   stride_qt, stride_qh, stride_kt, stride_kh, cos_sin_cache.stride(0), head_size,
                   cos_sin_cache.shape[-1], IS_NEOX=bool(is_neox), BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
                   BLOCK_D=block_d, num_warps=4)
    return q_out, k_out
