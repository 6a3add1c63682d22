"""graphinfer::apply_token_bitmask: structured outputs' grammar mask on the logits (runtime/structured_output/).

The bitmask has xgrammar's layout: int32 [B, ceil(V / 32)], token j of row i allowed where bit j % 32 of word j // 32
is set (xgr.allocate_token_bitmask / fill_next_token_bitmask). The op writes -inf into logits[i, j] wherever that bit
is clear, in place, so every sampler path after it (argmax, the fused kernel, the torch filters, logprobs) reads the
masked logits. Bits past V (the last word's padding) are ignored.
"""
import torch
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op(mutates_args=("logits",))
def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """logits [B, V] (any float dtype), bitmask [B, >= ceil(V / 32)] int32. Reference: unpack the bits, masked_fill."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    blocked = ((bitmask[:, :, None] >> shifts) & 1).eq(0).flatten(1)[:, :logits.shape[-1]]
    logits.masked_fill_(blocked, float("-inf"))


@register_fake(apply_token_bitmask)
def _(logits, bitmask):
    return None
