"""The cpu platform's row-wise C++ ops (graphinfer/ops/cpu/elementwise.py, csrc/cpu/elementwise.cpp) against the
PyTorch references, within one rounding of the output dtype (the kernels round where the reference materialises
an intermediate; the rms_norm sum's order, FMA and exp differ by ulps of fp32, which can flip a bf16/fp16 rounding);
inputs the kernels do not take (strided rows) go to the reference."""
import pytest
import torch

from graphinfer.ops.cpu import elementwise as ew
from graphinfer.ops.activation import silu_and_mul
from graphinfer.ops.norm import add_rms_norm, rms_norm
from graphinfer.ops.rotary import rotary_embedding
from conftest import need_cpu_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _library():
    need_cpu_kernels(ew._built())


def _same(got, want):
    ulp = torch.finfo(got.dtype).eps * (8 if got.dtype == torch.float32 else 1)  # fp32: a few ulps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    if got.dtype != torch.float32:  # most values are the reference's bits
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 rows: several threads' tasks
@pytest.mark.parametrize("hidden", [576, 100])  # 100: not a whole number of vectors (the tail lanes)
def test_norms_and_silu(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, hidden, generator=g) * 4).to(dtype), torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    _same(ew.rms_norm_cpu(x, w, 1e-5), rms_norm.reference(x, w, 1e-5))
    for got, want in zip(ew.add_rms_norm_cpu(x, r, w, 1e-6), add_rms_norm.reference(x, r, w, 1e-6)):
        _same(got, want)
    gate_up = (torch.randn(rows, 2, hidden * 8 // 3, generator=g) * 6).to(dtype).view(rows, -1)
    _same(ew.silu_and_mul_cpu(gate_up), silu_and_mul.reference(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])  # 32 of 64: partial rotary, the tail passes through
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rotary(dtype, is_neox, rot_dim, cache_dtype):
    g = torch.Generator().manual_seed(rot_dim)
    T, D = 11, 64
    cache = torch.randn(300, rot_dim, generator=g).to(cache_dtype)
    pos = torch.randint(0, 300, (T,), generator=g)
    q, k = torch.randn(T, 9 * D, generator=g).to(dtype), torch.randn(T, 3, D, generator=g).to(dtype)
    got = ew.rotary_embedding_cpu(pos.int(), q, k, D, cache, is_neox)
    want = rotary_embedding.reference(pos, q, k, D, cache, is_neox)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        _same(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 80])  # 80: half a head is not a whole number of vectors
def test_rotary_on_the_slices_of_a_fused_qkv_output(dtype, D, monkeypatch):
    """q and k as the model passes them: row-strided views of one [T, (Hq + 2 Hkv) D] qkv output, rotated by the
    kernel (not the reference) into contiguous outputs."""
    g = torch.Generator().manual_seed(D)
    T, Hq, Hkv = 37, 9, 3
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    cache, pos = torch.randn(4096, D, generator=g), torch.randint(0, 4096, (T,), generator=g)
    want = rotary_embedding.reference(pos, q, k, D, cache, True)
    monkeypatch.setattr(rotary_embedding, "reference", None)  # the kernel must take these inputs
    got = ew.rotary_embedding_cpu(pos, q, k, D, cache, True)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.shape == b.shape
        _same(a, b)


def test_strided_inputs_take_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(rms_norm, "reference", lambda *a: calls.append(1) or torch.zeros(1))
    x = torch.randn(4, 128)[:, ::2]  # rows with stride 2 over the hidden dimension
    ew.rms_norm_cpu(x, torch.ones(64), 1e-5)
    assert calls == [1]
    ew.rms_norm_cpu(x.contiguous(), torch.ones(64), 1e-5)
    assert calls == [1]
