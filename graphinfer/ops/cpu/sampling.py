"""Greedy sampling on the cpu platform (csrc/cpu/sampling.cpp): each row's argmax over the logits in their own
dtype, the index torch.max(dim=-1) returns, in one vectorised pass (ATen's max(dim) over a batch-64 step's bf16 logits
cost ~3.5 % of the step). Where the library is missing or the logits are not contiguous rows, torch.max runs.
"""
import functools

import torch
from torch import Tensor

from graphinfer.ops.cpu import ext


@functools.cache
def available() -> bool:  # a library built before the kernel existed lacks it
    return ext.available() and hasattr(torch.ops.graphinfer_cpu, "argmax_rows")


def argmax(logits: Tensor) -> Tensor:
    """logits [rows, vocab] -> int64 [rows]: the first maximum of each row (a row's first NaN, if it has one)."""
    if (available() and logits.device.type == "cpu" and logits.dim() == 2 and logits.is_contiguous()
            and logits.shape[1] > 0 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return torch.ops.graphinfer_cpu.argmax_rows(logits)
    return logits.max(dim=-1).indices
