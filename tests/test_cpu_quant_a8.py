"""graphinfer_cpu_quant::wo_linear_a8 (csrc/cpu/quant_linear_a8.cpp), llama.cpp's q4_1 x q8_1 / q8_0 x q8_0 decode
arithmetic for 4- and 8-bit codes, on
each of its paths (AVX-512 VNNI, AVX2, scalar: max_isa, up to what this build has; from 64 tokens on, VNNI builds'
GEMM, panels of 48 rows x tiles of 4 tokens, here with partial panels and tiles), against a reference written
here with torch ops: the activations rounded to int8 per block of 32 the same way (so the codes agree exactly and
only the fp32 summation order differs), and against the exact fp32 op within the bound that rounding allows,
sum over blocks of (step / 2) * sum |w|. Then the cpu platform's choice of kernel (GRAPHINFER_CPU_WO_ACTIVATIONS)."""
import pytest
import torch

from graphinfer.errors import InvalidConfigError
from graphinfer.ops.cpu import ext, quant as cpu_quant
from graphinfer.ops.quant import dequantize_weight, pack_int4, wo_linear
from graphinfer.platforms import get_platform
from graphinfer.platforms.cpu import _cpuinfo_field, has_native_bf16
from conftest import need_cpu_kernels

ISAS = {0: "scalar", 1: "avx2", 2: "avx512_vnni"}


def a8_op():
    need_cpu_kernels(cpu_quant.native_available())
    return torch.ops.graphinfer_cpu_quant.wo_linear_a8.default


def _weights(n, k, zeros, scale_dtype, bits=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:  # -128 included: its magnitude needs the unsigned operand's full range
        qweight = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).to(scale_dtype)
    z = (-torch.rand(n, k // 32, generator=gen) * 0.1).to(scale_dtype) if zeros else None
    return qweight, scales, z


def _round_blocks(x):
    """x [T, K] -> (x with each block of 32 replaced by d * round(x / d), d = amax / 127, as the kernel: x * (1 / d))."""
    xb = x.float().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).view_as(x.float()), d


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", sorted(ISAS), ids=ISAS.get)
def test_a8_matches_int8_rounding(isa, bits):
    op = a8_op()
    if isa > torch.ops.graphinfer_cpu_quant.wo_linear_a8_isa():
        pytest.skip(f"this build has no {ISAS[isa]} path")
    for (n, k), zeros, scale_dtype, bias, dtype in [((37, 64), True, torch.float16, False, torch.float32),
                                                     ((50, 576), True, torch.float32, True, torch.float32),
                                                     ((19, 1536), False, torch.float16, True, torch.bfloat16),
                                                     ((9, 128), True, torch.float16, True, torch.bfloat16),
                                                     ((1001, 576), True, torch.float16, False, torch.float32)]:
        qweight, scales, z = _weights(n, k, zeros, scale_dtype, bits)
        w = dequantize_weight(qweight, scales, z, bits)
        b = torch.randn(n) if bias else None
        for t in (1, 5, 17, 64, 70, 259):  # from 64 tokens on the GEMM (VNNI), past 256 its token blocks
            x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dtype)
            x[0, :32] = 0  # a block of zeros: step 0
            out = op(x, qweight, scales, z, b, isa)
            assert out.dtype == dtype and out.shape == (t, n)
            xr, d = _round_blocks(x)
            # the zero term takes the exact sum of x over each block (llama.cpp: d * the sum of the codes)
            ref = xr @ w.T + (x.float() - xr).view(t, -1, 32).sum(-1) @ (z.float().T if zeros else 0 * w[:, ::32].T)
            ref = ref + (b if bias else 0)
            scale = xr.abs() @ w.abs().T + x.float().abs() @ w.abs().T
            bound = 4e-6 * scale + 1e-6 + (2 ** -7 * ref.abs() if dtype == torch.bfloat16 else 0)
            err = (out.float() - ref).abs()
            assert (err <= bound).all(), f"{ISAS[isa]} bits {bits} {n}x{k} t={t}: {err.max().item():.3g}"
            # against the exact op: each activation moved by at most half its block's step
            exact = wo_linear.reference(x, qweight, scales, z, bits, b).float()
            rounding = (d / 2).expand(-1, -1, 32).reshape(t, k) @ w.abs().T
            assert ((out.float() - exact).abs() <= rounding + bound).all()
            assert (out.float() - exact).abs().max() > 0  # the rounding shows: this is not the exact kernel


@pytest.mark.parametrize("bits", [4, 8])
def test_paths_agree_and_inputs_are_checked(bits):
    op = a8_op()
    qweight, scales, z = _weights(64, 576, bits == 4, torch.float16, bits)
    x = torch.randn(3, 576)
    outs = [op(x, qweight, scales, z, None, isa) for isa in range(torch.ops.graphinfer_cpu_quant.wo_linear_a8_isa() + 1)]
    for o in outs[1:]:  # the same codes and scales: only the summation order differs
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(torch.randn(1, 96), pack_int4(torch.zeros(4, 96, dtype=torch.uint8)), torch.ones(4, 3), None, None, 2)
    with pytest.raises(RuntimeError, match="group 32"):
        op(x, qweight, torch.ones(64, 9), None, None, 2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, group, t, bias, x_dtype", [
    (70, 192, 32, 80, False, torch.float32),  # a panel of rows and a tile of tokens cut short
    (33, 128, 64, 64, True, torch.bfloat16),  # groups of 64, bias, bf16 activations (and out)
    (96, 64, 32, 70, True, torch.float32),  # whole panels, 70 tokens: AMX's 32-token tiles and a tail of 6
    (80, 64, 32, 300, False, torch.bfloat16),  # more than AMX's 256-token block: x in blocks over every panel
    (48, 96, 32, 2048, False, torch.bfloat16),  # AMX builds: the weight dequantized whole for oneDNN's linear
    (48, 96, 32, 2048, True, torch.bfloat16),  # with a bias: the tiles still
])
def test_bf16_gemm_is_the_product_of_the_bf16_rounded_operands(bits, n, k, group, t, bias, x_dtype):
    """wo_linear with bf16_gemm at >= 64 tokens on a CPU with avx512_bf16 (gemm_bf16): x and the dequantized weight
    rounded to bf16 (nearest even), products accumulated in fp32, so it equals the fp32 product of the rounded
    operands up to summation order; on other CPUs (and in the scalar build) bf16_gemm is ignored and the op is exact."""
    need_cpu_kernels(cpu_quant.native_available())
    gen = torch.Generator().manual_seed(1)
    qweight, scales, _ = _weights(n, k, False, torch.float16, bits)
    scales = scales[:, ::group // 32].contiguous()
    z = (-torch.rand(n, k // group, generator=gen) * 0.1).half() if bits == 4 else None
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(t, k, generator=gen).to(x_dtype)
    out = torch.ops.graphinfer_cpu_quant.wo_linear.default(x, qweight, scales, z, bits, b, True).float()
    exact = wo_linear.reference(x.float(), qweight, scales, z, bits, b)
    w = dequantize_weight(qweight, scales, z, bits).float()
    tol = 1e-5 * (x.float().abs() @ w.abs().T) + 1e-5  # fp32 sums in any order
    half_ulp = 2 ** -8 if x_dtype == torch.bfloat16 else 0.0  # the out rounded to x's dtype
    if not has_native_bf16() or ext.BUILD == "scalar":  # the scalar build has no gemm_bf16 on any CPU (nor AMX)
        assert ((out - exact).abs() <= tol + half_ulp * exact.abs()).all()
        return
    rounded = x.float().bfloat16().float() @ w.bfloat16().float().T + (b if bias else 0)
    assert ((out - rounded).abs() <= tol + half_ulp * rounded.abs()).all()
    assert (out != exact.to(x_dtype).float()).any()  # the rounding is there: this is not the exact path


def test_cpu_platform_chooses_the_activations(monkeypatch):
    """GRAPHINFER_CPU_WO_ACTIVATIONS=int8: 4- and 8-bit group-32 linears at < 64 tokens on wo_linear_a8, batches too
    where the build has AVX-512 VNNI (its GEMM), else on the exact kernel (batches in bf16 where the CPU has it); bf16:
    the exact kernel at decode, batches in bf16; the default (auto): int8 where the a8 kernel's best path is AVX2;
    with AVX-512 VNNI and no AMX the exact kernel at decode and int8 batches; else bf16; fp32: the exact kernel
    throughout; another value: a typed error naming them."""
    op = a8_op()
    platform = get_platform("cpu")
    qweight, scales, z = _weights(40, 128, True, torch.float16)
    exact = torch.ops.graphinfer_cpu_quant.wo_linear.default
    isa = torch.ops.graphinfer_cpu_quant.wo_linear_a8_isa()
    wo = torch.ops.graphinfer.wo_linear
    try:
        for mode in (None, "bf16", "int8"):
            if mode is None:
                monkeypatch.delenv("GRAPHINFER_CPU_WO_ACTIVATIONS", raising=False)
            else:
                monkeypatch.setenv("GRAPHINFER_CPU_WO_ACTIVATIONS", mode)
            assert platform.op_impls("eager")["wo_linear"] is cpu_quant.wo_linear_a8_cpu
            platform.activate("eager")
            x = torch.randn(300, 128)
            a8_decode = mode == "int8" or (mode is None and isa == 1)
            assert torch.equal(wo(x[:1], qweight, scales, z, 4, None),
                               op(x[:1], qweight, scales, z, None) if a8_decode else exact(x[:1], qweight, scales, z,
                                                                                           4, None))
            amx = "amx_bf16" in _cpuinfo_field("flags")
            for t in (64, 300):  # batches: int8 with VNNI (auto: not beside AMX), else bf16 where the CPU has it
                a8_gemm = isa == 2 and (mode == "int8" or (mode is None and not amx))
                assert torch.equal(wo(x[:t], qweight, scales, z, 4, None),
                                   op(x[:t], qweight, scales, z, None) if a8_gemm
                                   else exact(x[:t], qweight, scales, z, 4, None, has_native_bf16())), (mode, t)
        x = torch.randn(2, 3, 128)  # int8: 6 tokens, 3-D
        assert torch.equal(wo(x, qweight, scales, z, 4, None),
                           op(x.view(6, 128), qweight, scales, z, None).view(2, 3, 40))
        x = torch.randn(64, 128)
        q8, s8 = torch.randint(-128, 128, (40, 128), dtype=torch.int8), scales  # bits 8 (Q8_0), group 32
        assert torch.equal(torch.ops.graphinfer.wo_linear(x[:1], q8, s8, None, 8, None), op(x[:1], q8, s8, None, None))
        s16 = torch.rand(40, 8, dtype=torch.float16)  # group 16 (Q6_K): exact
        assert torch.equal(torch.ops.graphinfer.wo_linear(x[:1], q8, s16, None, 8, None),
                           exact(x[:1], q8, s16, None, 8, None))
        monkeypatch.setenv("GRAPHINFER_CPU_WO_ACTIVATIONS", "fp32")
        platform.activate("eager")
        assert torch.equal(torch.ops.graphinfer.wo_linear(x[:1], qweight, scales, z, 4, None),
                           exact(x[:1], qweight, scales, z, 4, None))
        monkeypatch.setenv("GRAPHINFER_CPU_WO_ACTIVATIONS", "int4")
        with pytest.raises(InvalidConfigError, match="auto.*bf16.*int8.*fp32"):
            platform.op_impls("eager")
    finally:
        platform.activate("reference")
