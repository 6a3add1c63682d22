"""The quantization Triton kernels (graphinfer.ops.triton.quant) against the reference ops (graphinfer.ops.quant).

Runs under TRITON_INTERPRET=1 without a GPU (upstream Triton, and Triton-Ascend's interpreter: the Makefile's
test-triton-ascend), compiled on "cuda" tensors with one. The reference always runs on CPU copies.
What is asserted:
  * dynamic_quant: codes and scales equal the reference exactly (int8 and fp8, dynamic and static scale),
    including rows built to hit .5 ties (round half to even) and fp8 roundings that carry into the exponent;
  * rms_norm_quant / add_rms_norm_quant / silu_and_mul_quant: codes within one of the reference's and at most
    1% of them off by one (the kernel's fp32 rsqrt / silu may differ from torch's by an ulp, which moves a value
    sitting on a rounding boundary; under the interpreters they come out equal), scales within 1e-5, the new
    residual exact;
  * scaled_mm: int8 exact (int32 accumulation, the reference's epilogue order), fp8 within fp32 summation-order
    tolerance; wo_linear: tight fp32 / bf16 tolerances.
Shapes are ragged on purpose (T 1, 3, 17, 64; N and K not multiples of the tiles) and kept small: the
interpreters are slow. Imports only torch, triton, pytest and graphinfer.ops (the Ascend venv has no more).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

import triton  # noqa: E402

import graphinfer.ops  # noqa: E402,F401  (registers the reference ops)
from graphinfer.ops.quant import dequantize_weight, pack_int4  # noqa: E402
from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
from graphinfer.ops.triton.quant import QUANT_OPS  # noqa: E402

ref = torch.ops.graphinfer
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_ASCEND = os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends", "ascend"))
ROWS = (1, 3, 17, 64)
DTYPES = (torch.float32, torch.bfloat16)
QUANT_DTYPES = ("int8", "fp8")


def _fp8_kernels_skip():
    if TRITON_ASCEND:
        return ("Triton-Ascend 3.2 refuses float8 tiles ('[fp8, fp64] is unsupported on Ascend'), in its interpreter "
                "too; Ascend runs the int8 schemes")
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return "float8e4nv needs sm_89 or newer"
    return None


def _skip_fp8_rows(quant_dtype):
    """The fp8 row kernels run under both interpreters; compiled they need an sm_89+ GPU."""
    if quant_dtype == "fp8" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8e4nv needs sm_89 or newer")


def _dev(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


def _codes_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu().float(), want.float()), (got.cpu().float() - want.float()).abs().max()


def _codes_close(got, want):
    """Within one code, and at most 1% of the codes off by one (see the module docstring)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.cpu().float(), want.float()
    if want.dtype == torch.int8:
        diff = (g - w).abs()
        assert diff.max() <= 1, diff.max()
    else:  # one fp8 step: neighbours on the e4m3 grid
        grid_step = torch.exp2(torch.floor(torch.log2(w.abs().clamp(min=2.0 ** -6))) - 3)
        diff = (g - w).abs() / grid_step
        assert diff.max() <= 1, diff.max()
    assert (diff > 0).float().mean() <= 0.01


def _x(rows, cols, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * scale
    if rows > 2:
        x[1] = 0.0  # an all-zero row: scale 1e-10, codes 0
    return x.to(dtype)


def test_registered():
    assert set(QUANT_OPS) <= set(TRITON_OPS)
    for name, fn in QUANT_OPS.items():
        assert TRITON_OPS[name] is fn


# ----- dynamic_quant -----

@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_quant(dtype, quant_dtype):
    """Exact codes and scales, per-token and static, over ragged row counts and widths, with leading dims."""
    _skip_fp8_rows(quant_dtype)
    for rows, cols in zip(ROWS, (200, 64, 129, 37)):
        x = _x(rows, cols, dtype, seed=rows)
        for input_scale in (None, torch.tensor([0.021])):
            got = TRITON_OPS["dynamic_quant"](*_dev(x, quant_dtype, input_scale))
            want = ref.dynamic_quant(x, quant_dtype, input_scale)
            _codes_equal(got[0], want[0])
            assert got[1].shape == (rows, 1) and torch.equal(got[1].cpu(), want[1])
    x3 = _x(6, 48, dtype).view(2, 3, 48)
    got, want = TRITON_OPS["dynamic_quant"](*_dev(x3, quant_dtype)), ref.dynamic_quant(x3, quant_dtype)
    _codes_equal(got[0], want[0])
    assert got[1].shape == (2, 3, 1) and torch.equal(got[1].cpu(), want[1])


def test_int8_rounds_half_to_even():
    """max 127 -> scale 1: x / scale lands exactly on .5 (torch.round rounds those to the even neighbour)."""
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49999, 0.0, -127.0])
    x = row.repeat(3, 1)
    got, want = TRITON_OPS["dynamic_quant"](*_dev(x, "int8")), ref.dynamic_quant(x, "int8")
    _codes_equal(got[0], want[0])
    assert want[0][0, 1:7].tolist() == [0, 2, 2, 0, -2, -2]  # the reference itself is half-even


def test_fp8_rounding_ties_and_carries():
    """max 448 -> scale 1: values between e4m3 neighbours, ties to even, roundings that carry into the exponent
    (31.6 -> 32; both interpreters' own fp32 -> fp8 cast gets 16 there) and the subnormal range (2**-9 steps)."""
    _skip_fp8_rows("fp8")
    row = torch.tensor([448.0, 31.6, 31.0, 15.5, 124.0, 127.9, 440.0, -31.6, -124.0, 2.0 ** -10, 3 * 2.0 ** -10,
                        5 * 2.0 ** -10, 0.0157, -0.0157, 2.0 ** -6 - 2.0 ** -11, 1.0e-4, 0.0, 1.0625, 1.1875])
    x = row.repeat(2, 1)
    got, want = TRITON_OPS["dynamic_quant"](*_dev(x, "fp8")), ref.dynamic_quant(x, "fp8")
    _codes_equal(got[0], want[0])
    assert want[0][0, 1].float() == 32.0


# ----- fused norm / activation + quant -----

@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_quant(dtype, quant_dtype):
    _skip_fp8_rows(quant_dtype)
    for rows, cols in zip(ROWS, (200, 64, 129, 37)):
        x = _x(rows, cols, dtype, seed=rows)
        # bf16 activations with an fp32 weight promote the norm's output to fp32 (rms_norm_ref: weight * h.to(x))
        w_dtype = torch.float32 if rows == 3 else dtype
        w = (torch.rand(cols, generator=torch.Generator().manual_seed(1)) + 0.5).to(w_dtype)
        for input_scale in (None, torch.tensor([0.013])):
            got = TRITON_OPS["rms_norm_quant"](*_dev(x, w, 1e-6, quant_dtype, input_scale))
            want = ref.rms_norm_quant(x, w, 1e-6, quant_dtype, input_scale)
            _codes_close(got[0], want[0])
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_quant(dtype, quant_dtype):
    _skip_fp8_rows(quant_dtype)
    for rows, cols in zip(ROWS, (200, 64, 129, 37)):
        x, res = _x(rows, cols, dtype, seed=rows), _x(rows, cols, dtype, seed=rows + 100)
        w = (torch.rand(cols, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
        for input_scale in (None, torch.tensor([0.05])):
            got = TRITON_OPS["add_rms_norm_quant"](*_dev(x, res, w, 1e-5, quant_dtype, input_scale))
            want = ref.add_rms_norm_quant(x, res, w, 1e-5, quant_dtype, input_scale)
            _codes_close(got[0], want[0])
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=0)
            assert torch.equal(got[2].cpu(), want[2])


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_quant(dtype, quant_dtype):
    _skip_fp8_rows(quant_dtype)
    for rows, d in zip(ROWS, (100, 64, 129, 37)):
        x = _x(rows, 2 * d, dtype, seed=rows, scale=2.0)
        for input_scale in (None, torch.tensor([0.03])):
            got = TRITON_OPS["silu_and_mul_quant"](*_dev(x, quant_dtype, input_scale))
            want = ref.silu_and_mul_quant(x, quant_dtype, input_scale)
            _codes_close(got[0], want[0])
            torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=0)


# ----- scaled_mm -----

def _quantized_operands(rows, n, k, quant_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, a_scale = ref.dynamic_quant(torch.randn(rows, k, generator=g), quant_dtype)
    b, b_scale = ref.dynamic_quant(torch.randn(n, k, generator=g) / k ** 0.5, quant_dtype)
    return a, a_scale, b, b_scale.reshape(n), torch.randn(n, generator=g)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_scaled_mm_int8_exact(out_dtype):
    """int32 accumulation is exact and the epilogue runs in the reference's order: equal outputs."""
    for rows, (n, k) in zip(ROWS, ((70, 200), (33, 64), (100, 130), (16, 96))):
        a, a_scale, b, b_scale, bias = _quantized_operands(rows, n, k, "int8", seed=rows)
        for use_bias in (False, True):
            bias_t = bias.to(out_dtype) if use_bias else None
            got = TRITON_OPS["scaled_mm"](*_dev(a, a_scale, b, b_scale, bias_t, out_dtype))
            want = ref.scaled_mm(a, a_scale, b, b_scale, bias_t, out_dtype)
            assert got.dtype == out_dtype and got.shape == (rows, n)
            if DEVICE == "cpu":
                assert torch.equal(got, want)
            else:  # a GPU may contract the epilogue's multiply-add into an FMA
                torch.testing.assert_close(got.cpu(), want, rtol=1e-6 if out_dtype == torch.float32 else 8e-3,
                                           atol=1e-6)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_scaled_mm_fp8(out_dtype):
    skip = _fp8_kernels_skip()
    if skip:
        pytest.skip(skip)
    for rows, (n, k) in zip(ROWS, ((70, 200), (33, 64), (100, 130), (16, 96))):
        a, a_scale, b, b_scale, bias = _quantized_operands(rows, n, k, "fp8", seed=rows)
        for use_bias in (False, True):
            bias_t = bias.to(out_dtype) if use_bias else None
            got = TRITON_OPS["scaled_mm"](*_dev(a, a_scale, b, b_scale, bias_t, out_dtype))
            want = ref.scaled_mm(a, a_scale, b, b_scale, bias_t, out_dtype)
            assert got.dtype == out_dtype and got.shape == (rows, n)
            # Hopper's fp8 MMA accumulates with ~13 mantissa bits (DeepSeek-V3 report, 2.3.3), not fp32: bound the
            # error by that unit roundoff times sum |a_i b_i| (scaled), plus rounding the output: both outputs round
            # to bf16, so they may sit one bf16 ulp (<= 2^-7 relative) apart (2^-8 failed on an H200 at 1.31x)
            mag = (a.float().abs() @ b.float().abs().T) * a_scale * b_scale
            acc_eps = 2.0 ** -13 if DEVICE == "cuda" else 2.0 ** -22
            out_eps = 2.0 ** -7 if out_dtype == torch.bfloat16 else 2.0 ** -22
            bound = acc_eps * mag + out_eps * want.float().abs() + 1e-6
            err = (got.cpu().float() - want.float()).abs()
            assert (err <= bound).all(), f"max error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"


def test_scaled_mm_refuses_mixed_codes():
    a, a_scale, b, b_scale, _ = _quantized_operands(2, 8, 32, "int8")
    with pytest.raises(ValueError, match="both int8"):
        TRITON_OPS["scaled_mm"](*_dev(a.float(), a_scale, b, b_scale, None, torch.float32))


# ----- wo_linear -----

# (K, group): group 16 with K = 144 (K tiles span groups: per-element scale gathers, K not a multiple of 64),
# 32 / 64 / 128 (one group per K tile), per channel with a ragged K = 200.
GROUPS = ((144, 16), (96, 32), (192, 64), (384, 128), (200, 200))
WO_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4),
          torch.bfloat16: dict(rtol=8e-3, atol=1e-2)}  # the interpreters dot in fp32 (a GPU: see test_wo_linear)


def _packed_weight(n, k, group, bits, seed):
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randn(n, k // group, generator=g) * 0.05
    return q, scales, zeros


@pytest.mark.parametrize("k,group", GROUPS, ids=[f"k{k}-g{g}" for k, g in GROUPS])
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_wo_linear(dtype, bits, k, group):
    """Every T; zeros and bias in all four combinations across them (T 1: neither, 3: zeros, 17: bias, 64: both)."""
    n = 70
    q, scales, zeros = _packed_weight(n, k, group, bits, seed=k + bits)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype)
    for rows, (use_zeros, use_bias) in zip(ROWS, ((False, False), (True, False), (False, True), (True, True))):
        x = _x(rows, k, dtype, seed=rows, scale=1.0)
        args = (x, q, scales, zeros if use_zeros else None, bits, bias if use_bias else None)
        got = TRITON_OPS["wo_linear"](*_dev(*args))
        want = ref.wo_linear(*args)
        assert got.dtype == dtype and got.shape == (rows, n)
        if dtype == torch.bfloat16 and DEVICE != "cpu":
            # a GPU dots bf16 x with the dequantized weight rounded to bf16 (unit roundoff 2^-9 per product), and both
            # outputs round to bf16, so they may sit one bf16 ulp (<= 2^-7 relative) apart: bound the error by that,
            # not by a fixed tolerance a longer K outgrows (half an ulp, 2^-8, failed on an H200 at 1.03x)
            w = dequantize_weight(q, scales, zeros if use_zeros else None, bits)
            bound = 2.0 ** -9 * (x.float().abs() @ w.abs().T) + 2.0 ** -7 * want.float().abs() + 1e-6
            err = (got.cpu().float() - want.float()).abs()
            assert (err <= bound).all(), f"max error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"
        else:
            torch.testing.assert_close(got.cpu(), want, **WO_TOL[dtype])


def test_wo_linear_leading_dims_and_strided_rows():
    k, n, group = 128, 40, 32
    q, scales, zeros = _packed_weight(n, k, group, 4, seed=7)
    x = torch.randn(4, 2 * k)[:, :k].reshape(2, 2, k)  # rows with a stride wider than K
    got = TRITON_OPS["wo_linear"](*_dev(x, q, scales, zeros, 4, None))
    torch.testing.assert_close(got.cpu(), ref.wo_linear(x, q, scales, zeros, 4, None), **WO_TOL[torch.float32])
