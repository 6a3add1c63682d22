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


def _ranks(rank: int, port: int, done) -> None:
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
        done()
        os._exit(0)  # dies without a word (no clean-up): rank 0's next collective must fail, not hang
    with ps.phase("the dead-peer check"):
        with pytest.raises(ps.DistributedError, match=r"rank 0 of 2: all_reduce on group 'tp' failed during the dead-peer check"):
            OPS.all_reduce(x, "tp")
    ps.destroy()


def _parts(rank: int, ports: list[int], out: str) -> None:
    """Every check below that needs a real 2-rank gloo group, in one spawned pair of processes (starting one costs
    seconds): each part in a group of its own, its outcome written to out/<part>-<rank> ("ok" or the traceback) for
    its own test to assert. The collectives part ends with rank 1 dying, so it runs last."""
    import traceback

    def record(name, text):
        with open(os.path.join(out, f"{name}-{rank}"), "w") as f:
            f.write(text)

    for (name, fn), port in zip(PARTS, ports):
        try:
            if name == "collectives":
                fn(rank, port, lambda: record(name, "ok"))
            else:
                fn(rank, port)
        except BaseException:
            record(name, traceback.format_exc())
            ps.destroy()
        else:
            record(name, "ok")


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory):
    """part name -> {rank: "ok" or the traceback} of _parts' one spawned run."""
    out = str(tmp_path_factory.mktemp("gloo-pair"))
    ports = [launch.free_port() for _ in PARTS]
    error = None
    try:
        mp.start_processes(_parts, args=(ports, out), nprocs=2, start_method="spawn")
    except Exception as e:  # a rank that crashed outright: each part without a result says so below
        error = e
    results = {}
    for name, _ in PARTS:
        results[name] = {}
        for rank in (0, 1):
            path = os.path.join(out, f"{name}-{rank}")
            results[name][rank] = open(path).read() if os.path.exists(path) else f"no result ({error!r})"
    return results


def _assert_part(results, name):
    failed = {rank: text for rank, text in results[name].items() if text != "ok"}
    if failed:
        pytest.fail(f"{name} on two gloo ranks:\n" + "\n".join(f"rank {r}:\n{t}" for r, t in failed.items()), pytrace=False)


def test_collectives_on_two_gloo_ranks(gloo_pair):
    _assert_part(gloo_pair, "collectives")


def test_a_stalled_replica_fails_the_lockstep_round_within_the_timeout(gloo_pair):
    _assert_part(gloo_pair, "lockstep timeout")


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


E, K, H, I = 8, 2, 6, 4  # experts, slots per token, hidden, intermediate (expert parallel op tests)


def _ep_case(T: int, skewed: bool, E: int = E, K: int = K):
    """Replicated tokens, routing and expert weights (seeded alike on every rank): random top-k ids, or every
    token routed to experts of rank 1 only (the maximally skewed dispatch; as far as K <= E/2 allows)."""
    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(T, H, generator=g)
    scores = torch.rand(T, E, generator=g)
    if skewed:
        scores[:, : E // 2] = -1  # rank 0's experts never chosen
    ids = scores.topk(K, dim=-1).indices
    weights = torch.rand(T, K, generator=g)
    return hidden, ids, weights, torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)


def _ep_chunk(hidden, ids, weights, w13, w2):
    """This rank's sequence_parallel_chunk of the tokens, ids and weights; the expert weights as they are."""
    return (*(OPS.sequence_parallel_chunk(t, 2, "tp") for t in (hidden, ids, weights)), w13, w2)


def _ep_layer(dispatch, combine, x, ids, weights, w13, w2, rank: int, E: int = E):
    """One rank's EP MoE block as MoEExperts runs it: dispatch -> local experts (fused_experts, -1 rows as the layer
    feeds them: id 0, weight 0) -> combine. Returns (dispatch's rows and local ids, this rank's [Tl, H])."""
    rows, local_ids, meta = dispatch(x, ids, E, 2, "tp")
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    valid = (local_ids >= 0).unsqueeze(-1)
    out = OPS.fused_experts(rows, local_ids.clamp(min=0).unsqueeze(-1), valid.to(rows.dtype), w13[mine], w2[mine])
    return rows, local_ids, combine(out, ids, weights, meta, E, 2, "tp")


def _ep_ranks(rank: int, port: int) -> None:
    """ep_dispatch -> local experts (fused_experts, -1 rows as the layer feeds them) -> ep_combine -> all_gather
    against the single-device chain, for token counts not divisible by ep (padding) and one below it."""
    from graphinfer.ops import moe

    ps.init_distributed(rank, 2, 2, "gloo", "127.0.0.1", port, 60, expert_parallel=True)
    assert (ps.ep_size(), ps.ep_rank()) == (2, rank)
    for T in (7, 1, 12):
        for skewed in (False, True):
            hidden, ids, weights, w13, w2 = _ep_case(T, skewed)
            ref = moe.moe_combine(*_grouped(moe, hidden, ids, w13, w2), weights)
            x, ids_l, w_l = (OPS.sequence_parallel_chunk(t, 2, "tp") for t in (hidden, ids, weights))
            rows, local_ids, out = _ep_layer(OPS.ep_dispatch, OPS.ep_combine, x, ids_l, w_l, w13, w2, rank)
            assert rows.shape == (2 * x.shape[0] * K, H) and local_ids.shape == (2 * x.shape[0] * K,)
            assert ((local_ids >= -1) & (local_ids < E // 2)).all()
            assert (rows[local_ids < 0] == 0).all()  # other ranks' slots arrive as zero rows
            if skewed and rank == 0 and T % 2 == 0:  # (a padding row's ids are 0: rank 0's expert 0)
                assert (local_ids == -1).all()  # nothing for rank 0's experts: rank 1 computes every slot
            got = OPS.all_gather(out, 0, 2, "tp")[:T]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    ps.destroy()


def _grouped(moe, hidden, ids, w13, w2):
    sorted_hidden, offsets, inverse_perm = moe.moe_dispatch(hidden, ids, E)
    return moe.moe_grouped_mlp(sorted_hidden, offsets, w13, w2), inverse_perm


def test_expert_parallel_dispatch_and_combine_on_two_gloo_ranks(gloo_pair):
    _assert_part(gloo_pair, "expert parallel")


def _mc2_ranks(rank: int, port: int) -> None:
    """The npu ep adapters, i.e. MC2's npu_moe_distribute_dispatch / _combine as tests/npu_emulation.py emulates them
    (an EMULATION of torch_npu over gloo, not an NPU), give the reference ep_dispatch / ep_combine's result: on an A2
    and an A3, random and maximally skewed routings, padded chunks (T odd) and K > E/ep (MC2 hands back fewer rows
    than ep_dispatch's). ep 2, H 6 and fp32 lie outside MC2's hardware limits, where the adapters run the reference:
    checked once, then mc2_fits is forced so the MC2 path runs."""
    from npu_emulation import make_torch_npu

    from graphinfer.ops.npu import ops as npu

    ps.init_distributed(rank, 2, 2, "gloo", "127.0.0.1", port, 60, expert_parallel=True, mc2_group=True)
    real_fits = npu.mc2_fits
    for soc in (223, 253):  # Atlas A2, A3
        tnpu = make_torch_npu(soc)
        npu.hccl_comm_name = tnpu.emulation_comm_name  # the real one asks torch_npu's ProcessGroupHCCL
        ops, calls = npu.NpuOps(tnpu), tnpu.emulation_state.calls
        npu.mc2_fits = real_fits
        x, ids, w, w13, w2 = _ep_chunk(*_ep_case(7, False))
        want = _ep_layer(OPS.ep_dispatch, OPS.ep_combine, x, ids, w, w13, w2, rank)[2]
        torch.testing.assert_close(_ep_layer(ops.ep_dispatch, ops.ep_combine, x, ids, w, w13, w2, rank)[2], want)
        assert not calls  # fp32, ep 2: the reference all_to_all
        npu.mc2_fits = lambda *args: True
        for e, k in ((E, K), (4, 3)):
            for T in (7, 1, 12):
                for skewed in (False, True):
                    x, ids, w, w13, w2 = _ep_chunk(*_ep_case(T, skewed, e, k))
                    _, ref_ids, want = _ep_layer(OPS.ep_dispatch, OPS.ep_combine, x, ids, w, w13, w2, rank, e)
                    rows, local_ids, got = _ep_layer(ops.ep_dispatch, ops.ep_combine, x, ids, w, w13, w2, rank, e)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                    assert rows.shape == (2 * x.shape[0] * k, H) and ((local_ids >= -1) & (local_ids < e // 2)).all()
                    assert (rows[local_ids < 0] == 0).all()  # MC2's undefined tail rows (NaN here) come out zero
                    # the same slots arrive, grouped by expert instead (a padding row's ids are rewritten: see
                    # npu._mc2_expert_ids, so compare counts only where no padding row exists)
                    if T % 2 == 0:
                        assert torch.equal(torch.bincount(local_ids + 1, minlength=e // 2 + 1),
                                           torch.bincount(ref_ids + 1, minlength=e // 2 + 1))
                    if skewed and k <= e // 2 and rank == 0 and T % 2 == 0:
                        assert (local_ids == -1).all()  # every slot went to rank 1
        assert calls.count("npu_moe_distribute_dispatch") == calls.count("npu_moe_distribute_combine") == 12
    ps.destroy()


def test_expert_parallel_through_the_npu_mc2_adapters_on_two_gloo_ranks(gloo_pair):
    _assert_part(gloo_pair, "npu mc2 adapters")


def _lockstep_timeout_ranks(rank: int, port: int) -> None:
    """Two replicas of one rank: replica 0 drives a lockstep round that replica 1 (alive, stalled) never joins. Its
    wait ends after the distributed timeout, naming the rank, the round and the node; replica 1's is unbounded."""
    import time

    from graphinfer.runtime.engine.dp_lockstep import Lockstep

    ps.init_distributed(rank, 2, 2, "gloo", "127.0.0.1", port, 1, tp=1)
    if rank == 0:  # timed out (not: the connection closed when replica 1 leaves the group after its stall)
        with pytest.raises(ps.DistributedError, match=r"rank 0 of 2: all_reduce\(max\) across data-parallel ranks "
                                                      r"on group 'dp' failed during data-parallel lockstep round 1 "
                                                      r"on node .*timed out"):
            Lockstep(True).agree(None)
    else:
        time.sleep(2.5)
    ps.destroy()


PARTS = [("expert parallel", _ep_ranks), ("npu mc2 adapters", _mc2_ranks),
         ("lockstep timeout", _lockstep_timeout_ranks), ("collectives", _ranks)]  # see _parts


def test_expert_parallel_fake_impls_give_the_shapes():
    with FakeTensorMode():
        hidden, ids, w = torch.empty(3, 6), torch.empty(3, 2, dtype=torch.int64), torch.empty(3, 2)
        assert OPS.sequence_parallel_chunk(torch.empty(7, 6), 2, "tp").shape == (4, 6)
        rows, local_ids, meta = OPS.ep_dispatch(hidden, ids, 8, 2, "tp")
        assert rows.shape == (12, 6) and local_ids.shape == (12,) and local_ids.dtype == torch.int64
        assert meta.shape == (3 * 2 * 3 + 8 + 1,) and meta.dtype == torch.int32
        assert OPS.ep_combine(rows, ids, w, meta, 8, 2, "tp").shape == (3, 6)
        assert OPS.fused_experts(rows, local_ids.view(-1, 1), torch.empty(12, 1), torch.empty(4, 8, 6),
                                 torch.empty(4, 6, 4)).shape == (12, 6)
