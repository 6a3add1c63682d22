"""RMSNorm kernels: rms_norm(x, weight, eps) and add_rms_norm(x, residual, weight, eps).

Each program normalises BLOCK_R rows of the flattened [rows, hidden] input as one [BLOCK_R, BLOCK_N] tile
(BLOCK_N = hidden rounded up to a power of two, masked): grid = cdiv(rows, BLOCK_R), 1-D. Packing several
short rows (QK-norm over head_dim) per program keeps the grid small, which Triton-Ascend wants (the grid
maps onto physical cores, at most 65535). Rounding follows the reference: normalise in fp32, cast to x's
dtype, then scale by weight.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

_TILE = 4096  # elements per program tile: rows of a short hidden size share a program


@triton.jit
def _rms_scale(h, w_ptr, cols, col_mask, n_cols, eps, out_dtype: tl.constexpr):
    """h: fp32 [BLOCK_R, BLOCK_N] (masked entries 0) -> weight * (h * rsqrt(mean(h^2) + eps)).to(out_dtype)."""
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    normed = (h * rstd[:, None]).to(out_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return (normed * w[None, :]).to(out_dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_x, stride_o, eps,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y = _rms_scale(x.to(tl.float32), w_ptr, cols, col_mask, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


@triton.jit
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


def _rows(t: Tensor) -> Tensor:
    """[..., hidden] -> a [rows, hidden] view (copy only if the last dim is strided)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_params(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    block_n = triton.next_power_of_2(n_cols)
    block_r = max(1, min(_TILE // block_n, triton.next_power_of_2(n_rows)))
    num_warps = min(max(block_r * block_n // 512, 1), 8)
    return triton.cdiv(n_rows, block_r), block_r, block_n, num_warps


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise the last dimension of x (any leading shape) and scale by weight."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2, o2 = _rows(x), out.view(-1, x.shape[-1])
    grid, block_r, block_n, num_warps = _launch_params(*x2.shape)
    _rms_norm_kernel[(grid,)](x2, weight, o2, x2.shape[0], x2.shape[1], x2.stride(0), o2.stride(0), eps,
                              BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps)
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'): the pre-norm decoder's two outputs."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, new_residual
    x2, r2 = _rows(x), _rows(residual)
    o2, ro2 = out.view(-1, x.shape[-1]), new_residual.view(-1, x.shape[-1])
    grid, block_r, block_n, num_warps = _launch_params(*x2.shape)
    _add_rms_norm_kernel[(grid,)](x2, r2, weight, o2, ro2, x2.shape[0], x2.shape[1], x2.stride(0), r2.stride(0),
                                  o2.stride(0), eps, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps)
    return out, new_residual
