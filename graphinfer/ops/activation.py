"""Gated activations (vLLM's SiluAndMul, GeluAndMul): the gate half goes through the activation and multiplies
the up half."""
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op(row_wise=True)
def silu_and_mul(x: Tensor) -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns silu(gate) * up, [..., d] (vLLM's layout)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@register_fake(silu_and_mul)
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@graphinfer_op(row_wise=True)
def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns gelu(gate, approximate) * up, [..., d]. approximate is F.gelu's:
    "none" (erf) or "tanh" (Gemma's gelu_pytorch_tanh)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


@register_fake(gelu_and_mul)
def _(x, approximate="none"):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
