"""The cpu platform's greedy sampling kernel (graphinfer/ops/cpu/sampling.py, csrc/cpu/sampling.cpp) against
torch.max(dim=-1).indices, which it replaces in the sampler: the same index for every row, ties (the first maximum)
and NaN (the first NaN) included."""
import pytest
import torch

from graphinfer.ops.cpu import sampling as cpu_sampling
from conftest import need_cpu_kernels


@pytest.fixture(autouse=True)
def _library():
    need_cpu_kernels(cpu_sampling.available())


def kernel(x):
    return torch.ops.graphinfer_cpu.argmax_rows(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (64, 1000), (5, 7), (3, 1), (0, 33)])  # 1000, 7: a tail
def test_argmax_rows_matches_torch_max(dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    if rows and vocab > 3:
        x[0, vocab // 3] = x[0, -1] = x[0].max() + 1  # a tie: the first index wins
    if rows > 2:
        x[1] = -torch.inf  # a row of -inf: index 0
        x[2, vocab - 1] = torch.nan  # NaN in the tail
        x[2, vocab // 2] = torch.nan  # ... and an earlier one: the first NaN
    got = kernel(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.max(dim=-1).indices)


def test_argmax_falls_back_where_the_kernel_does_not_apply():
    x = torch.randn(8, 100)
    assert torch.equal(cpu_sampling.argmax(x.T), x.T.max(dim=-1).indices)  # not contiguous rows
    assert torch.equal(cpu_sampling.argmax(x.double()), x.double().max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(x.T)
