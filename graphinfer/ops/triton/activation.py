"""Gated-activation kernels: silu_and_mul(x) = silu(x[..., :d]) * x[..., d:] and gelu_and_mul(x, approximate) =
gelu(x[..., :d]) * x[..., d:] -> [..., d].

Each program covers a [BLOCK_R rows, BLOCK_C columns] tile of the [rows, d] output; the 2-D tiling is
flattened into a 1-D grid of cdiv(rows, BLOCK_R) * cdiv(d, BLOCK_C) programs (Triton-Ascend merges
multi-dimensional grids anyway and caps the grid at 65535, so a long prefill packs rows per program).
Rounding follows the reference: the activation in fp32 rounded to x's dtype, then the product rounded again.
"""
import functools

import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2

_TILE = 4096  # output elements per program


# Per-step counts are not specialised on (== 1, % 16): one compiled variant serves every step (see launch.py).
@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_kernel(x_ptr, out_ptr, n_rows, d, stride_x, stride_o,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(d, BLOCK_C)
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _gelu_and_mul_kernel(x_ptr, out_ptr, n_rows, d, stride_x, stride_o,
                         TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    n_col_blocks = tl.cdiv(d, BLOCK_C)
    rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        # 0.5 * (1 + tanh(z)) = sigmoid(2z), z = sqrt(2 / pi) * (x + 0.044715 x^3): tl has no tanh outside CUDA's
        # libdevice. exp of -2|z| never overflows; the limits 0 and x come out without an inf or a NaN.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(z))
        act = gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))  # x * Phi(x)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], (act * up).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_AND_MUL = Launcher(_silu_and_mul_kernel)
_GELU_AND_MUL = Launcher(_gelu_and_mul_kernel)


@functools.lru_cache(maxsize=4096)
def _launch_params(n_rows: int, d: int) -> tuple[tuple[int], int, int]:
    """(grid, BLOCK_R, BLOCK_C), once per shape."""
    block_c = min(next_power_of_2(d), 1024)
    block_r = max(1, min(_TILE // block_c, next_power_of_2(n_rows)))
    return (cdiv(n_rows, block_r) * cdiv(d, block_c),), block_r, block_c


def _act_and_mul(launcher: Launcher, x: Tensor, **constexprs) -> Tensor:
    d = x.shape[-1] // 2
    if x.dim() == 2:
        n_rows = x.shape[0]
        out = x.new_empty((n_rows, d))
    else:
        out = x.new_empty((*x.shape[:-1], d))
        x = x.reshape(-1, x.shape[-1])
        n_rows = x.shape[0]
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    grid, block_r, block_c = _launch_params(n_rows, d)
    launcher.launch(grid, x, out, n_rows, d, x.stride(0), d, **constexprs, BLOCK_R=block_r, BLOCK_C=block_c,
                    num_warps=4)
    return out


def silu_and_mul(x: Tensor) -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns silu(gate) * up, [..., d] (vLLM's layout)."""
    return _act_and_mul(_SILU_AND_MUL, x)


def gelu_and_mul(x: Tensor, approximate: str = "none") -> Tensor:
    """x is [..., 2 * d] = cat(gate, up); returns gelu(gate, approximate) * up, [..., d]."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate={approximate!r}; F.gelu takes 'none' or 'tanh'")
    return _act_and_mul(_GELU_AND_MUL, x, TANH=approximate == "tanh")
