"""KV-cache write kernel: reshape_and_cache scatters key/value [T, Hkv, D] into the paged caches.

Cache layout [num_blocks, block_size, Hkv, D]; token t goes to slot_mapping[t] = block * block_size + offset.
One program per token copies its [BLOCK_H, BLOCK_D] key and value tiles: grid = T, 1-D. Slot -1 (a padded
row) is a masked-off store rather than a branch, so captured graphs need no host check. Slots are widened
to int64 before scaling by the block stride: a layer's cache can exceed 2^31 elements.
Triton-Ascend: 1-D grid of T (<= 65535 tokens per step), masked head/dim tails, no control flow.
"""
import triton
import triton.language as tl
from torch import Tensor


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


def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write key/value [T, num_kv_heads, head_size] into the paged caches at slot_mapping [T]; skip slot -1."""
    n_tokens, n_heads, head_size = key.shape
    if n_tokens == 0:
        return None
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a contiguous head dim"
    _reshape_and_cache_kernel[(n_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, n_heads, head_size, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(head_size), num_warps=4)
    return None
