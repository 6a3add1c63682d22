"""torch_npu adapters for the quantization ops (ops/quant.py), mixed into ops/npu/ops.py's NpuOps.

Each adapter has its op's signature and maps it onto the torch_npu ops vllm-ascend uses for W8A8 / W8A8_DYNAMIC and
weight-only linears (semantics from the op-plugin docs, docs/context/torch_npu-<name>.md, and the aclnn docs):
  * dynamic_quant: npu_dynamic_quant (scale = rowmax|x| / 127, y = round(x / scale)); a static input_scale:
    npu_quantize(x, 1 / input_scale, None, qint8, -1, div_mode=False), vllm-ascend's static form;
  * scaled_mm (int8): npu_quant_matmul(a, b.t(), b_scale, pertoken_scale=a_scale, bias, output_dtype);
  * wo_linear: npu_weight_quant_batchmatmul(x, qweight.t(), scale.t(), offset.t(), bias, antiquant_group_size),
    which dequantizes w = (q + offset) * scale: offset = zeros / scales (int8), 8 + zeros / scales for int4, whose
    unsigned codes become signed (q - 8) packed 8 a int32 by npu_convert_weight_to_int4pack;
  * rms_norm_quant: npu_rms_norm + npu_dynamic_quant; add_rms_norm_quant: npu_add_rms_norm_dynamic_quant
    (output_mask [True, False], as vllm-ascend's AddRMSNormDynamicQuantPattern), static: npu_add_rms_norm_quant
    with the scale and a zero offset expanded to the hidden size, as vllm-ascend's AddRMSNormQuantPattern;
    silu_and_mul_quant: npu_swiglu + npu_dynamic_quant.
Outside what the ops document, the adapters run the op's reference (plain torch ops, which run on an NPU):
fp8 (no float8 on Atlas A2/A3; the quantization pipeline refuses fp8 off cuda anyway), activations that are
not fp16/bf16 (every op here documents fp16/bf16 activations only), an fp32 scaled_mm output (npu_quant_matmul
has no fp32 output with a per-token scale: the composed form is an fp32 matmul of the codes, exact products),
and weight-only group sizes npu_weight_quant_batchmatmul refuses (per group: a multiple of 32 below K).

Assumed where the documentation is silent (tests/npu_emulation.py emulates exactly these assumptions):
  * "round" is round half to even and out-of-range codes saturate (to -128..127);
  * npu_dynamic_quant on an all-zero row gives codes 0 and scale 0: the adapter floors scales at 1e-10 as the
    reference does (one clamp, so the scale of a zero row matches);
  * antiquant_scale / antiquant_offset in x's dtype (documented: "must equal x's dtype") round the fp32 scales and
    the derived offsets; static activation scales are passed in x's dtype as vllm-ascend passes them; codes may
    then differ from the reference's by one and weight-only outputs by bf16 rounding of the scales;
  * the int32 int4 packing is npu_convert_weight_to_int4pack's business: it is called on [N, K] int32 codes and
    the result passed transposed (its documented example for a transposed weight); K must be a multiple of 8.
The int4 repacking and the antiquant tensors are derived once per weight and cached (keyed by the tensors'
storage, shape and version; never inside a graph capture, which recomputes them instead).

Not run on NPU hardware by this project: verified against tests/npu_emulation.py only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from graphinfer.ops.quant import (_MIN_SCALE, add_rms_norm_quant, dynamic_quant, rms_norm_quant, silu_and_mul_quant,
                                  unpack_int4, wo_linear)

QUANT_NPU_OPS = ("dynamic_quant", "scaled_mm", "wo_linear", "rms_norm_quant", "add_rms_norm_quant",
                 "silu_and_mul_quant")
_HALF = (torch.float16, torch.bfloat16)


def _key(*tensors: Tensor | None) -> tuple:
    return tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
                 if t is not None else None for t in tensors)


class NpuQuantOps:
    """The quantization adapters; NpuOps (ops/npu/ops.py) inherits them and provides `torch_npu`."""

    def _init_quant(self) -> None:
        self._wo_cache: dict = {}  # _antiquant's derived tensors per weight

    # ----- activation quantization -----
    def dynamic_quant(self, x: Tensor, quant_dtype: str, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if quant_dtype != "int8" or x.dtype not in _HALF:
            return dynamic_quant.reference(x, quant_dtype, input_scale)
        if input_scale is not None:
            return self._static_quant(x, input_scale)
        q, scale = self.torch_npu.npu_dynamic_quant(x)  # scale: x.shape[:-1], fp32
        return q, scale.unsqueeze(-1).clamp(min=_MIN_SCALE)

    def _static_quant(self, y: Tensor, input_scale: Tensor) -> tuple[Tensor, Tensor]:
        """npu_quantize with div_mode False: y * (1 / input_scale), the reciprocal expanded to the hidden size in y's
        dtype (vllm-ascend's aclnn_input_scale_reciprocal)."""
        k = y.shape[-1]
        inv = input_scale.reshape(1).float().reciprocal().to(y.dtype).expand(k).contiguous()
        q = self.torch_npu.npu_quantize(y, inv, None, torch.qint8, -1, False)
        return q, input_scale.float().reshape(1, 1).expand(*y.shape[:-1], 1).contiguous()

    def rms_norm_quant(self, x: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                       input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if quant_dtype != "int8" or x.dtype not in _HALF:
            return rms_norm_quant.reference(x, weight, eps, quant_dtype, input_scale)
        y = self.torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
        return self.dynamic_quant(y, quant_dtype, input_scale)

    def add_rms_norm_quant(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant_dtype: str,
                           input_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if quant_dtype != "int8" or x.dtype not in _HALF:
            return add_rms_norm_quant.reference(x, residual, weight, eps, quant_dtype, input_scale)
        tnpu = self.torch_npu
        if input_scale is None:  # -> (y1, y2, x1 + x2, scale1, scale2); y2 / scale2 unused with output_mask[1] False
            q, _, new_residual, scale, _ = tnpu.npu_add_rms_norm_dynamic_quant(x, residual, weight, epsilon=eps,
                                                                                output_mask=[True, False])
            return q, scale.unsqueeze(-1).clamp(min=_MIN_SCALE), new_residual
        k = x.shape[-1]
        scales = input_scale.reshape(1).to(x.dtype).expand(k).contiguous()  # div_mode True: y / scales1
        q, _, new_residual = tnpu.npu_add_rms_norm_quant(x, residual, weight, scales, torch.zeros_like(scales),
                                                         epsilon=eps)
        return q, input_scale.float().reshape(1, 1).expand(*x.shape[:-1], 1).contiguous(), new_residual

    def silu_and_mul_quant(self, x: Tensor, quant_dtype: str,
                           input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if quant_dtype != "int8" or x.dtype not in _HALF:
            return silu_and_mul_quant.reference(x, quant_dtype, input_scale)
        return self.dynamic_quant(self.torch_npu.npu_swiglu(x, dim=-1), quant_dtype, input_scale)

    # ----- GEMMs -----
    def scaled_mm(self, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None,
                  out_dtype: torch.dtype) -> Tensor:
        if a.dtype != torch.int8 or out_dtype not in _HALF:
            # fp8 (no A2/A3 form) or an fp32 output: an fp32 matmul of the codes (products exact; the reference's
            # fp64 sum is not available on the device), then the reference's epilogue
            out = (a.float() @ b.float().t()) * a_scale.float() * b_scale.float()
            return (out if bias is None else out + bias.float()).to(out_dtype)
        if a.shape[0] == 0:
            return a.new_empty(0, b.shape[0], dtype=out_dtype)
        # x2 (K, N): the transposed view of b [N, K] (documented: "x2.t()" of an (n, k) int8 weight)
        return self.torch_npu.npu_quant_matmul(a, b.t(), b_scale.float().reshape(-1),
                                               pertoken_scale=a_scale.float().reshape(-1),
                                               bias=None if bias is None else bias.float(), output_dtype=out_dtype)

    def wo_linear(self, x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
                  bias: Tensor | None) -> Tensor:
        n, groups = scales.shape
        k = qweight.shape[1] * (2 if bits == 4 else 1)
        group = k // groups
        per_group_ok = groups == 1 or (group % 32 == 0 and group < k)
        if x.dtype not in _HALF or not per_group_ok or (bits == 4 and k % 8) or x.shape[0] == 0 or max(n, k) > 65535:
            return wo_linear.reference(x, qweight, scales, zeros, bits, bias)
        weight, scale_t, offset_t = self._antiquant(qweight, scales, zeros, bits, x.dtype)
        if bias is not None:  # documented: fp32 bias with bf16 x, fp16 with fp16
            bias = bias.float() if x.dtype == torch.bfloat16 else bias.to(torch.float16)
        return self.torch_npu.npu_weight_quant_batchmatmul(x, weight, scale_t, offset_t, bias=bias,
                                                           antiquant_group_size=0 if groups == 1 else group)

    def _antiquant(self, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        """(weight (K, N) view, antiquant_scale, antiquant_offset) for npu_weight_quant_batchmatmul, once per weight."""
        key = (_key(qweight, scales, zeros), bits, dtype)
        hit = self._wo_cache.get(key)
        if hit is not None:
            return hit[0]
        s = scales.float()
        offset = None if zeros is None else zeros.float() / s  # w = q * s + z = (q + z / s) * s
        if bits == 4:  # unsigned codes 0..15 -> signed q - 8 (int4's range): w = (q' + 8 + z / s) * s
            offset = 8.0 + (torch.zeros_like(s) if offset is None else offset)
            signed = (unpack_int4(qweight).to(torch.int32) - 8).contiguous()  # [N, K]
            weight = self.torch_npu.npu_convert_weight_to_int4pack(signed).t()  # [N, K / 8] int32, viewed (K/8, N)
        else:
            weight = qweight.t()  # (K, N) view of the int8 codes: the transposed input the docs recommend
        # per channel (N,); per group (K / group, N): transposed views of [N, groups]
        scale_t = s.to(dtype).t().contiguous()
        offset_t = None if offset is None else offset.to(dtype).t().contiguous()
        if scales.shape[1] == 1:
            scale_t = scale_t.reshape(-1)
            offset_t = None if offset_t is None else offset_t.reshape(-1)
        out = (weight, scale_t, offset_t)
        if not self.torch_npu.npu.is_current_stream_capturing():  # capture-made tensors live in the graph pool
            self._wo_cache[key] = (out, (qweight, scales, zeros))  # the sources stay alive: their keys stay unique
        return out

