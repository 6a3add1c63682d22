"""The cpu platform's few-row dense linear (graphinfer/ops/cpu/gemv.py, csrc/cpu/gemv.cpp) against the exact product
(float64), and PackedLinear's routing of few-row calls to it."""
import pytest
import torch
from torch import nn

from graphinfer.compiler.cpu_packed_linear import PackedLinear
from graphinfer.ops.cpu import gemv as cpu_gemv
from conftest import need_cpu_kernels


@pytest.fixture(autouse=True)
def _library():
    need_cpu_kernels(cpu_gemv.available())


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 4])
@pytest.mark.parametrize("n, k", [(3000, 576), (61, 100), (7, 13)])  # 3000: several tasks; 61, 7: partial row blocks;
def test_gemv_matches_the_exact_product(w_dtype, x_dtype, rows, n, k):  # 100, 13: tails of K shorter than a vector
    g = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    w = torch.randn(n, k, generator=g).to(w_dtype)
    for bias in (None, torch.randn(n, generator=g)):
        y = cpu_gemv.gemv(x, w, bias)
        assert y.shape == (rows, n) and y.dtype == x_dtype
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        # fp32 products and sums (a bf16 weight widened exactly): within fp32 rounding of the exact sum, then one
        # rounding to x's dtype
        tol = 1e-5 if x_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y.double(), exact.to(x_dtype).double(), rtol=tol, atol=tol * k ** 0.5)


def test_gemv_keeps_leading_dims_and_rejects_what_it_cannot_take():
    x, w = torch.randn(2, 1, 64), torch.randn(40, 64)
    torch.testing.assert_close(cpu_gemv.gemv(x, w, None), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="T <= 4 rows"):
        cpu_gemv.gemv(torch.randn(5, 64), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_gemv.gemv(x, torch.randn(64, 40).T, None)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        cpu_gemv.gemv(x, w.half(), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_sends_few_rows_to_the_kernel(dtype, monkeypatch):
    linear = nn.Linear(64, 96, dtype=dtype)
    packed = PackedLinear(linear)
    calls = []
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a: calls.append(a[0].shape) or torch.zeros(*a[0].shape[:-1], 96, dtype=dtype))
    packed(torch.randn(1, 64, dtype=dtype))
    packed(torch.randn(2, 2, 64, dtype=dtype))
    packed(torch.randn(5, 64, dtype=dtype))  # more rows: oneDNN
    assert calls == [torch.Size([1, 64]), torch.Size([2, 2, 64])]
