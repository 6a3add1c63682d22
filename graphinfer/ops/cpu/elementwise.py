"""CPU implementations of the row-wise ops (rms_norm, add_rms_norm, rotary_embedding, silu_and_mul): the C++
kernels of csrc/cpu/elementwise.cpp, one pass over the rows instead of a chain of ATen ops (at batch 1 the chains
cost more than their arithmetic). Where the library is missing or an input does not fit the kernel (strided rows
other than rotary's q/k slices, a weight in another dtype), the PyTorch reference runs. The kernels round where
the reference does (results within one rounding of it).
"""
import functools

import torch
from torch import Tensor

from graphinfer.ops.cpu import ext
from graphinfer.ops.activation import silu_and_mul
from graphinfer.ops.norm import add_rms_norm, rms_norm
from graphinfer.ops.rotary import rotary_embedding


@functools.cache
def _built() -> bool:  # a library built before these kernels existed has the attention ops only
    return ext.available() and hasattr(torch.ops.graphinfer_cpu, "silu_and_mul")


def _native(*tensors: Tensor) -> bool:
    return _built() and all(t.is_contiguous() for t in tensors)


def _token_major(t: Tensor) -> bool:
    """Each token's heads contiguous, rows at any stride: the q/k slices of a fused qkv output qualify."""
    return t.dim() >= 2 and (t.shape[0] == 0 or t[0].is_contiguous())


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _native(x, weight) and weight.dtype == x.dtype:
        return torch.ops.graphinfer_cpu.rms_norm(x, weight, eps)
    return rms_norm.reference(x, weight, eps)


def add_rms_norm_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if _native(x, residual, weight) and x.dtype == residual.dtype == weight.dtype and x.shape == residual.shape:
        return torch.ops.graphinfer_cpu.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm.reference(x, residual, weight, eps)


def rotary_embedding_cpu(positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                         is_neox: bool) -> tuple[Tensor, Tensor]:
    if _native(cos_sin_cache) and query.dtype == key.dtype and _token_major(query) and _token_major(key):
        return torch.ops.graphinfer_cpu.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    return rotary_embedding.reference(positions, query, key, head_size, cos_sin_cache, is_neox)


def silu_and_mul_cpu(x: Tensor) -> Tensor:
    if _native(x):
        return torch.ops.graphinfer_cpu.silu_and_mul(x)
    return silu_and_mul.reference(x)


CPU_ELEMENTWISE_OPS = {"rms_norm": rms_norm_cpu, "add_rms_norm": add_rms_norm_cpu,
                       "rotary_embedding": rotary_embedding_cpu, "silu_and_mul": silu_and_mul_cpu}
