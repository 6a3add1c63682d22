"""CPU implementations of the LoRA ops (graphinfer/ops/lora.py holds the contract; its references stay the oracle).

No C++: a few ATen ops each. The cpu platform's forms (segments) read the index on the host, which costs nothing
on the cpu, and compute each slot the step uses on its tokens only (SGMV's arithmetic; nothing for a step without
adapters). A platform that captures graphs on the cpu (the tests' stand-in) takes the capture-safe forms below (no
host reads, shapes only), two per op chosen by the token count (a shape):
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


def _segments(token_lora_indices: Tensor, T: int) -> list[tuple[int, Tensor | None]]:
    """(slot, its token rows, None for all T) for each slot the step's tokens use: a host read of the index, which is
    free on the cpu (and why these forms are only for a platform that does not capture graphs)."""
    idx = token_lora_indices[:T]
    used = [s for s in torch.unique(idx).tolist() if s >= 0]
    if len(used) == 1 and bool((idx == used[0]).all()):
        return [(used[0], None)]
    return [(s, (idx == s).nonzero().squeeze(1)) for s in used]


# Above this many adapters in one step, the one-GEMM-over-every-slot forms win over a GEMM per slot (bench throughput
# --num-adapters on SmolLM2, bf16, decode batch 16: per slot 0.64x / 0.47x / 0.37x of the base model with 1 / 4 / 8
# adapters, every slot at once 0.41x / 0.42x / 0.42x).
_SEGMENTS_MAX_SLOTS = 4


def shrink_segments(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    """Per slot the step uses, one GEMM of its tokens against its A only (SGMV's arithmetic): an engine whose step
    uses no adapter pays nothing but zeros."""
    T = x.shape[0]
    S, n, R, K = lora_a.shape
    segments = _segments(token_lora_indices, T)
    if len(segments) > _SEGMENTS_MAX_SLOTS:
        return lora_shrink_capture_safe(x, lora_a, token_lora_indices)
    out = x.new_zeros(T, n * R, dtype=torch.float32)
    for slot, rows in segments:
        a = lora_a[slot].reshape(n * R, K).float()
        if rows is None:
            out = F.linear(x.float(), a)
        else:
            out[rows] = F.linear(x[rows].float(), a)
    return out.view(T, n, R)


def expand_segments(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor,
                    slice_sizes: list[int]) -> Tensor:
    """Per slot the step uses, its tokens' delta from its B only; rows of no adapter are y's exactly."""
    T = y.shape[0]
    segments = _segments(token_lora_indices, T)
    if not segments:
        return y.clone()
    if len(segments) > _SEGMENTS_MAX_SLOTS:
        return lora_expand_capture_safe(y, buf, lora_b, token_lora_indices, slice_sizes)
    z = y.to(torch.float32, copy=True)  # (y.float() of an fp32 y is y itself)
    for slot, rows in segments:
        b = lora_b[slot].float()  # [out, R]
        offset = 0
        for s, size in enumerate(slice_sizes):
            if rows is None:
                z[:, offset:offset + size] += F.linear(buf[:, s], b[offset:offset + size])
            else:
                z[rows, offset:offset + size] += F.linear(buf[rows, s], b[offset:offset + size])
            offset += size
    return z.to(y.dtype)


def lora_shrink_capture_safe(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    if x.shape[0] <= _SHRINK_GATHER_MAX_TOKENS:
        return shrink_gather(x, lora_a, token_lora_indices)
    return shrink_all_slots(x, lora_a, token_lora_indices)


def lora_expand_capture_safe(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor,
                             slice_sizes: list[int]) -> Tensor:
    if y.shape[0] <= _EXPAND_GATHER_MAX_TOKENS:
        return expand_gather(y, buf, lora_b, token_lora_indices, slice_sizes)
    return expand_one_hot(y, buf, lora_b, token_lora_indices, slice_sizes)


# The cpu platform captures no device graphs (its traced decode graphs refuse host reads: with these forms, LoRA's
# decode steps run eagerly): the segment forms read the index on the host. A platform that captures on
# the cpu (the tests' stand-in for device graphs) takes the capture-safe forms.
CPU_LORA_OPS = {"lora_shrink": shrink_segments, "lora_expand": expand_segments}
CPU_LORA_CAPTURE_SAFE_OPS = {"lora_shrink": lora_shrink_capture_safe, "lora_expand": lora_expand_capture_safe}
