"""SwiGLU activation: the gate half goes through SiLU and multiplies the up half."""
import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op()
def silu_and_mul(x: Tensor) -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns silu(gate) * up, [..., d] (vLLM's layout)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@register_fake(silu_and_mul)
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
