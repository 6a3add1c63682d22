"""KV-cache write kernel: reshape_and_cache scatters key/value [T, Hkv, D] into the paged caches.

Cache layout [num_blocks, block_size, Hkv, D]; token t goes to slot_mapping[t] = block * block_size + offset.
One program per token copies its [BLOCK_H, BLOCK_D] key and value tiles: grid = T, 1-D. Slot -1 (a padded
row) is a masked-off store rather than a branch, so captured graphs need no host check. Slots are widened
to int64 before scaling by the block stride: a layer's cache can exceed 2^31 elements.
Triton-Ascend: 1-D grid of T (<= 65535 tokens per step), masked head/dim tails, no control flow.
"""
import functools

import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, next_power_of_2


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                              n_heads, head_size, block_size,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)  # keep the (masked-off) address of a skipped row in range
    block, offset = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = keep & (heads < n_heads)[:, None] & (d < head_size)[None, :]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    k_dst = key_cache_ptr + block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + d[None, :]
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + d[None, :]
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


_RESHAPE_AND_CACHE = Launcher(_reshape_and_cache_kernel)


@functools.lru_cache(maxsize=256)
def _blocks(n_heads: int, head_size: int) -> tuple[int, int]:
    return next_power_of_2(n_heads), next_power_of_2(head_size)


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write key/value [T, num_kv_heads, head_size] into the paged caches at slot_mapping [T]; skip slot -1."""
    n_tokens, n_heads, head_size = key.shape
    if n_tokens == 0:
        return None
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    ks, vs, kcs, vcs = key.stride(), value.stride(), key_cache.stride(), value_cache.stride()
    assert kcs[-1] == 1 and vcs[-1] == 1, "caches need a contiguous head dim"
    block_h, block_d = _blocks(n_heads, head_size)
    _RESHAPE_AND_CACHE.launch(
        (n_tokens,), key, value, key_cache, value_cache, slot_mapping, n_heads, head_size, key_cache.shape[1],
        ks[0], ks[1], vs[0], vs[1], kcs[0], kcs[1], kcs[2], vcs[0], vcs[1], vcs[2],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return None


@triton.jit
def _concat_and_cache_mla_kernel(kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, lora_rank, rope_dim, block_size,
                                 stride_ct, stride_pt, stride_cb, stride_cs,
                                 BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)
    row = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    c = tl.arange(0, BLOCK_L)
    c_mask = keep & (c < lora_rank)
    x = tl.load(kv_c_ptr + token * stride_ct + c, mask=c_mask)
    tl.store(row + c, x.to(cache_ptr.dtype.element_ty), mask=c_mask)
    r = tl.arange(0, BLOCK_R)
    r_mask = keep & (r < rope_dim)
    y = tl.load(k_pe_ptr + token * stride_pt + r, mask=r_mask)
    tl.store(row + lora_rank + r, y.to(cache_ptr.dtype.element_ty), mask=r_mask)


_CONCAT_AND_CACHE_MLA = Launcher(_concat_and_cache_mla_kernel)


def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write [kv_c (T, L), k_pe (T, R)] rows into the latent cache [num_blocks, block_size, 1, L + R] at slot_mapping;
    skip slot -1 (MLA's one-plane cache: one program per token, as reshape_and_cache)."""
    n_tokens, lora_rank = kv_c.shape
    if n_tokens == 0:
        return None
    if kv_c.stride(-1) != 1:
        kv_c = kv_c.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    rope_dim, cs = k_pe.shape[-1], kv_cache.stride()
    assert cs[-1] == 1 and kv_cache.shape[-1] == lora_rank + rope_dim, "cache rows must be [kv_c, k_pe], contiguous"
    _CONCAT_AND_CACHE_MLA.launch(
        (n_tokens,), kv_c, k_pe, kv_cache, slot_mapping, lora_rank, rope_dim, kv_cache.shape[1],
        kv_c.stride(0), k_pe.stride(0), cs[0], cs[1], BLOCK_L=next_power_of_2(lora_rank),
        BLOCK_R=next_power_of_2(rope_dim), num_warps=4)
    return None
