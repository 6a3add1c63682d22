"""The cpu platform's few-row dense linear (csrc/cpu/gemv.cpp): y = x W^T + b for up to MAX_ROWS rows of x, on an
fp32 or bf16 weight as the model holds it. Batch-1 decode reads every weight once a step; this kernel streams it
with a call cost of a few microseconds (oneDNN's prepacked matmul costs ~30 us a call at one row).
compiler/cpu_packed_linear.py sends such calls here and larger ones to oneDNN.
"""
import functools

import torch
from torch import Tensor

from graphinfer.ops.cpu import ext

MAX_ROWS = 4  # the kernel's kMaxRows


@functools.cache
def available() -> bool:  # a library built before the kernel existed lacks it
    return ext.available() and hasattr(torch.ops.graphinfer_cpu, "gemv")


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] with at most MAX_ROWS rows, weight [N, K] contiguous (fp32 or bf16) -> [..., N] in x's dtype;
    fp32 products and sums (a bf16 weight is widened exactly)."""
    return torch.ops.graphinfer_cpu.gemv(x, weight, bias)  # leading dims handled in C++: cheaper per call
