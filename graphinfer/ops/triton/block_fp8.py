"""Triton kernels for graphinfer::block_fp8_linear (ops/quant.py holds the contract and the reference): DeepSeek-V3's
block-FP8 linears kept in float8_e4m3fn, the design of vLLM's w8a8_block_fp8_matmul (per_token_group_quant_fp8, then
_w8a8_block_fp8_matmul in vllm/model_executor/layers/quantization/utils/fp8_utils.py). Two launches:

  * _group_quant_kernel: one program per (token, group of block_k columns), 1-D grid T * ceil(K / block_k): the
    group's scale max(max|x| / 448, 1e-10) and its codes, rounded to the e4m3 grid as quant.py's dynamic_quant rounds
    them (IEEE division, explicit round-half-even to e4m3: the interpreters' fp32 -> fp8 cast mis-rounds), so codes
    and scales equal the reference's exactly. The last group is ragged where block_k does not divide K.
  * _block_fp8_mm_kernel: 1-D grid of cdiv(T, BLOCK_M) * cdiv(N, BLOCK_N) output tiles; the K loop steps one
    activation group (= one weight block column) at a time, BLOCK_K = block_k rounded up to a power of two (>= 16,
    tl.dot's minimum) with the columns past the group or past K masked; per step tl.dot of the fp8 code tiles with
    fp32 accumulation, scaled by the [BLOCK_M] activation scales of that group and the [BLOCK_N] weight scales
    gathered per column (weight_scale[n // block_n, g]: any block_n, ragged edge blocks included), as vLLM's
    `accumulator += tl.dot(a, b) * a_s[:, None] * b_s[None, :]`. Bias added in fp32, the output cast to x's dtype
    (round-half-even, quant.py's _cast). fp8 x fp8 products are exact in fp32, so against the reference (dequantize
    both, one fp32 matmul) the result differs by fp32 summation order alone.

Interpreters. Upstream Triton 3.6's interpreter loads float8_e4m3fn tiles and runs tl.dot on them (checked: exact
fp32 results on 16 x 16 tiles); it is the fp32 -> fp8 *cast* that mis-rounds (31.6 -> 16), which the explicit
rounding above avoids. As quant.py's scaled_mm, interpreted dots take fp32 operands (DOT_F32, exact for fp8 codes),
so the interpreted kernel is the W8A8 form itself, not a weight-only W8A16 stand-in. Triton-Ascend 3.2's interpreter
runs the group-quant kernel (its fp32 -> fp8 store cast included) but refuses the GEMM's masked fp8 loads: it casts
the load's `other` (0.0) to fp8, and its cast refuses fp8 on every target but 910_95 ("[fp8, fp64] is unsupported on
Ascend for now"), the check its compiler applies too. Atlas A2 / A3 (910B / 910C) have no fp8 anyway, so npu
dequantizes these checkpoints at load (platforms/npu.py), the wrapper refuses npu tensors, and the kernel tests skip
under Triton-Ascend. Not run on a GPU yet: tests/test_block_fp8.py's gpu-marked test is its first check
(docs/quantization.md gives the command).

Triton-Ascend subset kept anyway (one source): 1-D grids, masks on every ragged access, block sizes constexpr, no
fp64, the token count not specialised on, the K loop to a scalar runtime bound. Tiles are untuned (quant.py's
_gemm_tiles; vLLM's untuned default is BLOCK_M 64, BLOCK_N = block_n, BLOCK_K = block_k, 4 warps, 2 stages).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2
from graphinfer.ops.triton.quant import _gemm_tiles, _interpreted, _refuse_fp8_on_npu, _round_to_e4m3, _rows, _store_tile


@triton.jit(do_not_specialize=["n_rows"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, n_rows, K, n_groups, stride_x, GROUP: tl.constexpr,
                        IEEE_DIV: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // n_groups
    g = pid % n_groups
    offs = tl.arange(0, BLOCK)
    ks = g * GROUP + offs
    mask = (offs < GROUP) & (ks < K)
    y = tl.load(x_ptr + row * stride_x + ks, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(y), axis=0)
    if IEEE_DIV:
        scale = tl.math.div_rn(amax, 448.0)
    else:
        scale = amax / 448.0
    scale = tl.maximum(scale, 1e-10)
    if IEEE_DIV:
        v = tl.math.div_rn(y, scale)
    else:
        v = y / scale
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + row * K + ks, _round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale)


@triton.jit(do_not_specialize=["M"])
def _block_fp8_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K, n_groups, stride_am, stride_bn,
                         stride_bsn, stride_om, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    in_group = offs_k < GROUP_K
    bs_rows = (cols // GROUP_N) * stride_bsn  # each output column's row of weight blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, n_groups):
        ks = g * GROUP_K + offs_k
        k_mask = in_group & (ks < K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(b_ptr + cols[:, None] * stride_bn + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a_s = tl.load(as_ptr + rows * n_groups + g, mask=row_mask, other=0.0)
        b_s = tl.load(bs_ptr + bs_rows + g, mask=col_mask, other=0.0)
        if DOT_F32:  # interpreters: fp8 products are exact in fp32
            d = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(a, tl.trans(b))  # float8e4nv x float8e4nv, fp32 accumulation (sm_89+)
        acc += d * a_s[:, None] * b_s[None, :]
    _store_tile(acc, out_ptr, bias_ptr, rows, cols, row_mask, col_mask, stride_om, HAS_BIAS)


_GROUP_QUANT = Launcher(_group_quant_kernel)
_BLOCK_FP8_MM = Launcher(_block_fp8_mm_kernel)


def per_token_group_quant(x2: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x2 [T, K] (rows contiguous) -> (float8_e4m3fn codes [T, K], fp32 scales [T, ceil(K / group)]): ops/quant.py's
    quantize_per_token_group."""
    m, k = x2.shape
    n_groups = cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty((m, n_groups), dtype=torch.float32, device=x2.device)
    if m:
        block = next_power_of_2(group)
        options = {"num_warps": min(max(block // 256, 1), 8)} if x2.device.type == "cuda" else {}
        _GROUP_QUANT.launch((m * n_groups,), x2, q, s, m, k, n_groups, x2.stride(0), GROUP=group, IEEE_DIV=True,
                            BLOCK=block, **options)
    return q, s


def block_fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, block_n: int, block_k: int,
                     bias: Tensor | None) -> Tensor:
    """x [..., K] @ W.T + bias in x's dtype, W = weight (float8_e4m3fn [N, K]) * weight_scale (fp32 [ceil(N / block_n),
    ceil(K / block_k)]) per block; x quantized per token per block_k columns."""
    n, k = weight.shape
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _refuse_fp8_on_npu(x.device)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_fp8_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    if tuple(weight_scale.shape) != (cdiv(n, block_n), cdiv(k, block_k)):
        raise ValueError(f"block_fp8_linear: weight_scale {tuple(weight_scale.shape)} for a [{n}, {k}] weight in "
                         f"[{block_n}, {block_k}] blocks, expected [{cdiv(n, block_n)}, {cdiv(k, block_k)}]")
    x2 = _rows(x)
    m = x2.shape[0]
    q, s = per_token_group_quant(x2, block_k)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    weight_scale = weight_scale.float().contiguous()
    block_m, tile_n, options = _gemm_tiles(m, n, x.device.type)
    block_k_tile = max(next_power_of_2(block_k), 16)
    has_bias = bias is not None
    _BLOCK_FP8_MM.launch((cdiv(m, block_m) * cdiv(n, tile_n),), q, s, weight, weight_scale,
                         bias if has_bias else weight_scale, out.view(m, n), m, n, k, cdiv(k, block_k), q.stride(0),
                         weight.stride(0), weight_scale.stride(0), n, GROUP_N=block_n, GROUP_K=block_k,
                         HAS_BIAS=has_bias, DOT_F32=_interpreted(), BLOCK_M=block_m, BLOCK_N=tile_n,
                         BLOCK_K=block_k_tile, **options)
    return out


BLOCK_FP8_OPS = {"block_fp8_linear": block_fp8_linear}
