"""Triton kernels for the quantization ops (graphinfer/ops/quant.py holds the contract and the references).

Row kernels, one row per program (grid = rows, 1-D), the whole row as one BLOCK_N tile like norm.py:
  * dynamic_quant: codes = round_half_even(x / scale) clamped to +-127 (int8) or cast to float8_e4m3fn after
    a clamp to +-448; scale = max(max|x| / qmax, 1e-10) per row, or the static input_scale;
  * rms_norm_quant / add_rms_norm_quant / silu_and_mul_quant: the norm / activation rounded exactly as the
    unfused kernels round it (norm.py, activation.py), then the same quantization, in one pass over the row.
GEMMs, a 1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) output tiles, a K loop of BLOCK_K steps:
  * scaled_mm: tl.dot on int8 codes with int32 accumulation (exact), or on float8_e4m3fn codes with fp32
    accumulation; epilogue (acc * a_scale) * b_scale + bias in fp32 (the reference's order), cast to out_dtype;
  * wo_linear: the packed weight tile is dequantized in registers (w = q * scale + zero, fp32) and fed to
    tl.dot against x, fp32 accumulation, output in x's dtype. bits 8 loads int8 [BLOCK_N, BLOCK_K] codes; bits 4
    loads the [BLOCK_N, BLOCK_K / 2] bytes once and splits them into the even-k (low nibble) and odd-k (high
    nibble) halves, each dotted against the matching even / odd columns of x: the sum over k does not care
    about order, so no interleave is needed. Scales / zeros: one [BLOCK_N] vector per K step when a K tile
    lies in one group (group % BLOCK_K == 0, or one group per row), else gathered per element (any group size).

Matching the reference bit for bit where it is exact:
  * x / scale is an IEEE division: `/` on fp32 is approximate on NVIDIA (div.full.f32), so the CUDA path uses
    tl.math.div_rn (IEEE_DIV); the interpreters divide exactly either way.
  * round half to even (torch.round) is computed from tl.floor (portable; no libdevice rint).
  * fp8: both interpreters' fp32 -> float8e4nv cast mis-rounds when rounding carries into the exponent
    (31.6 -> 16 instead of 32), so values are first rounded to the e4m3 grid explicitly (round half to even on
    the fp32 bits); the cast of a representable value is then exact on every backend, compiled or not.
So dynamic_quant's codes equal the reference's exactly; the fused ops can differ by one code where the kernel's
fp32 norm / silu differs from torch's by an ulp at a rounding boundary (as rms_norm itself does).

Triton-Ascend subset: 1-D grids, masks on every ragged access, block sizes constexpr, no fp64, row counts not
specialised on. K loops run to a runtime bound (the form skinny_gemm.py uses; upstream 3.6's interpreter needs
the backported fix in __init__.py). Interpreters: bf16 and fp8 tl.dot operands are cast to fp32 first (DOT_F32,
as attention.py and skinny_gemm.py do): fp8 x fp8 products are exact in fp32, so that is the value an fp8 dot
with fp32 accumulation computes. Not run on a GPU or NPU yet (tools/gpu_check.py --quant is the GPU check); compiled
offline for sm_90 with Triton 3.6 (every kernel form the wrappers launch builds a cubin; the int8 / fp8 dots become
wgmma at BLOCK_M 64 and mma.sync at 16; x / scale is div.rn.f32).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2

_MIN_SCALE = 1e-10  # ops/quant.py's floor for an all-zero row
_QMAX = {"int8": 127.0, "fp8": 448.0}
_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


# ----- shared device helpers -----

@triton.jit
def _round_half_even(v):
    """torch.round on fp32 (|v| < 2**22): floor, then up past .5 or at .5 towards the even neighbour."""
    f = tl.floor(v)
    d = v - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _cast(v, DTYPE: tl.constexpr):
    """fp32 v -> DTYPE rounding to nearest even. For bf16 the rounding is done on the fp32 bits first: both
    interpreters' fp32 -> bf16 cast truncates, and the cast of a value already on the bf16 grid is exact
    everywhere (on GPUs this is the cast they do anyway). Finite inputs."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = ~0xFFFF
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return v.to(DTYPE)


@triton.jit
def _store_tile(acc, out_ptr, bias_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS: tl.constexpr):
    """A GEMM's fp32 tile (+ bias [N]) stored in out_ptr's dtype: the epilogue the GEMM kernels share."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], _cast(acc, out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])



@triton.jit
def _round_to_e4m3(v):
    """Round fp32 |v| <= 448 to the nearest float8_e4m3fn value (ties to even), still as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # the last mantissa bit kept (3 of 23)
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    subnormal = _round_half_even(v * 512.0) * 0.001953125  # multiples of 2**-9 below 2**-6
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_row(y, mask, static_scale_ptr, q_ptr, scale_ptr, row, n_cols, cols,
                  QMAX: tl.constexpr, IS_FP8: tl.constexpr, STATIC: tl.constexpr, IEEE_DIV: tl.constexpr):
    """y: fp32 [BLOCK_N] (masked entries 0) -> codes row `row` and its scale."""
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.max(tl.abs(y), axis=0)
        if IEEE_DIV:
            scale = tl.math.div_rn(amax, QMAX)
        else:
            scale = amax / QMAX
        scale = tl.maximum(scale, 1e-10)
    if IEEE_DIV:
        v = tl.math.div_rn(y, scale)
    else:
        v = y / scale
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if IS_FP8:
        q = _round_to_e4m3(v)
    else:
        q = _round_half_even(v)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


# ----- row kernels -----

@triton.jit(do_not_specialize=["n_rows"])
def _dynamic_quant_kernel(x_ptr, static_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x,
                          QMAX: tl.constexpr, IS_FP8: tl.constexpr, STATIC: tl.constexpr, IEEE_DIV: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    y = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(y, mask, static_ptr, q_ptr, scale_ptr, row, n_cols, cols, QMAX, IS_FP8, STATIC, IEEE_DIV)


@triton.jit
def _rms_norm_row(h, w_ptr, cols, mask, n_cols, eps, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr):
    """rms_norm_ref on one fp32 row: normalise in fp32, round to x's dtype, times weight in the promoted dtype."""
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = _cast(h * rstd, X_DTYPE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _cast(normed * w, Y_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_quant_kernel(x_ptr, w_ptr, static_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x, eps,
                           X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
                           STATIC: tl.constexpr, IEEE_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _rms_norm_row(h, w_ptr, cols, mask, n_cols, eps, X_DTYPE, Y_DTYPE)
    _quantize_row(y, mask, static_ptr, q_ptr, scale_ptr, row, n_cols, cols, QMAX, IS_FP8, STATIC, IEEE_DIV)


@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm_quant_kernel(x_ptr, r_ptr, w_ptr, static_ptr, q_ptr, scale_ptr, res_out_ptr, n_rows, n_cols,
                               stride_x, stride_r, eps, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr,
                               QMAX: tl.constexpr, IS_FP8: tl.constexpr, STATIC: tl.constexpr,
                               IEEE_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    res = _cast(x.to(tl.float32) + r.to(tl.float32), X_DTYPE)  # the add rounds in x's dtype
    tl.store(res_out_ptr + row * n_cols + cols, res, mask=mask)
    y = _rms_norm_row(res.to(tl.float32), w_ptr, cols, mask, n_cols, eps, X_DTYPE, Y_DTYPE)
    _quantize_row(y, mask, static_ptr, q_ptr, scale_ptr, row, n_cols, cols, QMAX, IS_FP8, STATIC, IEEE_DIV)


@triton.jit(do_not_specialize=["n_rows"])
def _silu_and_mul_quant_kernel(x_ptr, static_ptr, q_ptr, scale_ptr, n_rows, d, stride_x, X_DTYPE: tl.constexpr,
                               QMAX: tl.constexpr, IS_FP8: tl.constexpr, STATIC: tl.constexpr,
                               IEEE_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = _cast(gate / (1.0 + tl.exp(-gate)), X_DTYPE).to(tl.float32)  # as activation.py: silu rounded, then *
    y = _cast(act * up, X_DTYPE).to(tl.float32)
    _quantize_row(y, mask, static_ptr, q_ptr, scale_ptr, row, d, cols, QMAX, IS_FP8, STATIC, IEEE_DIV)


# ----- GEMMs -----

@triton.jit
def _fdot(a, b, DOT_F32: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation: fp32 'ieee' operands, or native 16-bit ones (b cast to a's dtype)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b.to(a.dtype))


@triton.jit(do_not_specialize=["M"])
def _scaled_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_bn, stride_om,
                      IS_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(b_ptr + cols[:, None] * stride_bn + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if IS_INT8:
            acc += tl.dot(a, tl.trans(b))  # int8 x int8 -> int32, exact
        elif DOT_F32:  # interpreters: fp8 products are exact in fp32
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))  # float8e4nv, fp32 accumulation (Hopper+)
    a_scale = tl.load(as_ptr + rows, mask=row_mask, other=0.0)
    b_scale = tl.load(bs_ptr + cols, mask=col_mask, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    _store_tile(out, out_ptr, bias_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS)


@triton.jit
def _dequant(q, s_ptr, z_ptr, cols, col_mask, g_idx, k_mask, k0, G, stride_sn, HAS_ZERO: tl.constexpr,
             GROUP_TILE: tl.constexpr):
    """fp32 w = q * scales[n, k // G] (+ zeros[n, k // G]) for a code tile q [BLOCK_N, cols of k]; g_idx: the
    group index of each column (used unless the whole K tile is one group, GROUP_TILE), k_mask: the columns inside K
    (past it g_idx would read beyond a row's scales: the last row's, beyond the tensor, NaN x 0 = NaN)."""
    if GROUP_TILE:
        offs = cols * stride_sn + k0 // G
        s = tl.load(s_ptr + offs, mask=col_mask, other=0.0)
        w = q * s[:, None]
        if HAS_ZERO:
            w += tl.load(z_ptr + offs, mask=col_mask, other=0.0)[:, None]
    else:
        offs = cols[:, None] * stride_sn + g_idx[None, :]
        mask = col_mask[:, None] & k_mask[None, :]
        s = tl.load(s_ptr + offs, mask=mask, other=0.0)
        w = q * s
        if HAS_ZERO:
            w += tl.load(z_ptr + offs, mask=mask, other=0.0)
    return w


@triton.jit(do_not_specialize=["M"])
def _wo_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn,
                      stride_om, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GROUP_TILE: tl.constexpr, DOT_F32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            q = tl.load(q_ptr + cols[:, None] * stride_qn + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                        other=0).to(tl.float32)
            w = _dequant(q, s_ptr, z_ptr, cols, col_mask, ks // G, k_mask, k0, G, stride_sn, HAS_ZERO, GROUP_TILE)
            acc += _fdot(x, tl.trans(w), DOT_F32)
    else:
        for k0 in range(0, K, BLOCK_K):
            js = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns: k = 2j (low nibble) and 2j + 1 (high)
            j_mask = js < K // 2
            byte = tl.load(q_ptr + cols[:, None] * stride_qn + js[None, :], mask=col_mask[:, None] & j_mask[None, :],
                           other=0)
            lo = (byte & 0xF).to(tl.float32)
            hi = ((byte >> 4) & 0xF).to(tl.float32)
            x_mask = row_mask[:, None] & j_mask[None, :]
            x_even = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * js[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + 2 * js[None, :] + 1, mask=x_mask, other=0.0)
            w_lo = _dequant(lo, s_ptr, z_ptr, cols, col_mask, (2 * js) // G, j_mask, k0, G, stride_sn, HAS_ZERO,
                            GROUP_TILE)
            w_hi = _dequant(hi, s_ptr, z_ptr, cols, col_mask, (2 * js + 1) // G, j_mask, k0, G, stride_sn, HAS_ZERO,
                            GROUP_TILE)
            acc += _fdot(x_even, tl.trans(w_lo), DOT_F32)
            acc += _fdot(x_odd, tl.trans(w_hi), DOT_F32)
    _store_tile(acc, out_ptr, bias_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS)


_DYNAMIC_QUANT = Launcher(_dynamic_quant_kernel)
_RMS_NORM_QUANT = Launcher(_rms_norm_quant_kernel)
_ADD_RMS_NORM_QUANT = Launcher(_add_rms_norm_quant_kernel)
_SILU_AND_MUL_QUANT = Launcher(_silu_and_mul_quant_kernel)
_SCALED_MM = Launcher(_scaled_mm_kernel)
_WO_LINEAR = Launcher(_wo_linear_kernel)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreted() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (triton decides at @jit time)."""
    return not isinstance(_scaled_mm_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=64)
def _row_options(n_cols: int, device_type: str) -> tuple[int, dict]:
    """(BLOCK_N, launch options) for the row kernels: the whole row in one tile, as norm.py."""
    block_n = next_power_of_2(n_cols)
    options = {"num_warps": min(max(block_n // 256, 1), 16)} if device_type == "cuda" else {}
    return block_n, options


def _quant_args(quant_dtype: str, input_scale: Tensor | None, device: torch.device) -> tuple:
    """(static scale pointer or a dummy, QMAX, IS_FP8, STATIC, IEEE_DIV): div_rn on CUDA only (exact `/` elsewhere:
    the interpreters divide in IEEE fp32, Ascend's lowering of div_rn is not something this project has checked)."""
    if quant_dtype not in _QMAX:
        raise ValueError(f"quant_dtype {quant_dtype!r}: 'int8' or 'fp8'")
    if quant_dtype == "fp8":
        _refuse_fp8_on_npu(device)
    static = input_scale is not None
    return (input_scale if static else torch.empty(1, dtype=torch.float32, device=device), _QMAX[quant_dtype],
            quant_dtype == "fp8", static, device.type != "npu")


def _refuse_fp8_on_npu(device: torch.device) -> None:
    if device.type == "npu":  # Triton-Ascend 3.2: "[fp8, fp64] is unsupported on Ascend for now"
        raise NotImplementedError("fp8 quantization kernels need a CUDA GPU (Hopper or newer): Triton-Ascend has no "
                                  "float8 support; use the int8 schemes on Ascend.")


def _rows(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _outputs(x: Tensor, n_cols: int, quant_dtype: str) -> tuple[Tensor, Tensor]:
    lead = x.shape[:-1]
    return (torch.empty((*lead, n_cols), dtype=_CODE_DTYPES[quant_dtype], device=x.device),
            torch.empty((*lead, 1), dtype=torch.float32, device=x.device))


def dynamic_quant(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n_cols = x.shape[-1]
    q, scale = _outputs(x, n_cols, quant_dtype)
    if q.numel() == 0:
        return q, scale
    x2 = _rows(x)
    block_n, options = _row_options(n_cols, x.device.type)
    static_ptr, qmax, is_fp8, static, ieee = _quant_args(quant_dtype, input_scale, x.device)
    _DYNAMIC_QUANT.launch((x2.shape[0],), x2, static_ptr, q, scale, x2.shape[0], n_cols, x2.stride(0),
                          QMAX=qmax, IS_FP8=is_fp8, STATIC=static, IEEE_DIV=ieee, BLOCK_N=block_n, **options)
    return q, scale


def _y_dtype(x: Tensor, weight: Tensor):
    """rms_norm_ref's output dtype: weight * h.to(x.dtype) promotes."""
    return _TL_DTYPES[torch.promote_types(x.dtype, weight.dtype)]


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                   input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    n_cols = x.shape[-1]
    q, scale = _outputs(x, n_cols, quant_dtype)
    if q.numel() == 0:
        return q, scale
    x2 = _rows(x)
    block_n, options = _row_options(n_cols, x.device.type)
    static_ptr, qmax, is_fp8, static, ieee = _quant_args(quant_dtype, input_scale, x.device)
    _RMS_NORM_QUANT.launch((x2.shape[0],), x2, weight, static_ptr, q, scale, x2.shape[0], n_cols, x2.stride(0), eps,
                           X_DTYPE=_TL_DTYPES[x.dtype], Y_DTYPE=_y_dtype(x, weight), QMAX=qmax, IS_FP8=is_fp8,
                           STATIC=static, IEEE_DIV=ieee, BLOCK_N=block_n, **options)
    return q, scale


def add_rms_norm_quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                       input_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    n_cols = x.shape[-1]
    q, scale = _outputs(x, n_cols, quant_dtype)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if q.numel() == 0:
        return q, scale, new_residual
    x2, r2 = _rows(x), _rows(residual)
    block_n, options = _row_options(n_cols, x.device.type)
    static_ptr, qmax, is_fp8, static, ieee = _quant_args(quant_dtype, input_scale, x.device)
    _ADD_RMS_NORM_QUANT.launch((x2.shape[0],), x2, r2, weight, static_ptr, q, scale, new_residual, x2.shape[0],
                               n_cols, x2.stride(0), r2.stride(0), eps, X_DTYPE=_TL_DTYPES[x.dtype],
                               Y_DTYPE=_y_dtype(x, weight), QMAX=qmax, IS_FP8=is_fp8, STATIC=static, IEEE_DIV=ieee,
                               BLOCK_N=block_n, **options)
    return q, scale, new_residual


def silu_and_mul_quant(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    d = x.shape[-1] // 2
    q, scale = _outputs(x, d, quant_dtype)
    if q.numel() == 0:
        return q, scale
    x2 = _rows(x)
    block_n, options = _row_options(d, x.device.type)
    static_ptr, qmax, is_fp8, static, ieee = _quant_args(quant_dtype, input_scale, x.device)
    _SILU_AND_MUL_QUANT.launch((x2.shape[0],), x2, static_ptr, q, scale, x2.shape[0], d, x2.stride(0),
                               X_DTYPE=_TL_DTYPES[x.dtype], QMAX=qmax, IS_FP8=is_fp8, STATIC=static, IEEE_DIV=ieee,
                               BLOCK_N=block_n, **options)
    return q, scale


@functools.lru_cache(maxsize=4096)
def _gemm_tiles(m: int, n: int, device_type: str) -> tuple[int, int, dict]:
    """(BLOCK_M, BLOCK_N, launch options). BLOCK_M: the fewest rows >= 16 (tl.dot's minimum) covering M up to 64;
    BLOCK_N 32 while that keeps < 128 programs (decode: more programs stream the weight), else 64. Untuned."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if cdiv(m, block_m) * cdiv(n, 64) < 128 else 64
    options = {"num_warps": 4, "num_stages": 3} if device_type == "cuda" else {}
    return block_m, block_n, options


def scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None,
              out_dtype: torch.dtype) -> Tensor:
    """(a @ b.T) * a_scale * b_scale + bias in out_dtype; a [T, K], b [N, K] both int8 or both float8_e4m3fn."""
    n, k = b.shape
    out = torch.empty((*a.shape[:-1], n), dtype=out_dtype, device=a.device)
    a2 = _rows(a)
    m = a2.shape[0]
    if out.numel() == 0:
        return out
    if a.dtype != b.dtype or a.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"scaled_mm: a and b both int8 or both float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dtype != torch.int8:
        _refuse_fp8_on_npu(a.device)
    if b.stride(-1) != 1:
        b = b.contiguous()
    a_scale = a_scale.reshape(-1).float().expand(m) if a_scale.numel() == 1 else a_scale.reshape(-1).float()
    b_scale = b_scale.reshape(-1).float().expand(n) if b_scale.numel() == 1 else b_scale.reshape(-1).float()
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    block_m, block_n, options = _gemm_tiles(m, n, a.device.type)
    is_int8 = a.dtype == torch.int8
    has_bias = bias is not None
    _SCALED_MM.launch((cdiv(m, block_m) * cdiv(n, block_n),), a2, a_scale, b, b_scale, bias if has_bias else b_scale,
                      out.view(m, n), m, n, k, a2.stride(0), b.stride(0), n, IS_INT8=is_int8, HAS_BIAS=has_bias,
                      DOT_F32=not is_int8 and _interpreted(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                      **options)
    return out


@functools.lru_cache(maxsize=4096)
def _wo_block_k(k: int, group: int, bits: int) -> tuple[int, bool]:
    """(BLOCK_K, GROUP_TILE): a K tile inside one group where the group allows (group a multiple of 32, or one group
    per row), else 64 with per-element scale gathers. bits 4 needs BLOCK_K >= 32 (two dots of BLOCK_K / 2 >= 16)."""
    if group == k:
        return 64, True
    for block_k in (64, 32):
        if group % block_k == 0:
            return block_k, True
    return 64, False


def wo_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
              bias: Tensor | None) -> Tensor:
    """x [..., K] @ dequantized(qweight).T + bias in x's dtype (packed forms: ops/quant.py)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    if bits not in (4, 8):
        raise ValueError(f"wo_linear: bits 4 or 8, got {bits}")
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    m = x2.shape[0]
    if out.numel() == 0:
        return out
    group = k // scales.shape[1]
    if group * scales.shape[1] != k:
        raise ValueError(f"wo_linear: {scales.shape[1]} groups do not divide K = {k}")
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales.float().contiguous()
    zeros_arg = zeros.float().contiguous() if zeros is not None else scales
    block_m, block_n, options = _gemm_tiles(m, n, x.device.type)
    block_k, group_tile = _wo_block_k(k, group, bits)
    dot_f32 = x.dtype == torch.float32 or _interpreted()
    _WO_LINEAR.launch((cdiv(m, block_m) * cdiv(n, block_n),), x2, qweight, scales, zeros_arg,
                      bias if bias is not None else scales, out.view(m, n), m, n, k, group, x2.stride(0),
                      qweight.stride(0), scales.stride(0), n, BITS=bits, HAS_ZERO=zeros is not None,
                      HAS_BIAS=bias is not None, GROUP_TILE=group_tile, DOT_F32=dot_f32, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, **options)
    return out


QUANT_OPS = {
    "dynamic_quant": dynamic_quant,
    "scaled_mm": scaled_mm,
    "wo_linear": wo_linear,
    "rms_norm_quant": rms_norm_quant,
    "add_rms_norm_quant": add_rms_norm_quant,
    "silu_and_mul_quant": silu_and_mul_quant,
}
