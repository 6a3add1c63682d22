"""RMSNorm ops. The reference follows HF's LlamaRMSNorm exactly: normalise in fp32, cast back, scale."""
import torch
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@graphinfer_op(row_wise=True)
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise the last dimension of x (any leading shape) and scale by weight."""
    return rms_norm_ref(x, weight, eps)


@register_fake(rms_norm)
def _(x, weight, eps):
    return torch.empty_like(x)


@graphinfer_op(row_wise=True)
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'): the pre-norm decoder's two outputs."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


@register_fake(add_rms_norm)
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)
