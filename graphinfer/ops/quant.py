"""Quantization ops: activations quantized per token at run time, int8 / fp8 GEMMs with scales, weight-only linears.

The packed weight forms every implementation reads (graphinfer/quantization/ builds them from checkpoints):
- w8a8 / fp8 (`scaled_mm`): b [N, K] int8 or float8_e4m3fn, b_scale [N] fp32 (per output channel);
  activations quantized per token, symmetric: a [T, K] of the same dtype, a_scale [T, 1] fp32.
- weight-only (`wo_linear`), bits 8: qweight int8 [N, K], w = q * scales[n, k // g] (+ zeros, if given);
  bits 4: qweight uint8 [N, K // 2], element k in byte k // 2, even k in the low nibble, odd k in the high one,
  codes q in [0, 15], w = q * scales[n, k // g] + zeros[n, k // g]. scales / zeros [N, K // g] fp32, g the
  group size (g = K: per channel). GGUF blocks map onto these forms with their codes unchanged
  (quantization/gguf.py).
- block FP8 (`block_fp8_linear`, DeepSeek-V3's checkpoints, vLLM's w8a8_block_fp8_matmul): weight float8_e4m3fn
  [N, K], weight_scale fp32 [ceil(N / bn), ceil(K / bk)], w[n, k] = weight[n, k] * weight_scale[n // bn, k // bk]
  (edge blocks ragged); activations quantized to float8_e4m3fn per token per group of bk columns (the last group
  ragged where bk does not divide K), scale = max(max|x_group| / 448, 1e-10).
The references below dequantize and compute in fp32 (fp64 for the int8 GEMM, exact): they are the oracle of every
kernel. The fused norm / activation + quant ops exist for the passes (fuse_rmsnorm_quant, fuse_silu_mul_quant);
their references are the unfused composition, so a pass's check is exact on reference kernels.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake
from graphinfer.ops.norm import rms_norm_ref

QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_MIN_SCALE = 1e-10  # an all-zero token row gets this scale and codes 0


def quantize_per_token(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric per-token quantization of the last dim: scale = max|x| / qmax per row (or the static
    input_scale), codes round-half-even (int8) or cast (fp8)."""
    xf = x.float()
    qmax = INT8_MAX if quant_dtype == "int8" else FP8_MAX
    if input_scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp(min=_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(*x.shape[:-1], 1)
    q = (xf / scale).clamp(-qmax, qmax)
    q = q.round().to(torch.int8) if quant_dtype == "int8" else q.to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def unpack_int4(qweight: Tensor) -> Tensor:
    """[N, K // 2] uint8 -> [N, K] uint8 codes in [0, 15] (even k from the low nibble)."""
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(codes: Tensor) -> Tensor:
    """[N, K] codes in [0, 15] (K even) -> [N, K // 2] uint8, the inverse of unpack_int4."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def dequantize_weight(qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int) -> Tensor:
    """The fp32 [N, K] weight a weight-only linear computes with."""
    q = (unpack_int4(qweight) if bits == 4 else qweight).float()
    n, k = q.shape
    g = k // scales.shape[1]
    w = q.view(n, -1, g) * scales.float().unsqueeze(-1)
    if zeros is not None:
        w = w + zeros.float().unsqueeze(-1)
    return w.view(n, k)


def quantize_per_token_group(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (float8_e4m3fn codes [T, K], fp32 scales [T, ceil(K / group)]): quantize_per_token's fp8 math on
    each group of `group` columns (vLLM's per_token_group_quant_fp8 with graphinfer's 1e-10 floor; the last group
    holds K % group columns where group does not divide K)."""
    T, K = x.shape
    G = -(-K // group)
    xf = x.new_zeros((T, G * group), dtype=torch.float32)  # the ragged last group padded with zeros, then cut
    xf[:, :K] = x
    groups = xf.view(T, G, group)
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=_MIN_SCALE)  # [T, G]
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(T, G * group)[:, :K]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_blocks(codes: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """fp32 codes[i, j] * scale[i // b0, j // b1] of [N, K] codes with per-block scales (ragged edge blocks)."""
    b0, b1 = block
    (N, K), (nb, kb) = codes.shape, scale.shape
    w = codes.new_zeros((nb * b0, kb * b1), dtype=torch.float32)  # whole blocks (ragged edges padded), then cut
    w[:N, :K] = codes
    w.view(nb, b0, kb, b1).mul_(scale.float()[:, None, :, None])
    return w[:N, :K]


@graphinfer_op(row_wise=True)
def dynamic_quant(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, K] -> (codes [T, K] int8 / float8_e4m3fn, scale [T, 1] fp32): per-token scales, or the static
    input_scale [1] of a checkpoint quantized with static activation scales."""
    return quantize_per_token(x, quant_dtype, input_scale)


@register_fake(dynamic_quant)
def _(x, quant_dtype, input_scale=None):
    return x.new_empty(x.shape, dtype=QUANT_DTYPES[quant_dtype]), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@graphinfer_op(row_wise=True)
def scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None,
              out_dtype: torch.dtype) -> Tensor:
    """(a @ b.T) * a_scale * b_scale + bias in out_dtype: a [T, K], b [N, K] both int8 (exact int32
    accumulation) or both float8_e4m3fn (fp32 accumulation); a_scale [T, 1], b_scale [N] fp32."""
    if a.dtype == torch.int8:
        acc = (a.double() @ b.double().T).float()
    else:
        acc = a.float() @ b.float().T
    out = acc * a_scale.float() * b_scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@register_fake(scaled_mm)
def _(a, a_scale, b, b_scale, bias, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@graphinfer_op(row_wise=True)
def wo_linear(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
              bias: Tensor | None) -> Tensor:
    """x [T, K] @ dequantized(qweight).T + bias, in x's dtype: the weight stays packed (bits 4 or 8, see the
    module docstring); the group size is K // scales.shape[1]."""
    out = F.linear(x.float(), dequantize_weight(qweight, scales, zeros, bits))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@register_fake(wo_linear)
def _(x, qweight, scales, zeros, bits, bias):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@graphinfer_op(row_wise=True)
def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                   input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dynamic_quant(rms_norm(x, weight, eps)): one pass over x instead of two (fuse_rmsnorm_quant)."""
    return quantize_per_token(rms_norm_ref(x, weight, eps), quant_dtype, input_scale)


@register_fake(rms_norm_quant)
def _(x, weight, eps, quant_dtype, input_scale=None):
    return x.new_empty(x.shape, dtype=QUANT_DTYPES[quant_dtype]), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@graphinfer_op(row_wise=True)
def add_rms_norm_quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                       input_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """add_rms_norm's normalised output quantized per token: (codes, scale, residual') (fuse_rmsnorm_quant)."""
    new_residual = x + residual
    q, scale = quantize_per_token(rms_norm_ref(new_residual, weight, eps), quant_dtype, input_scale)
    return q, scale, new_residual


@register_fake(add_rms_norm_quant)
def _(x, residual, weight, eps, quant_dtype, input_scale=None):
    return (x.new_empty(x.shape, dtype=QUANT_DTYPES[quant_dtype]),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32), torch.empty_like(x))


@graphinfer_op(row_wise=True)
def silu_and_mul_quant(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dynamic_quant(silu_and_mul(x)) (fuse_silu_mul_quant): x [T, 2d] -> codes [T, d], scale [T, 1]."""
    d = x.shape[-1] // 2
    return quantize_per_token(F.silu(x[..., :d]) * x[..., d:], quant_dtype, input_scale)


@register_fake(silu_and_mul_quant)
def _(x, quant_dtype, input_scale=None):
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    return x.new_empty(shape, dtype=QUANT_DTYPES[quant_dtype]), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@graphinfer_op(row_wise=True)
def block_fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, block_n: int, block_k: int,
                     bias: Tensor | None) -> Tensor:
    """x [..., K] @ W.T + bias in x's dtype, W the block-FP8 weight (module docstring): x is quantized to fp8 per
    token per group of block_k columns (quantize_per_token_group) and the product taken on the codes with fp32
    accumulation, scaled per (token group, weight block). The reference computes exactly that math, in the
    dequantized form: (codes * their group's scale) @ (weight * its block's scale).T in fp32; fp8 x fp8 products
    are exact in fp32, so a kernel that sums each group's code products in fp32 and scales them differs from it
    by fp32 summation order alone."""
    K = x.shape[-1]
    q, scale = quantize_per_token_group(x.reshape(-1, K), block_k)
    xd = dequantize_blocks(q, scale, (1, block_k))
    out = xd @ dequantize_blocks(weight, weight_scale, (block_n, block_k)).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@register_fake(block_fp8_linear)
def _(x, weight, weight_scale, block_n, block_k, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
