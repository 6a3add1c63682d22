"""Skinny GEMM for decode linears: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with few rows (M <= 8).

At decode batch sizes a linear is a weight stream: cuBLAS picks tiles made for larger M (on the H100 a
Qwen3-0.6B batch-1 step spends 788 us in 141 nvjet 64x8 GEMMs and splitK reduces, where reading the weights
once takes ~360 us). Here one program owns a BLOCK_N slice of W's rows (and, with SPLIT_K > 1, one of SPLIT_K
slices of K): it streams that W tile once, BLOCK_K columns at a time, against all M rows of x (x is tiny and
stays in L1/L2), accumulating in fp32. Two reductions are candidates:
  * USE_DOT: tl.dot on a BLOCK_M = 16 row tile (rows past M masked to 0): tensor cores, whose spare compute
    the padding costs nothing in a bandwidth-bound GEMV;
  * otherwise: per row, an elementwise product with the W tile summed over K (BLOCK_M = M rounded up to a
    power of two, rows unrolled), the classic GEMV, no layout shuffles for the MMA.
SPLIT_K > 1 writes fp32 partials [SPLIT_K, M, N] that a second kernel sums in split order (deterministic,
no atomics), adding the bias and casting once. Which config (and whether this kernel at all) serves a
shape is measured on the device at start-up: graphinfer/compiler/skinny_gemm.py.

Triton-Ascend subset: 1-D grids (N tiles x K splits flattened), masks on every ragged access (N and K need
not be multiples of the blocks), block sizes as constexpr parameters, no fp64, the row count M not
specialised on (it changes per step); num_warps / num_stages are passed on CUDA only. Both interpreters
mis-compute bf16 tl.dot, so on CPU the dot takes fp32 operands (attention.py's _dot with DOT_F32).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.attention import _dot
from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2

MAX_M = 8  # rows this kernel is meant for (decode at small batch); larger M is cuBLAS' ground
_DOT_BLOCK_M = 16  # tl.dot tiles are >= 16 in every dim (Triton-Ascend's interpreter refuses smaller ones)
_REDUCE_BLOCK = 1024  # split-K reduce: output elements per program


@dataclass(frozen=True)
class SkinnyGemmConfig:
    """One candidate launch configuration (the start-up measurement picks among CONFIGS per shape and M)."""
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return (f"{'dot' if self.use_dot else 'gemv'} n{self.block_n} k{self.block_k} split{self.split_k} "
                f"w{self.num_warps} s{self.num_stages}")


# Candidates for H100-class bandwidth: BLOCK_N x BLOCK_K tiles of 4-8K weights per K step, and split-K to keep
# ~132 SMs busy on the narrow layers (N = 1,024: 64 tiles of 16 rows). Untuned until measured on the device.
CONFIGS: tuple[SkinnyGemmConfig, ...] = (
    SkinnyGemmConfig(16, 256),
    SkinnyGemmConfig(32, 128),
    SkinnyGemmConfig(16, 256, split_k=2),
    SkinnyGemmConfig(16, 256, split_k=4),
    SkinnyGemmConfig(32, 128, split_k=4),
    SkinnyGemmConfig(32, 128, use_dot=True),
    SkinnyGemmConfig(64, 64, split_k=2, use_dot=True),
    SkinnyGemmConfig(32, 128, split_k=4, use_dot=True),
)
DEFAULT_CONFIG = CONFIGS[3]  # GRAPHINFER_SKINNY_GEMM=force: split-K keeps the narrow layers' SMs busy (64 tiles x 4)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                        k_per_split, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                        DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_n = pid // SPLIT_K
    split = pid % SPLIT_K
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_hi
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if USE_DOT:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc += _dot(x, tl.trans(w), DOT_F32)
        else:
            wf = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                xm = tl.load(x_ptr + m * stride_xm + ks, mask=k_mask & (m < M), other=0.0).to(tl.float32)
                acc += tl.where(rows[:, None] == m, tl.sum(wf * xm[None, :], axis=1)[None, :], 0.0)
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                           SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the SPLIT_K partials in split order (+ bias), cast once: the same bits every run."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


_GEMM = Launcher(_skinny_gemm_kernel)
_REDUCE = Launcher(_split_k_reduce_kernel)


@functools.lru_cache(maxsize=4096)
def _launch_params(m: int, n: int, k: int, config: SkinnyGemmConfig, device_type: str, fp32: bool) -> tuple:
    """(grid, k_per_split, BLOCK_M, DOT_F32, launch options), once per shape and config."""
    k_per_split = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    grid = (cdiv(n, config.block_n) * config.split_k,)
    block_m = _DOT_BLOCK_M if config.use_dot else next_power_of_2(m)
    dot_f32 = fp32 or device_type == "cpu"  # cpu = interpreter: no bf16 dot there
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if device_type == "cuda" else {}
    return grid, k_per_split, block_m, dot_f32, options


def skinny_gemm(x: Tensor, weight: Tensor, bias: Tensor | None, config: SkinnyGemmConfig) -> Tensor:
    """F.linear(x, weight, bias) for x with at most MAX_M rows (x [..., K], weight [N, K] contiguous), fp32
    accumulation, output in x's dtype."""
    n, k = weight.shape
    out = x.new_empty((*x.shape[:-1], n))
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"skinny_gemm serves at most {MAX_M} rows, got {m}: use F.linear for larger batches")
    if m == 0:
        return out
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    grid, k_per_split, block_m, dot_f32, options = _launch_params(m, n, k, config, x.device.type,
                                                                  x.dtype == torch.float32)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # never read without HAS_BIAS
    out2 = out.view(m, n)
    part = out2 if config.split_k == 1 else torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    _GEMM.launch(grid, x2, weight, bias_arg, out2, part, m, n, k, x2.stride(0), weight.stride(0), n, k_per_split,
                 HAS_BIAS=has_bias, SPLIT_K=config.split_k, USE_DOT=config.use_dot, DOT_F32=dot_f32,
                 BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, **options)
    if config.split_k > 1:
        _REDUCE.launch((cdiv(m * n, _REDUCE_BLOCK),), part, bias_arg, out2, m, n, n, HAS_BIAS=has_bias,
                       SPLIT_K=config.split_k, BLOCK=_REDUCE_BLOCK, **({"num_warps": 4} if options else {}))
    return out
