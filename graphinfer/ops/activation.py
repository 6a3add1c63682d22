"""SwiGLU activation: the gate half goes through SiLU and multiplies the up half."""
import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("graphinfer::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns silu(gate) * up, [..., d] (vLLM's layout)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
