"""CPU implementations of the LoRA ops (graphinfer/ops/lora.py holds the contract; its references stay the oracle).

No C++: a few ATen ops each, capture-safe as the references (no host reads, shapes only), in two forms chosen by the
token count (a shape):
  - shrink, one token ("gather"): each token's own A gathered ([T, n * R, in]) and one bmm against x: reads T
    adapters' A, not all S. More tokens ("all slots"): ONE GEMM of x against every slot's A stacked
    ([S * n * R, in]), then each token's slot's n * R columns gathered: S times the arithmetic of the one adapter a
    token needs, but a single oneDNN call (at S * n * R = 192 columns it is cheaper than S masked GEMMs).
  - expand, one token ("gather"): each token's own B gathered ([T, out, R]) and one bmm per slice. More tokens
    ("one-hot"): buf spread over the slots by a one-hot of the index ([T, S * R] per slice, zeros where the token
    is not in that slot, all zeros for -1), then one GEMM per slice against that slice's B of every slot
    ([S * R, size]): again S times the arithmetic in n GEMMs, never a per-token copy of B.
bf16 operands are widened to fp32 first (the ops accumulate in fp32; ATen's CPU bf16 GEMM would round its output
to bf16). The gather forms run at T = 1 only (_*_GATHER_MAX_TOKENS): tools/lora_cpu_bench.py measured them slower
from T = 4 on (a batched matrix-vector product per token); both forms agree with the reference within fp32
summation order.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

# Token counts up to which the per-token gather forms run: measured faster at T = 1 (shrink: even, expand: ~2x), slower
# from T = 4 on (tools/lora_cpu_bench.py at in 576, n 3, R 16, S 4).
_SHRINK_GATHER_MAX_TOKENS = 1
_EXPAND_GATHER_MAX_TOKENS = 1


def shrink_gather(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    T = x.shape[0]
    S, n, R, K = lora_a.shape
    idx = token_lora_indices[:T]
    w = lora_a.reshape(S, n * R, K)[idx.clamp(min=0)].float()  # [T, n * R, K]
    out = torch.bmm(w, x.float().unsqueeze(-1)).view(T, n, R)
    return torch.where((idx >= 0).view(T, 1, 1), out, 0.0)


def shrink_all_slots(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    T = x.shape[0]
    S, n, R, K = lora_a.shape
    idx = token_lora_indices[:T]
    full = F.linear(x.float(), lora_a.reshape(S * n * R, K).float()).view(T, S, n * R)
    sel = full.gather(1, idx.clamp(min=0).view(T, 1, 1).expand(T, 1, n * R))
    return torch.where((idx >= 0).view(T, 1, 1), sel, 0.0).view(T, n, R)


def expand_gather(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor, slice_sizes: list[int]) -> Tensor:
    T = y.shape[0]
    idx = token_lora_indices[:T]
    w = lora_b[idx.clamp(min=0)].float()  # [T, out, R]
    parts, offset = [], 0
    for s, size in enumerate(slice_sizes):
        parts.append(torch.bmm(w[:, offset:offset + size], buf[:, s].unsqueeze(-1)).squeeze(-1))
        offset += size
    z = (y.float() + torch.cat(parts, dim=1)).to(y.dtype)
    return torch.where((idx >= 0).view(T, 1), z, y)


def expand_one_hot(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor,
                   slice_sizes: list[int]) -> Tensor:
    T = y.shape[0]
    S, _, R = lora_b.shape
    n = buf.shape[1]
    idx = token_lora_indices[:T]
    one_hot = (idx.view(T, 1) == torch.arange(S, device=idx.device)).float()  # [T, S]; a -1 row is all zeros
    spread = one_hot.view(T, S, 1, 1) * buf.view(T, 1, n, R)  # [T, S, n, R]
    bf = lora_b.float()
    parts, offset = [], 0
    for s, size in enumerate(slice_sizes):
        w = bf[:, offset:offset + size].permute(1, 0, 2).reshape(size, S * R)
        parts.append(F.linear(spread[:, :, s].reshape(T, S * R), w))
        offset += size
    z = (y.float() + torch.cat(parts, dim=1)).to(y.dtype)
    return torch.where((idx >= 0).view(T, 1), z, y)


def lora_shrink_cpu(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    if x.shape[0] <= _SHRINK_GATHER_MAX_TOKENS:
        return shrink_gather(x, lora_a, token_lora_indices)
    return shrink_all_slots(x, lora_a, token_lora_indices)


def lora_expand_cpu(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor,
                    slice_sizes: list[int]) -> Tensor:
    if y.shape[0] <= _EXPAND_GATHER_MAX_TOKENS:
        return expand_gather(y, buf, lora_b, token_lora_indices, slice_sizes)
    return expand_one_hot(y, buf, lora_b, token_lora_indices, slice_sizes)


CPU_LORA_OPS = {"lora_shrink": lora_shrink_cpu, "lora_expand": lora_expand_cpu}
