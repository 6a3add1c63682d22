"""Fused norm / activation + quant ops give the unfused graph's int8 codes and scales bit for bit (issue 55, item 4):
on the cpu platform (its C++ norm / silu kernels, then its C++ dynamic_quant) and on the references, for fp32 and
bf16 activations, on random rows and on rows built so that x / scale lands on .5 rounding boundaries (where an fp32
ulp of difference in the norm flips a code)."""
import pytest
import torch

from graphinfer.ops.activation import silu_and_mul
from graphinfer.ops.cpu import quant as cpu_quant
from graphinfer.ops.cpu.elementwise import add_rms_norm_cpu, rms_norm_cpu, silu_and_mul_cpu
from graphinfer.ops.norm import add_rms_norm, rms_norm
from graphinfer.ops.quant import add_rms_norm_quant, dynamic_quant, rms_norm_quant, silu_and_mul_quant
from conftest import need_cpu_kernels

DTYPES = (torch.float32, torch.bfloat16)
HIDDEN = (576, 100)  # SmolLM2's hidden size, and one that is no multiple of a vector


def _rows(dtype, n, seed):
    """Random rows, then rows of (k + 0.5) * c with one element at 127 c: normalised and divided by their scale, the
    codes sit on .5 boundaries up to fp32 rounding."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(7, n, generator=g) * 3
    k = torch.randint(-127, 127, (9, n), generator=g).float() + 0.5
    k[:, 0] = 127.0
    c = torch.rand(9, 1, generator=g) * 4 + 0.01
    return torch.cat([rand, k * c, torch.zeros(1, n)]).to(dtype)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x.dtype, (x.float() - y.float()).abs().max())


IMPLS = {  # name: (rms_norm, add_rms_norm, silu_and_mul, dynamic_quant, rms_norm_quant, add_rms_norm_quant, silu_quant)
    "reference": (rms_norm.reference, add_rms_norm.reference, silu_and_mul.reference, dynamic_quant.reference,
                  rms_norm_quant.reference, add_rms_norm_quant.reference, silu_and_mul_quant.reference),
    "cpu": (rms_norm_cpu, add_rms_norm_cpu, silu_and_mul_cpu, cpu_quant.dynamic_quant_cpu,
            cpu_quant.rms_norm_quant_cpu, cpu_quant.add_rms_norm_quant_cpu, cpu_quant.silu_and_mul_quant_cpu),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
def test_fused_quant_ops_give_the_unfused_codes(impl, dtype, n):
    if impl == "cpu":
        need_cpu_kernels(cpu_quant.native_available())
    norm, add_norm, silu, dq, norm_q, add_norm_q, silu_q = IMPLS[impl]
    for seed in range(3):
        x, res = _rows(dtype, n, seed), _rows(dtype, n, seed + 100) * 0.25
        w = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)
        _same(norm_q(x, w, 1e-5, "int8"), dq(norm(x, w, 1e-5), "int8"))
        normed, new_res = add_norm(x, res, w, 1e-5)
        _same(add_norm_q(x, res, w, 1e-5, "int8"), (*dq(normed, "int8"), new_res))
        xx = torch.cat([x, res], -1)
        _same(silu_q(xx, "int8"), dq(silu(xx), "int8"))
        static = torch.tensor([0.02])
        _same(norm_q(x, w, 1e-5, "int8", static), dq(norm(x, w, 1e-5), "int8", static))


def test_the_cpu_platform_binds_the_fused_quant_ops():
    assert {"rms_norm_quant", "add_rms_norm_quant", "silu_and_mul_quant"} <= set(cpu_quant.CPU_QUANT_OPS)
