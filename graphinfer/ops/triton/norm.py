"""RMSNorm kernels: rms_norm(x, weight, eps) and add_rms_norm(x, residual, weight, eps).

Each program normalises BLOCK_R rows of the flattened [rows, hidden] input as one [BLOCK_R, BLOCK_N] tile
(BLOCK_N = hidden rounded up to a power of two, masked): grid = cdiv(rows, BLOCK_R), 1-D. Packing several
short rows (QK-norm over head_dim) per program keeps the grid small, which Triton-Ascend wants (the grid
maps onto physical cores, at most 65535). rms_norm reads [T, H, D] inputs whose rows do not flatten (the
per-head q/k norms over a slice of a fused qkv output) in place instead of copying them. Rounding follows the
reference: normalise in fp32, cast to x's dtype, then scale by weight.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2

_TILE = 4096  # elements per program tile at most: rows of a short hidden size share a program
_WIDE_ROW = 1024  # rows at least this wide (hidden sizes) get one row per program at decode sizes
_MIN_PROGRAMS = 528  # ... and are packed only past ~4 programs per H100 SM (132)


@triton.jit
def _rms_scale(h, w_ptr, cols, col_mask, n_cols, eps, out_dtype: tl.constexpr):
    """h: fp32 [BLOCK_R, BLOCK_N] (masked entries 0) -> weight * (h * rsqrt(mean(h^2) + eps)).to(out_dtype)."""
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    normed = (h * rstd[:, None]).to(out_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return (normed * w[None, :]).to(out_dtype)


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_inner, n_cols, stride_xo, stride_xi, stride_o, eps,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row r of the [n_rows, n_cols] input starts at x_ptr + (r // n_inner) * stride_xo + (r % n_inner) * stride_xi
    (n_inner = 1 for 2-D rows: Triton then folds the division away)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_rows = (rows // n_inner) * stride_xo + (rows % n_inner) * stride_xi
    x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    y = _rms_scale(x.to(tl.float32), w_ptr, cols, col_mask, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, n_cols,
                         stride_x, stride_r, stride_o, eps, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    # The reference adds in the input dtype: round the sum before normalising it.
    res = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + rows[:, None] * stride_o + cols[None, :], res, mask=mask)
    y = _rms_scale(res.to(tl.float32), w_ptr, cols, col_mask, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


_RMS_NORM = Launcher(_rms_norm_kernel)
_ADD_RMS_NORM = Launcher(_add_rms_norm_kernel)


def _rows(t: Tensor) -> Tensor:
    """[..., hidden] -> a [rows, hidden] view (copy only if the last dim is strided)."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_layout(x: Tensor) -> tuple[Tensor, int, int, int, int]:
    """x [..., n] -> (x or a [rows, n] copy, n_rows, n_inner, stride_outer, stride_inner) for _rms_norm_kernel.
    2-D inputs and 3-D ones with a unit last stride need no copy: per-head q/k norms read the heads of a fused
    qkv projection's output in place ([T, H, D] views whose rows cannot be flattened without a copy)."""
    shape, strides = x.shape, x.stride()
    if strides[-1] == 1:
        if len(shape) == 2:
            return x, shape[0], 1, strides[0], 0
        if len(shape) == 3:
            if strides[0] == shape[1] * strides[1]:  # the two leading dims flatten
                return x, shape[0] * shape[1], 1, strides[1], 0
            return x, shape[0] * shape[1], shape[1], strides[0], strides[1]
    x = _rows(x)
    return x, x.shape[0], 1, x.stride(0), 0


@functools.lru_cache(maxsize=4096)
def _launch_params(n_rows: int, n_cols: int) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK_R, BLOCK_N, num_warps), once per shape.

    Short rows (QK-norm over head_dim, small hidden sizes) are packed up to _TILE elements per program.
    Rows of >= _WIDE_ROW elements are packed only while the grid keeps >= _MIN_PROGRAMS programs: measured on
    the H100 (bf16, hidden 1024, in CUDA graphs), decode-sized batches (T <= 256) run ~0.1-0.3 us faster with
    one row per program and 4 warps, and at T >= 4,096 packings of 1 to 8 rows all run at 90-110% of the copy
    bandwidth (the 18-22% once reported was the eager wrapper's host time, not the kernel).
    """
    block_n = next_power_of_2(n_cols)
    if block_n < _WIDE_ROW:
        block_r = max(1, min(_TILE // block_n, next_power_of_2(n_rows)))
        return (cdiv(n_rows, block_r),), block_r, block_n, min(max(block_r * block_n // 512, 1), 8)
    block_r = max(1, min(_TILE // block_n, next_power_of_2(cdiv(n_rows, _MIN_PROGRAMS))))
    return (cdiv(n_rows, block_r),), block_r, block_n, min(max(block_r * block_n // 256, 1), 8)


def _empty_like(x: Tensor) -> Tensor:
    """A new contiguous tensor of x's shape and dtype."""
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise the last dimension of x (any leading shape) and scale by weight."""
    out = _empty_like(x)
    n_cols = x.shape[-1]
    if out.numel() == 0:
        return out
    x2, n_rows, n_inner, stride_xo, stride_xi = _row_layout(x)
    grid, block_r, block_n, num_warps = _launch_params(n_rows, n_cols)
    _RMS_NORM.launch(grid, x2, weight, out, n_rows, n_inner, n_cols, stride_xo, stride_xi, n_cols, eps,
                     BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps)
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'): the pre-norm decoder's two outputs."""
    out, new_residual = _empty_like(x), _empty_like(x)
    if out.numel() == 0:
        return out, new_residual
    x2, r2 = _rows(x), _rows(residual)
    n_rows, n_cols = x2.shape
    grid, block_r, block_n, num_warps = _launch_params(n_rows, n_cols)
    _ADD_RMS_NORM.launch(grid, x2, r2, weight, out, new_residual, n_rows, n_cols, x2.stride(0), r2.stride(0),
                         n_cols, eps, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps)
    return out, new_residual
