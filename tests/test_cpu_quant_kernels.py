"""The cpu platform's quantized linears (graphinfer/ops/cpu/quant.py: the C++ kernels of csrc/cpu/quant_linear.cpp and
quant_int8.cpp) against the reference ops of graphinfer/ops/quant.py, and their binding into the cpu platform's op
table. Skipped where the library is not built (python -m graphinfer.ops.cpu.ext); failed there under
GRAPHINFER_REQUIRE_CPU_KERNELS=1."""
import pytest
import torch

from graphinfer.ops.cpu import ext, quant as cpu_quant
from graphinfer.ops.quant import dequantize_weight, dynamic_quant, pack_int4, scaled_mm, wo_linear
from graphinfer.platforms import get_platform
from conftest import need_cpu_kernels

TOKENS = (1, 2, 5, 17, 64)  # 1..8: the register kernels (5: a partial token tile), 17: two tiles + 1, 64: the GEMM
# (N, K, group): N never a multiple of the row tiles; groups 16 / 32 / 64 / 128 and per-channel (None), K = 100 per
# channel and group 6 are no multiple of any vector chunk (the generic path)
dynamic_quant_ref = dynamic_quant.reference
SHAPES = [(37, 64, 16), (50, 96, 32), (150, 128, 64), (19, 256, 128), (23, 576, None), (13, 100, None), (9, 18, 6)]


def native():
    need_cpu_kernels(cpu_quant.native_available())
    return torch.ops.graphinfer_cpu_quant.wo_linear.default


def _weights(n, k, group, bits, zeros, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = k // (group or k)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, g, generator=gen) * 0.02 + 1e-3
    z = -torch.rand(n, g, generator=gen) * 0.1 if zeros else None
    b = torch.randn(n, generator=gen) if bias else None
    return qweight, scales, z, b


def _check(out, ref, x, w, dtype):
    """fp32: within 2e-6 of sum_k |x_k w_k| (the accumulation order is free; measured worst 2.5e-7); bf16: plus one
    bf16 rounding of the output."""
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    scale = x.float().abs() @ w.abs().T
    err = (out.float() - ref.float()).abs()
    bound = 2e-6 * scale + 1e-6
    if dtype == torch.bfloat16:
        bound = bound + 2 ** -7 * ref.float().abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeros,bias", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_wo_linear_matches_reference(bits, n, k, group, zeros, bias, dtype):
    op = native()
    qweight, scales, z, b = _weights(n, k, group, bits, zeros, bias)
    w = dequantize_weight(qweight, scales, z, bits)
    for t in TOKENS:
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dtype)
        ref = wo_linear.reference(x, qweight, scales, z, bits, b)
        _check(op(x, qweight, scales, z, bits, b), ref, x, w, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_wo_linear_gemm(bits):
    """Many tokens on the AVX2 path (gemm_f32): rows not a multiple of the 16-row panels, token counts with partial
    6-token tiles, both schedules (the threads sharing the panels; each thread its own blocks of 108 tokens, from 8
    blocks a thread on), one and two threads; and decode (1, 3 tokens) over enough rows for several streamed chunks
    a thread, the last one partial (cpu_vec::stream_chunk)."""
    op = native()
    threads = torch.get_num_threads()
    try:
        for n, tokens in ((3701, (1, 3, 64, 65)), (37, (1801,))):
            qweight, scales, z, b = _weights(n, 576, 32, bits, bits == 4, True)
            w = dequantize_weight(qweight, scales, z, bits)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for t in tokens:
                    x = torch.randn(t, 576, generator=torch.Generator().manual_seed(t))
                    _check(op(x, qweight, scales, z, bits, b), wo_linear.reference(x, qweight, scales, z, bits, b), x,
                           w, torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_wo_linear_layouts():
    """Non-contiguous x, a bf16 bias, a 3-d x through the binding's wrapper, empty batches."""
    op = native()
    qweight, scales, z, b = _weights(40, 64, 32, 4, True, True)
    w = dequantize_weight(qweight, scales, z, 4)
    x = torch.randn(5, 128)[:, ::2]
    assert not x.is_contiguous()
    _check(op(x, qweight, scales, z, 4, b.bfloat16()), wo_linear.reference(x, qweight, scales, z, 4, b.bfloat16()),
           x, w, torch.float32)
    x3 = torch.randn(2, 3, 64)
    out = cpu_quant.wo_linear_cpu(x3, qweight, scales, z, 4, b)
    assert out.shape == (2, 3, 40)
    _check(out.view(6, 40), wo_linear.reference(x3.view(6, 64), qweight, scales, z, 4, b), x3.view(6, 64), w,
           torch.float32)
    assert op(torch.randn(0, 64), qweight, scales, z, 4, b).shape == (0, 40)
    with pytest.raises(RuntimeError, match="qweight"):
        op(torch.randn(1, 32), qweight, scales, z, 4, b)


def test_fallback_without_library(monkeypatch):
    """Without the library the binding is the reference itself."""
    monkeypatch.setattr(ext, "available", lambda: False)
    qweight, scales, z, b = _weights(8, 64, 32, 4, True, True)
    x = torch.randn(3, 64)
    assert torch.equal(cpu_quant.wo_linear_cpu(x, qweight, scales, z, 4, b),
                       wo_linear.reference(x, qweight, scales, z, 4, b))


@pytest.mark.parametrize("kernels", ["eager", "inductor"])
def test_cpu_platform_binds_the_kernel(kernels, monkeypatch):
    """The cpu platform's default kernels run graphinfer::wo_linear on the C++ op (bit for bit), "reference" does not.
    (GRAPHINFER_CPU_WO_ACTIVATIONS=fp32: the exact kernel; the other modes: tests/test_cpu_quant_a8.py.)"""
    monkeypatch.setenv("GRAPHINFER_CPU_WO_ACTIVATIONS", "fp32")
    op = native()
    platform = get_platform("cpu")
    impls = platform.op_impls(kernels)
    assert impls["wo_linear"] is cpu_quant.wo_linear_cpu and impls["scaled_mm"] is cpu_quant.scaled_mm_cpu
    assert impls["dynamic_quant"] is cpu_quant.dynamic_quant_cpu
    assert not {"wo_linear", "scaled_mm", "dynamic_quant"} & set(platform.op_impls("reference"))
    qweight, scales, z, b = _weights(300, 576, 32, 4, True, False)
    x = torch.randn(1, 576)
    try:
        platform.activate(kernels)
        assert platform.kernels["wo_linear"] == "graphinfer.ops.cpu.quant"
        assert torch.equal(torch.ops.graphinfer.wo_linear(x, qweight, scales, z, 4, None), op(x, qweight, scales, z, 4, None))
        q, s = torch.ops.graphinfer.dynamic_quant(x, "int8")
        assert torch.equal(q, torch.ops.graphinfer_cpu_quant.dynamic_quant_int8(x, None)[0])
    finally:
        platform.activate("reference")  # later tests call the ops directly: give them the reference back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_dynamic_quant_int8_bit_exact(static, dtype):
    native()
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(17, 100, generator=gen) * torch.logspace(-3, 2, 17).unsqueeze(1)).to(dtype)
    x[3] = 0  # an all-zero row: the minimum scale, codes 0
    x[5, :7] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.4, -200.0])  # ties round to even; clamp at +-127
    input_scale = torch.tensor([0.02]) if static else None
    for xx in (x, x[:1], x.view(1, 17, 100), x[:0]):
        q, s = cpu_quant.dynamic_quant_cpu(xx, "int8", input_scale)
        q_ref, s_ref = dynamic_quant_ref(xx, "int8", input_scale)
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == s_ref.shape
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t,n,k", [(1, 37, 64), (5, 50, 576), (17, 19, 100), (64, 130, 1536)])
def test_scaled_mm_int8_bit_exact(t, n, k, bias, out_dtype):
    native()
    gen = torch.Generator().manual_seed(t)
    a = torch.randint(-127, 128, (t, k), generator=gen).to(torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    a_scale, b_scale = torch.rand(t, 1, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.01
    bb = torch.randn(n, generator=gen).to(out_dtype) if bias else None
    out = cpu_quant.scaled_mm_cpu(a, a_scale, b, b_scale, bb, out_dtype)
    assert torch.equal(out, scaled_mm.reference(a, a_scale, b, b_scale, bb, out_dtype))


@pytest.mark.parametrize("bits", [4, 8])
def test_wo_linear_fp16_scales_read_as_they_are(bits):
    """GGUF's fp16 scales and zeros (read in the kernel, not converted per call) give the fp32 copies' results bit for
    bit (fp16 -> fp32 is exact), on the decode tiles, the generic path (group 6) and the GEMM path."""
    op = native()
    for n, k, group in [(50, 96, 32), (9, 18, 6)]:
        qweight, scales, z, b = _weights(n, k, group, bits, True, True)
        s16, z16 = scales.half(), z.half()
        for t in (1, 5, 64):
            x = torch.randn(t, k)
            assert torch.equal(op(x, qweight, s16, z16, bits, b), op(x, qweight, s16.float(), z16.float(), bits, b))
