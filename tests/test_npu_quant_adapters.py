"""The torch_npu quantization adapters (graphinfer/ops/npu/quant.py) against the reference ops, run against
tests/npu_emulation.py (an emulation of torch_npu that follows the documented semantics and the assumptions listed
there; no NPU is needed or used here).

Codes are compared within one of the reference's: the adapters hand torch_npu scales and offsets in the
activations' dtype (documented for the weight-only op, vllm-ascend's choice for static activation scales) and the
fused norms compute in fp32 without the reference's bf16 roundings. Outputs of the GEMMs within bf16 / fp16 rounding
of those scales.
"""
import pytest
import torch

import graphinfer.ops  # noqa: F401  (registers the graphinfer:: ops)
from graphinfer.ops.npu.ops import NPU_OPS, NpuOps
from graphinfer.ops.npu.quant import QUANT_NPU_OPS
from graphinfer.ops.quant import pack_int4
from npu_emulation import make_torch_npu

ref = torch.ops.graphinfer
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture
def ops():
    torch.manual_seed(0)
    return NpuOps(make_torch_npu())


def _calls(ops):
    return ops.torch_npu.emulation_state.calls


def _within_one(got, want):
    assert got.dtype == want.dtype == torch.int8 and got.shape == want.shape
    assert (got.int() - want.int()).abs().max() <= 1


def _x(rows, cols, dtype, scale=2.0):
    x = torch.randn(rows, cols) * scale
    x[1] = 0.0  # an all-zero row: the reference's scale is 1e-10
    return x.to(dtype)


def test_quant_ops_are_in_the_table(ops):
    assert set(QUANT_NPU_OPS) <= set(NPU_OPS) and set(QUANT_NPU_OPS) <= set(ops.table())


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quant(ops, dtype):
    x = _x(5, 96, dtype)
    q, scale = ops.dynamic_quant(x, "int8")
    want_q, want_scale = ref.dynamic_quant(x, "int8")
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)  # same formula, zero row floored at 1e-10
    assert _calls(ops) == ["npu_dynamic_quant"]


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quant_static_scale(ops, dtype):
    x, s = _x(5, 96, dtype), torch.tensor([0.021])
    q, scale = ops.dynamic_quant(x, "int8", s)
    want_q, want_scale = ref.dynamic_quant(x, "int8", s)
    _within_one(q, want_q)  # x * (1 / s), the reciprocal in x's dtype (vllm-ascend's form)
    assert torch.equal(scale, want_scale)
    assert _calls(ops) == ["npu_quantize"]


def test_outside_the_documented_forms_the_reference_runs(ops):
    """fp32 activations (the ops take fp16 / bf16) and fp8 (no float8 on A2/A3) never reach torch_npu."""
    x = _x(4, 64, torch.float32)
    for got, want in ((ops.dynamic_quant(x, "int8"), ref.dynamic_quant(x, "int8")),
                      (ops.dynamic_quant(x.bfloat16(), "fp8"), ref.dynamic_quant(x.bfloat16(), "fp8")),
                      (ops.silu_and_mul_quant(x, "int8"), ref.silu_and_mul_quant(x, "int8"))):
        for g, w in zip(got, want):
            assert torch.equal(g.float(), w.float())
    a, a_s = ref.dynamic_quant(x, "int8")
    b, b_s = ref.dynamic_quant(torch.randn(16, 64), "int8")
    torch.testing.assert_close(ops.scaled_mm(a, a_s, b, b_s.reshape(-1), None, torch.float32),
                               ref.scaled_mm(a, a_s, b, b_s.reshape(-1), None, torch.float32), rtol=1e-6, atol=1e-6)
    assert _calls(ops) == []


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_quant(ops, dtype, static):
    x, w = _x(5, 96, dtype), (torch.rand(96) + 0.5).to(dtype)
    s = torch.tensor([0.03]) if static else None
    q, scale = ops.rms_norm_quant(x, w, 1e-6, "int8", s)
    want_q, want_scale = ref.rms_norm_quant(x, w, 1e-6, "int8", s)
    _within_one(q, want_q)
    torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)  # rms computed without bf16 roundings
    assert _calls(ops) == ["npu_rms_norm", "npu_quantize" if static else "npu_dynamic_quant"]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_add_rms_norm_quant(ops, dtype, static):
    x, res, w = _x(5, 96, dtype), _x(5, 96, dtype), (torch.rand(96) + 0.5).to(dtype)
    s = torch.tensor([0.03]) if static else None
    q, scale, new_res = ops.add_rms_norm_quant(x, res, w, 1e-5, "int8", s)
    want_q, want_scale, want_res = ref.add_rms_norm_quant(x, res, w, 1e-5, "int8", s)
    _within_one(q, want_q)
    torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)
    assert torch.equal(new_res, want_res)
    assert _calls(ops) == ["npu_add_rms_norm_quant" if static else "npu_add_rms_norm_dynamic_quant"]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_silu_and_mul_quant(ops, dtype, static):
    x = _x(5, 2 * 80, dtype)
    s = torch.tensor([0.02]) if static else None
    q, scale = ops.silu_and_mul_quant(x, "int8", s)
    want_q, want_scale = ref.silu_and_mul_quant(x, "int8", s)
    _within_one(q, want_q)
    torch.testing.assert_close(scale, want_scale, rtol=1e-2, atol=0)
    assert _calls(ops) == ["npu_swiglu", "npu_quantize" if static else "npu_dynamic_quant"]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", HALF)
def test_scaled_mm_int8(ops, out_dtype, bias):
    a, a_scale = ref.dynamic_quant(torch.randn(7, 200), "int8")
    b, b_scale = ref.dynamic_quant(torch.randn(70, 200) / 200 ** 0.5, "int8")
    b_scale, bias_t = b_scale.reshape(-1), (torch.randn(70).to(out_dtype) if bias else None)
    got = ops.scaled_mm(a, a_scale, b, b_scale, bias_t, out_dtype)
    want = ref.scaled_mm(a, a_scale, b, b_scale, bias_t, out_dtype)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)  # the two scales multiply in another order
    assert _calls(ops) == ["npu_quant_matmul"]


def _weight(n, k, group, bits, zeros):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8) if bits == 8 else pack_int4(torch.randint(0, 16, (n, k)))
    scales = torch.rand(n, k // group) * 0.02 + 0.002
    z = torch.randn(n, k // group) * 0.05 if zeros else None
    return q, scales, z


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("group", [256, 32, 128])  # per channel (K = 256) and per group
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", HALF)
def test_wo_linear(ops, dtype, bits, group, zeros):
    n, k = 72, 256
    q, scales, z = _weight(n, k, group, bits, zeros)
    x, bias = torch.randn(5, k).to(dtype), torch.randn(n).to(dtype)
    for b in (None, bias):
        got = ops.wo_linear(x, q, scales, z, bits, b)
        want = ref.wo_linear(x, q, scales, z, bits, b)
        assert got.dtype == dtype and got.shape == (5, n)
        # scales and offsets in x's dtype (documented): relative error ~2**-9 (bf16) per weight
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    calls = _calls(ops)
    assert calls.count("npu_weight_quant_batchmatmul") == 2
    assert calls.count("npu_convert_weight_to_int4pack") == (1 if bits == 4 else 0)  # repacked once, then cached


def test_wo_linear_unsupported_groups_and_dtypes_run_the_reference(ops):
    """Group 16 (per group needs a multiple of 32) and fp32 activations: the reference, not torch_npu."""
    q, scales, z = _weight(40, 128, 16, 4, True)
    x = torch.randn(3, 128)
    torch.testing.assert_close(ops.wo_linear(x.bfloat16(), q, scales, z, 4, None),
                               ref.wo_linear(x.bfloat16(), q, scales, z, 4, None))
    q, scales, z = _weight(40, 128, 32, 8, False)
    torch.testing.assert_close(ops.wo_linear(x, q, scales, z, 8, None), ref.wo_linear(x, q, scales, z, 8, None))
    assert _calls(ops) == []


def test_wo_linear_cache_follows_the_weight(ops):
    """A weight updated in place (its version moves) is repacked; a capture never fills the cache."""
    q, scales, z = _weight(40, 64, 32, 4, True)
    x = torch.randn(2, 64).bfloat16()
    ops.wo_linear(x, q, scales, z, 4, None)
    q.copy_(pack_int4(torch.randint(0, 16, (40, 64))))
    torch.testing.assert_close(ops.wo_linear(x, q, scales, z, 4, None), ref.wo_linear(x, q, scales, z, 4, None),
                               rtol=2e-2, atol=2e-2)
    assert _calls(ops).count("npu_convert_weight_to_int4pack") == 2
