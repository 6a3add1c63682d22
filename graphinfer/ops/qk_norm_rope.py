"""QK-norm + RoPE (Qwen3 attention's prologue) as one op: split the fused qkv projection's output, RMSNorm
each query and key head, rotate them by position; vLLM's `fused_qk_norm_rope`, vLLM-Ascend's
`split_qkv_rmsnorm_rope`. The fuse_qknorm_rope pass produces it; models never call it directly.

The reference is the unfused chain itself (rms_norm's and rotary_embedding's references), so the pass's
numeric check compares like with like. Unlike vLLM's in-place op it returns new tensors, v included: an op
may not return a view of its input, and v copied out contiguously is what the KV-cache write reads next.

`qk_norm_rope_cache` is the same op followed by that KV-cache write (reshape_and_cache: paged caches, slot -1
skipped), folded in by the pass where k and v feed only the write: it returns q alone, as attention reads k and
v from the cache. One launch per layer instead of two, and k, v never round-trip through memory.
"""
from collections.abc import Callable

import torch
from torch import Tensor

from graphinfer.ops.attention import reshape_and_cache
from graphinfer.ops.library import graphinfer_op, register_fake
from graphinfer.ops.norm import rms_norm_ref
from graphinfer.ops.rotary import rotary_ref


@graphinfer_op()
def qk_norm_rope(qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor,
                 k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                 is_neox: bool) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [T, (num_heads + 2 * num_kv_heads) * head_size] -> q [T, num_heads * head_size], k and v
    [T, num_kv_heads * head_size]: q and k RMSNormed per head (weights [head_size], one eps) then rotated as
    rotary_embedding does (cos_sin_cache [max_position, rot_dim]); v copied."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    q = rms_norm_ref(q.view(T, num_heads, head_size), q_weight, eps).view(T, -1)
    k = rms_norm_ref(k.view(T, num_kv_heads, head_size), k_weight, eps).view(T, -1)
    return (rotary_ref(q, positions, head_size, cos_sin_cache, is_neox),
            rotary_ref(k, positions, head_size, cos_sin_cache, is_neox),
            v.clone(memory_format=torch.contiguous_format))


@register_fake(qk_norm_rope)
def _(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox):
    T = qkv.shape[0]
    return (qkv.new_empty(T, num_heads * head_size), qkv.new_empty(T, num_kv_heads * head_size),
            qkv.new_empty(T, num_kv_heads * head_size))


def chain_cache_write(qk_norm_rope_impl: Callable, reshape_and_cache_impl: Callable, module: str) -> Callable:
    """qk_norm_rope_cache as the two ops it fuses, from an implementation of each: the reference below, and the
    platforms without a fused kernel for it (cpu, torch_npu). module: the caller's, where Platform.kernels reports
    the implementation to come from."""
    def qk_norm_rope_cache(qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor,
                           k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor, is_neox: bool,
                           key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> Tensor:
        """qk_norm_rope, then k and v written into the paged caches [num_blocks, block_size, num_kv_heads,
        head_size] at slot_mapping [T] (slot -1: skipped), as reshape_and_cache does; returns q."""
        q, k, v = qk_norm_rope_impl(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions,
                                    cos_sin_cache, is_neox)
        heads = (qkv.shape[0], num_kv_heads, head_size)
        reshape_and_cache_impl(k.view(heads), v.view(heads), key_cache, value_cache, slot_mapping)
        return q
    qk_norm_rope_cache.__module__ = module
    return qk_norm_rope_cache


qk_norm_rope_cache = graphinfer_op(mutates_args=("key_cache", "value_cache"))(
    chain_cache_write(qk_norm_rope.reference, reshape_and_cache.reference, __name__))


@register_fake(qk_norm_rope_cache)
def _(qkv, num_heads, num_kv_heads, head_size, q_weight, k_weight, eps, positions, cos_sin_cache, is_neox,
      key_cache, value_cache, slot_mapping):
    return qkv.new_empty(qkv.shape[0], num_heads * head_size)
