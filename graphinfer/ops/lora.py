"""LoRA ops: the two halves of a batched multi-adapter LoRA delta (Punica's SGMV / BGMV split, vLLM's names).

A LoRA'd linear computes y = base(x), then y + B_a (A_a x) per token with that token's adapter a. The adapters live
in fixed slots (capture-safe: shapes never depend on which adapters are loaded):
  - lora_a [S, n, R, in]: S = max_loras slots, n = output slices of the base linear (3 for a fused qkv, 2 for
    gate_up, 1 otherwise), R = max_lora_rank (an adapter of rank r < R is zero-padded beyond r);
  - lora_b [S, out, R]: each slice's B rows at that slice's columns of the output, the scaling alpha / r folded in;
  - token_lora_indices int64 [>= T]: a persistent buffer (the model runner's), only its first T = x.shape[0]
    entries read; values in [-1, S), -1 = no adapter.

lora_shrink(x, lora_a, idx) -> buf fp32 [T, n, R]: buf[t, s] = lora_a[idx[t], s] @ x[t] accumulated in fp32, zeros
where idx[t] == -1. lora_expand(y, buf, lora_b, idx, slice_sizes) -> z [T, out] in y's dtype (a new tensor):
z[t, j] = y[t, j] + lora_b[idx[t], j] . buf[t, s(j)] in fp32, rounded once; z[t] = y[t] exactly where idx[t] == -1.
Column j belongs to slice s where sum(slice_sizes[:s]) <= j < sum(slice_sizes[:s + 1]).

Both are functional and capture-safe in every implementation: no host reads of device values, no data-dependent
shapes (the index buffer changes every step under a captured graph). The references loop over the S slots (a
shape, not data): each slot's product for every token, kept where the token's index is that slot. That is S times
the arithmetic of one adapter but never materialises per-token weights (a per-token gather of lora_b at a prefill
of 8192 tokens would be gigabytes). Implementations: Triton (ops/triton/lora.py; cuda, and npu through
Triton-Ascend: torch_npu has no LoRA op), cpu (ops/cpu/lora.py).
"""
import torch
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op()
def lora_shrink(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    """x [T, in] (any float dtype, rows at any stride), lora_a [S, n, R, in] (x's dtype), token_lora_indices int64
    [>= T] in [-1, S) -> buf fp32 [T, n, R] = lora_a[idx[t]] @ x[t] per token, zeros where idx[t] == -1."""
    T = x.shape[0]
    S, n, R, K = lora_a.shape
    idx = token_lora_indices[:T].view(T, 1)
    xf = x.float()
    buf = xf.new_zeros(T, n * R)
    for slot in range(S):
        buf = torch.where(idx == slot, xf @ lora_a[slot].reshape(n * R, K).float().T, buf)
    return buf.view(T, n, R)


@register_fake(lora_shrink)
def _(x, lora_a, token_lora_indices):
    return x.new_empty(x.shape[0], lora_a.shape[1], lora_a.shape[2], dtype=torch.float32)


@graphinfer_op()
def lora_expand(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor, slice_sizes: list[int]) -> Tensor:
    """y [T, out] (the base linear's output), buf fp32 [T, n, R] (lora_shrink's), lora_b [S, out, R], slice_sizes: n
    ints summing to out -> z [T, out] in y's dtype: y + lora_b[idx[t]] @ buf[t, slice of the column] in fp32, rounded
    once; z[t] = y[t] exactly where idx[t] == -1. y is not modified."""
    T = y.shape[0]
    S = lora_b.shape[0]
    idx = token_lora_indices[:T].view(T, 1)
    bf = buf.float()
    delta = y.new_zeros(T, y.shape[1], dtype=torch.float32)
    for slot in range(S):
        offset, parts = 0, []
        for s, size in enumerate(slice_sizes):
            parts.append(bf[:, s] @ lora_b[slot, offset:offset + size].float().T)  # [T, size]
            offset += size
        delta = torch.where(idx == slot, torch.cat(parts, dim=1), delta)
    return torch.where(idx >= 0, (y.float() + delta).to(y.dtype), y).contiguous()


@register_fake(lora_expand)
def _(y, buf, lora_b, token_lora_indices, slice_sizes):
    return y.new_empty(y.shape)
