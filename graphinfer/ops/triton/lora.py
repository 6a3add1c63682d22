"""Triton kernels for the LoRA ops (graphinfer/ops/lora.py holds the contract and the references), BGMV-style.

One source for CUDA and Triton-Ascend (the npu platform's default for these ops: torch_npu has no LoRA op;
vllm-ascend uses AscendC kernels of its own). Every program reads its tokens' adapter slots from the index buffer on
the device: no host reads, shapes only (capture-safe).

  * lora_shrink: a 1-D grid of cdiv(T, TOKENS) * n programs, one per (token group, slice). For each of its TOKENS
    tokens (a static loop) the program holds the whole rank as a [BLOCK_R] fp32 accumulator and walks `in` in
    BLOCK_K steps: acc += sum_k lora_a[slot, s, :, k] * x[t, k] (a [BLOCK_R, BLOCK_K] tile times a broadcast row,
    reduced with tl.sum: no tl.dot, one token has one row). A token with slot -1 loads nothing (its loads are
    masked off) and stores its zeros.
  * lora_expand: one launch per output slice (n is a shape: 1 - 3 launches), a 1-D grid of
    cdiv(T, TOKENS) * cdiv(size_s, BLOCK_N) programs, one per (token group, column tile of the slice). Per token:
    delta[j] = sum_r lora_b[slot, off_s + j, r] * buf[t, s, r] from a [BLOCK_N, BLOCK_R] tile of B and the slice's
    [BLOCK_R] row of buf, then z = y + delta in fp32 rounded once to y's dtype (quant.py's _cast: round to nearest
    even, which the interpreters' own bf16 cast does not do). A token with slot -1 stores y as it is.
  TOKENS is 1 unless the grid would pass 65535 programs (Triton-Ascend's limit): then the next power of two that
  keeps it under (a long prefill). The rank fits one tile (BLOCK_R = next power of two >= R, at least 16).

Triton-Ascend subset: 1-D grids, every ragged access masked, no fp64, block sizes and TOKENS constexpr; the only
runtime-bounded loop is the shrink's K loop over a plain int (as quant.py's GEMMs). Token counts are not
specialised on (do_not_specialize). Not run on a GPU or an NPU yet; tested under both interpreters
(tests/test_lora_kernels.py).
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2
from graphinfer.ops.triton.quant import _cast

_MAX_GRID = 65535  # Triton-Ascend's grid limit
_TILE = 4096  # elements of a weight tile per program step ([BLOCK_R, BLOCK_K] or [BLOCK_N, BLOCK_R]) UNTUNED


@triton.jit(do_not_specialize=["n_tokens"])
def _lora_shrink_kernel(x_ptr, a_ptr, idx_ptr, buf_ptr, n_tokens, K, R, n_slices, stride_x, stride_as, stride_an,
                        stride_ar, TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    s = pid % n_slices
    t0 = (pid // n_slices) * TOKENS
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    r_mask = r < R
    for i in range(TOKENS):
        t = t0 + i
        live = t < n_tokens
        slot = tl.load(idx_ptr + t, mask=live, other=-1)
        valid = live & (slot >= 0)
        a_row = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as + s * stride_an
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_mask = (k < K) & valid
            xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_row + r[:, None] * stride_ar + k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * xv[None, :], axis=1)
        tl.store(buf_ptr + (t.to(tl.int64) * n_slices + s) * R + r, acc, mask=r_mask & live)


@triton.jit(do_not_specialize=["n_tokens"])
def _lora_expand_kernel(y_ptr, buf_ptr, b_ptr, idx_ptr, z_ptr, n_tokens, R, n_slices, s, offset, size, stride_y,
                        stride_z, stride_bs, stride_bo, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(size, BLOCK_N)
    t0 = (pid // n_tiles) * TOKENS
    j = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns within the slice
    r = tl.arange(0, BLOCK_R)
    j_mask = j < size
    r_mask = r < R
    cols = offset + j
    for i in range(TOKENS):
        t = t0 + i
        live = t < n_tokens
        slot = tl.load(idx_ptr + t, mask=live, other=-1)
        valid = live & (slot >= 0)
        t64 = t.to(tl.int64)
        v = tl.load(buf_ptr + (t64 * n_slices + s) * R + r, mask=r_mask & valid, other=0.0)
        b = tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs + cols[:, None] * stride_bo + r[None, :],
                    mask=(j_mask & valid)[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * v[None, :], axis=1)
        y = tl.load(y_ptr + t64 * stride_y + cols, mask=j_mask & live, other=0.0)
        z = tl.where(valid, _cast(y.to(tl.float32) + delta, z_ptr.dtype.element_ty), y)
        tl.store(z_ptr + t64 * stride_z + cols, z, mask=j_mask & live)


_SHRINK = Launcher(_lora_shrink_kernel)
_EXPAND = Launcher(_lora_expand_kernel)


def _tokens_per_program(n_tokens: int, programs_per_token: int) -> int:
    """1, or the power of two that keeps the grid within _MAX_GRID."""
    return next_power_of_2(cdiv(n_tokens * programs_per_token, _MAX_GRID))


def lora_shrink(x: Tensor, lora_a: Tensor, token_lora_indices: Tensor) -> Tensor:
    """buf fp32 [T, n, R] = lora_a[idx[t]] @ x[t] (zeros where idx[t] == -1); see graphinfer/ops/lora.py."""
    T, K = x.shape
    S, n, R, _ = lora_a.shape
    buf = torch.empty((T, n, R), dtype=torch.float32, device=x.device)  # every row written: no memset
    if T == 0 or n == 0 or R == 0:
        return buf.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if lora_a.stride(-1) != 1:
        lora_a = lora_a.contiguous()
    block_r = max(16, next_power_of_2(R))
    block_k = max(16, min(next_power_of_2(K), _TILE // block_r))
    tokens = _tokens_per_program(T, n)
    _SHRINK.launch((cdiv(T, tokens) * n,), x, lora_a, token_lora_indices, buf, T, K, R, n, x.stride(0),
                   lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
                   TOKENS=tokens, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return buf


def lora_expand(y: Tensor, buf: Tensor, lora_b: Tensor, token_lora_indices: Tensor, slice_sizes: list[int]) -> Tensor:
    """z [T, out] = y + lora_b[idx[t]] @ buf[t, slice], rounded once to y's dtype (y where idx[t] == -1); a new
    tensor; see graphinfer/ops/lora.py."""
    T, out = y.shape
    n, R = buf.shape[1], buf.shape[2]
    if len(slice_sizes) != n or sum(slice_sizes) != out:
        raise ValueError(f"lora_expand: slice_sizes {list(slice_sizes)} must be buf's {n} slices summing to y's {out} "
                         f"columns")
    z = torch.empty((T, out), dtype=y.dtype, device=y.device)
    if T == 0 or out == 0:
        return z
    if y.stride(-1) != 1:
        y = y.contiguous()
    if lora_b.stride(-1) != 1:
        lora_b = lora_b.contiguous()
    buf = buf.contiguous()
    block_r = max(16, next_power_of_2(R))
    offset = 0
    for s, size in enumerate(slice_sizes):
        size = int(size)
        if size == 0:
            continue
        block_n = max(16, min(next_power_of_2(size), _TILE // block_r))
        tiles = cdiv(size, block_n)
        tokens = _tokens_per_program(T, tiles)
        _EXPAND.launch((cdiv(T, tokens) * tiles,), y, buf, lora_b, token_lora_indices, z, T, R, n, s, offset, size,
                       y.stride(0), z.stride(0), lora_b.stride(0), lora_b.stride(1),
                       TOKENS=tokens, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)
        offset += size
    return z


LORA_OPS = {"lora_shrink": lora_shrink, "lora_expand": lora_expand}
