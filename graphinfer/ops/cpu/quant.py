"""CPU implementations of the quantized-linear ops (the cpu platform's default; ops/quant.py stays the oracle).

- wo_linear (weight-only, bits 4 / 8, grouped scales, optional zeros): the C++ kernel of csrc/cpu/quant_linear.cpp
  (built by `make`, see ops/cpu/ext.py) reads the packed weight as it is: for a few tokens it streams each row once
  and accumulates on the widened codes in vector registers (AVX-512 / AVX2), for many tokens it multiplies
  panels of dequantized rows in a register-tiled GEMM of its own (AVX2: gemm_f32; bf16: gemm_bf16) or, for the
  AVX-512 build's fp32 forms, dequantized chunks of rows with at::mm. torch's own CPU kernels for these forms
  (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) measured slower than fp32 F.linear at SmolLM2's shapes
  (tools/cpu_quant_bench.py).
  Without the library (or for an x / scale layout the kernel does not take) it is the reference: dequantize, then
  F.linear in fp32. Scales and zeros may be fp16 (GGUF's width) or fp32.
  GRAPHINFER_CPU_WO_ACTIVATIONS (cpu_quant_ops) picks the arithmetic of group-32 forms (GGUF Q4_0 / Q4_1 / Q8_0 /
  Q4_K): batches of >= 64 tokens in bf16 where the CPU has native bf16 (gemm_bf16: bf16 operands, fp32 sums), and
  with int8 their decode on csrc/cpu/quant_linear_a8.cpp, llama.cpp's arithmetic (activations rounded to int8 per
  block of 32, integer dot products), and their batches too where the build has AVX-512 VNNI (gemm_vnni). The
  default (auto) takes int8 where the best a8 path is AVX2's: there the exact kernel is bound by its vector ops (the
  AVX2 Zen 3 VM: the int8 kernel 0.65-0.9x its time at 1 token); on AVX-512 hosts both stream the weights at the
  same bandwidth, so decode stays exact there, and batches take gemm_vnni where there is no AMX.
- dynamic_quant (int8) and scaled_mm (int8 x int8, the w8a8 scheme): csrc/cpu/quant_int8.cpp, bit for bit as the
  references: one pass per token row for the quantization, at::_int_mm (oneDNN, exact int32) and one fused
  scale / bias / cast pass for the GEMM (the reference multiplies in fp64). fp8 stays on the references.
- rms_norm_quant, add_rms_norm_quant, silu_and_mul_quant (made by fuse_rmsnorm_quant / fuse_silu_mul_quant): the
  cpu rms_norm / add_rms_norm / silu_and_mul kernels (ops/cpu/elementwise.py) followed by dynamic_quant_cpu, i.e.
  exactly the unfused graph's arithmetic on this platform, so fused and unfused give the same int8 codes and
  scales bit for bit. Their references (the unfused composition on the *reference* norm) would not: the C++ norm
  differs from the PyTorch one by fp32 ulps (its sum order), which flips a code wherever x / scale lies at a .5
  boundary, and the pass check then saw a different model (issue 55, item 4). The fusion saves no pass over x
  here yet (one C++ kernel doing both is a later step); what it must not do is change the codes.
"""
import torch
from torch import Tensor

from graphinfer import envs
from graphinfer.errors import InvalidConfigError
from graphinfer.ops.cpu import ext
from graphinfer.ops.cpu.elementwise import add_rms_norm_cpu, rms_norm_cpu, silu_and_mul_cpu
from graphinfer.ops.quant import dynamic_quant, scaled_mm, wo_linear

_wo_linear_ref = wo_linear.reference
_dynamic_quant_ref = dynamic_quant.reference
_scaled_mm_ref = scaled_mm.reference
_NATIVE_OPS = ("wo_linear", "wo_linear_a8", "dynamic_quant_int8", "scaled_mm_int8")
_native_ops: bool | None = None


def native_available() -> bool:
    """Whether the C++ quantized kernels are loaded (a library built before they existed lacks them)."""
    global _native_ops
    if not ext.available():
        return False
    if _native_ops is None:
        _native_ops = all(hasattr(torch.ops.graphinfer_cpu_quant, name) for name in _NATIVE_OPS)
    return _native_ops


_SCALE_DTYPES = (torch.float32, torch.float16)
A8_MAX_TOKENS = 64  # from here on a GEMM: wo_linear_a8's VNNI one or wo_linear's
_bf16_gemm = False  # wo_linear_a8_cpu's GEMM in bf16: set by cpu_quant_ops (the platform knows the CPU)
_a8_decode = False  # wo_linear_a8_cpu's decode on int8 activations (GRAPHINFER_CPU_WO_ACTIVATIONS=int8)
_a8_gemm = False  # batches (>= 64 tokens) on int8 activations: wo_linear_a8's VNNI GEMM


def wo_linear_cpu(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
                  bias: Tensor | None, bf16_gemm: bool = False) -> Tensor:
    """Exact: fp32 activations (csrc/cpu/quant_linear.cpp); bf16_gemm: many tokens multiplied in bf16."""
    if native_available() and x.dim() >= 1 and scales.dtype in _SCALE_DTYPES and (
            zeros is None or zeros.dtype == scales.dtype):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = torch.ops.graphinfer_cpu_quant.wo_linear.default(x2, qweight, scales, zeros, bits, bias, bf16_gemm)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])
    return _wo_linear_ref(x, qweight, scales, zeros, bits, bias)


def wo_linear_a8_cpu(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
                     bias: Tensor | None) -> Tensor:
    """Group-32 forms (GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K): at decode, with _a8_decode, llama.cpp's arithmetic
    (csrc/cpu/quant_linear_a8.cpp: activations rounded to int8 per block of 32), else the exact kernel; batches
    (>= 64 tokens), with _a8_gemm, the same arithmetic in wo_linear_a8's VNNI GEMM, else wo_linear_cpu's GEMM in bf16
    where the CPU multiplies bf16 natively (2x the fp32 GEMM; bf16's rounding). Other forms (other group sizes: Q6_K,
    int4_wo, int8_wo): wo_linear_cpu, exact."""
    k = x.shape[-1]
    group32 = (x.dim() >= 1 and k % 64 == 0 and scales.dim() == 2 and scales.shape[1] * 32 == k
               and scales.dtype in _SCALE_DTYPES and (zeros is None or zeros.dtype == scales.dtype))
    if not (group32 and native_available()):
        return wo_linear_cpu(x, qweight, scales, zeros, bits, bias)
    # the C++ ops called from here (not through wo_linear_cpu): a decode step makes ~120 of these calls at batch 1
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if (_a8_decode if x2.shape[0] < A8_MAX_TOKENS else _a8_gemm and (bits == 4 or zeros is None)):
        out = torch.ops.graphinfer_cpu_quant.wo_linear_a8.default(x2, qweight, scales, zeros, bias)
    else:
        out = torch.ops.graphinfer_cpu_quant.wo_linear.default(x2, qweight, scales, zeros, bits, bias, _bf16_gemm)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def dynamic_quant_cpu(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if quant_dtype == "int8" and native_available():
        return torch.ops.graphinfer_cpu_quant.dynamic_quant_int8.default(x, input_scale)
    return _dynamic_quant_ref(x, quant_dtype, input_scale)


def scaled_mm_cpu(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None,
                  out_dtype: torch.dtype) -> Tensor:
    if a.dtype == torch.int8 and b.dtype == torch.int8 and a.dim() == 2 and native_available():
        return torch.ops.graphinfer_cpu_quant.scaled_mm_int8.default(a, a_scale, b, b_scale, bias, out_dtype)
    return _scaled_mm_ref(a, a_scale, b, b_scale, bias, out_dtype)


def rms_norm_quant_cpu(x: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                       input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return dynamic_quant_cpu(rms_norm_cpu(x, weight, eps), quant_dtype, input_scale)


def add_rms_norm_quant_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                           input_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    normed, new_residual = add_rms_norm_cpu(x, residual, weight, eps)
    q, scale = dynamic_quant_cpu(normed, quant_dtype, input_scale)
    return q, scale, new_residual


def silu_and_mul_quant_cpu(x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return dynamic_quant_cpu(silu_and_mul_cpu(x), quant_dtype, input_scale)


CPU_QUANT_OPS = {"wo_linear": wo_linear_cpu, "dynamic_quant": dynamic_quant_cpu, "scaled_mm": scaled_mm_cpu,
                 "rms_norm_quant": rms_norm_quant_cpu, "add_rms_norm_quant": add_rms_norm_quant_cpu,
                 "silu_and_mul_quant": silu_and_mul_quant_cpu}


def cpu_quant_ops(native_bf16: bool = False, amx: bool = False) -> dict:
    """CPU_QUANT_OPS with wo_linear as $GRAPHINFER_CPU_WO_ACTIVATIONS says (bf16: the GEMM of many tokens in bf16
    where the CPU has native_bf16; int8: llama.cpp's arithmetic at decode and, where the build has AVX-512 VNNI, in
    batches too; fp32: exact throughout; auto: int8 where the int8 kernel's best path is AVX2; with AVX-512 VNNI and
    no AMX, exact decode and int8 batches (the VNNI GEMM measured faster than gemm_bf16 and oneDNN's bf16 linear on
    the Zen 5 host: docs/benchmarks.md); else bf16 (AMX: its bf16 tiles, the VNNI GEMM unmeasured there))."""
    global _bf16_gemm, _a8_decode, _a8_gemm
    mode = envs.GRAPHINFER_CPU_WO_ACTIVATIONS
    if mode not in ("auto", "bf16", "int8", "fp32"):
        raise InvalidConfigError(f"GRAPHINFER_CPU_WO_ACTIVATIONS={mode!r}: use auto (the default), bf16, int8 or fp32.")
    isa = torch.ops.graphinfer_cpu_quant.wo_linear_a8_isa() if native_available() else 0
    _bf16_gemm = native_bf16
    _a8_decode = mode == "int8" or (mode == "auto" and isa == 1)
    _a8_gemm = isa == 2 and (mode == "int8" or (mode == "auto" and not amx))
    return {**CPU_QUANT_OPS, "wo_linear": wo_linear_cpu if mode == "fp32" else wo_linear_a8_cpu}
