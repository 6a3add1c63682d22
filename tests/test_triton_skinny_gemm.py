"""The skinny GEMM kernel (graphinfer.ops.triton.skinny_gemm) against F.linear, every candidate config.

Runs under TRITON_INTERPRET=1 without a GPU (upstream Triton and Triton-Ascend's interpreter: see the Makefile's
test-triton-ascend), compiled on "cuda" tensors with one. Imports only torch, pytest and graphinfer.ops.triton.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

from graphinfer.ops.triton.skinny_gemm import CONFIGS, MAX_M, skinny_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(m, n, k, dtype, bias, config):
    x, w, b = _inputs(m, n, k, dtype, bias)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)  # fp32 accumulation
    out = skinny_gemm(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), config)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.cpu().float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("m", range(1, MAX_M + 1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count(m, dtype):
    """Ragged N and K (not multiples of any block), with bias, split-K and the dot variant."""
    _check(m, 37, 300, dtype, True, CONFIGS[3])
    _check(m, 37, 300, dtype, False, CONFIGS[5])


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_config(config, bias, dtype):
    for m in (1, 3, 8):
        _check(m, 70, 200, dtype, bias, config)


def test_leading_dims_and_strided_rows():
    x, w, b = _inputs(4, 33, 65, torch.float32, True)
    x3 = torch.cat([x, x], dim=1)[:, :65].reshape(2, 2, 65)  # rows with a stride wider than K
    out = skinny_gemm(x3.to(DEVICE), w.to(DEVICE), b.to(DEVICE), CONFIGS[0])
    torch.testing.assert_close(out.cpu(), F.linear(x3, w, b), **TOL[torch.float32])


def test_refuses_too_many_rows():
    x, w, _ = _inputs(MAX_M + 1, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match="F.linear"):
        skinny_gemm(x.to(DEVICE), w.to(DEVICE), None, CONFIGS[0])
