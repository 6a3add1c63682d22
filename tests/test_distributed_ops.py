"""The graphinfer:: collectives on a real 2-rank gloo group against what they must compute, their fake impls, and
the error a rank gets when its peer dies (naming the rank, the collective and the phase)."""
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensorMode

from graphinfer.distributed import communication_op  # noqa: F401  (registers the ops)
from graphinfer.distributed import launch
from graphinfer.distributed import parallel_state as ps
from graphinfer.ops.norm import rms_norm_ref

OPS = torch.ops.graphinfer


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(4, 6, generator=g)


def _ranks(rank: int, port: int) -> None:
    ps.init_distributed(rank, 2, 2, "gloo", "127.0.0.1", port, 60)
    xs = [_x(0), _x(1)]
    x, total = xs[rank], xs[0] + xs[1]
    assert torch.allclose(OPS.all_reduce(x, "tp"), total)
    for dim in (0, 1, -1):
        assert torch.equal(OPS.all_gather(x, dim, 2, "tp"), torch.cat(xs, dim))
    for dim in (0, 1):
        assert torch.allclose(OPS.reduce_scatter(x, dim, 2, "tp"), total.chunk(2, dim)[rank])
    residual, weight = torch.ones(4, 6), torch.linspace(0.5, 1.5, 6)
    normed, new_residual = OPS.all_reduce_add_rms_norm(x, residual, weight, 1e-6, "tp")
    assert torch.allclose(new_residual, total + residual) and torch.allclose(normed, rms_norm_ref(total + residual, weight, 1e-6))
    assert ps.min_across_ranks(10 + rank) == 10
    t = torch.full((3,), float(rank))
    ps.broadcast_from_rank0(t)
    assert torch.equal(t, torch.zeros(3))
    if rank == 1:
        os._exit(0)  # dies without a word (no clean-up): rank 0's next collective must fail, not hang
    with ps.phase("the dead-peer check"):
        with pytest.raises(ps.DistributedError, match=r"rank 0 of 2: all_reduce on group 'tp' failed during the dead-peer check"):
            OPS.all_reduce(x, "tp")
    ps.destroy()


def test_collectives_on_two_gloo_ranks():
    mp.start_processes(_ranks, args=(launch.free_port(),), nprocs=2, start_method="spawn")


def test_fake_impls_give_the_shapes():
    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert OPS.all_reduce(x, "tp").shape == (4, 6)
        assert OPS.all_gather(x, -1, 3, "tp").shape == (4, 18)
        assert OPS.reduce_scatter(x, 0, 2, "tp").shape == (2, 6)
        assert [t.shape for t in OPS.all_reduce_add_rms_norm(x, x, torch.empty(6), 1e-6, "tp")] == [(4, 6), (4, 6)]


def test_a_collective_outside_a_group_says_so():
    with pytest.raises(ps.DistributedError, match="not a rank of a tensor-parallel group"):
        OPS.all_reduce(torch.ones(2), "tp")
