"""The Triton fused_moe kernel against a plain per-token PyTorch loop (and graphinfer::fused_moe when registered).

Runs under TRITON_INTERPRET=1 on CPU (upstream Triton and Triton-Ascend's interpreter) and on CUDA tensors
when a GPU is present. Shapes are kept small so the interpreters finish quickly.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by triton at @triton.jit time

import graphinfer.ops  # noqa: E402,F401  (registers torch.ops.graphinfer.*)
from graphinfer.ops.triton.fused_moe import fused_experts, fused_moe, moe_align_block_size  # noqa: E402

fused_moe_module = importlib.import_module("graphinfer.ops.triton.fused_moe")  # the package exports the function

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def reference_moe(hidden, router_logits, w13, w2, top_k, renormalize):
    """The op's formula token by token; expert math in fp32 on the (possibly bf16) inputs."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w.to(hidden.dtype)
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for k in range(top_k):
            e = int(ids[t, k])
            gate = x @ w13[e, :inter].float().T
            up = x @ w13[e, inter:].float().T
            y = (torch.nn.functional.silu(gate) * up) @ w2[e].float().T
            out[t] += w[t, k].float() * y
    return out.to(hidden.dtype)


def make_inputs(T, E, H, I, dtype, seed=0, dead_experts=0):
    """Random layer; the first `dead_experts` experts get -inf-like logits so no token routes to them."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g) * 2
    if dead_experts:
        logits[:, :dead_experts] -= 1e4
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    return [t.to(DEVICE) if t is logits else t.to(device=DEVICE, dtype=dtype) for t in (hidden, logits, w13, w2)]


def check(out, hidden, logits, w13, w2, top_k, renormalize):
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.device == hidden.device
    ref = reference_moe(hidden, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(out, ref, **TOL[hidden.dtype])
    if hasattr(torch.ops.graphinfer, "fused_moe"):
        op = torch.ops.graphinfer.fused_moe(hidden, logits, w13, w2, top_k, renormalize)
        torch.testing.assert_close(out, op, **TOL[hidden.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,K", [(8, 2), (16, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", [0, 1, 7, 33])
def test_fused_moe_matches_reference(T, E, K, renormalize, dtype):
    H, I = 40, 24  # not multiples of any block size: the H / I tails go through the masks
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, dtype, seed=T * 100 + E)
    out = fused_moe(hidden, logits, w13, w2, K, renormalize)
    if T == 0:
        assert out.shape == (0, H) and out.dtype == dtype
        return
    check(out, hidden, logits, w13, w2, K, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_tokens(dtype):
    T, E, K, H, I = 33, 16, 4, 40, 24
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, dtype, seed=7, dead_experts=6)
    ids = torch.topk(logits, K, dim=-1).indices
    used = torch.zeros(E, dtype=torch.bool, device=ids.device)
    used[ids.reshape(-1)] = True
    assert not used[:6].any() and used[6:].sum() >= 4  # a block of empty experts, then populated ones
    check(fused_moe(hidden, logits, w13, w2, K, True), hidden, logits, w13, w2, K, True)


@pytest.mark.parametrize("config", [
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1),  # several K steps and N tiles, partial last ones
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=3),  # swizzle with a ragged last group
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2),
])
def test_fused_experts_block_configs(config):
    T, E, K, H, I = 19, 8, 2, 40, 24
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, torch.float32, seed=3)
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    out = fused_experts(hidden, w, ids, w13, w2, config)
    torch.testing.assert_close(out, reference_moe(hidden, logits, w13, w2, K, False), **TOL[torch.float32])


@pytest.mark.parametrize("T,E,K,bm", [(1, 8, 2, 16), (7, 16, 4, 16), (33, 8, 2, 32), (40, 4, 3, 16)])
def test_align_block_size(T, E, K, bm):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEVICE)
    sorted_ids, block_expert = moe_align_block_size(ids, E, bm)
    n = T * K
    num_blocks = -(-(n + min(E, n) * (bm - 1)) // bm)
    assert sorted_ids.shape == (num_blocks * bm,) and block_expert.shape == (num_blocks,)
    rows = sorted_ids.cpu().long()
    real = rows[rows < n]
    assert torch.equal(real.sort().values, torch.arange(n))  # every (t, k) row exactly once
    assert bool((rows[rows >= n] == n).all())  # padding is the sentinel
    flat = ids.reshape(-1).cpu()
    be = block_expert.cpu()
    counts = torch.bincount(flat, minlength=E)
    assert int((be >= 0).sum()) == int(((counts + bm - 1) // bm).sum())
    assert bool((be[be >= 0][1:] >= be[be >= 0][:-1]).all()) and bool((be[(be >= 0).sum():] == -1).all())
    for b in range(num_blocks):
        blk = rows[b * bm:(b + 1) * bm]
        blk = blk[blk < n]
        if be[b] < 0:
            assert blk.numel() == 0
        else:
            assert bool((flat[blk] == be[b]).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64, 256])
def test_qwen3_30b_a3b_shape_bf16(T):
    E, K, H, I = 128, 8, 2048, 768
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, torch.bfloat16, seed=T)
    out = fused_moe(hidden, logits, w13, w2, K, True)
    ref = reference_moe(hidden, logits, w13, w2, K, True)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 64])  # the small-T and the grouped path
def test_cuda_graph_capture(T):
    """No host syncs and shape-only grids: the op captures into a CUDA graph and replays on new inputs."""
    E, K, H, I = 128, 8, 2048, 768
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, torch.bfloat16, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(hidden, logits, w13, w2, K, True)  # compile + warm the allocator off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, logits, w13, w2, K, True)
    new_hidden, new_logits, _, _ = make_inputs(T, E, H, I, torch.bfloat16, seed=2)
    hidden.copy_(new_hidden)
    logits.copy_(new_logits)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fused_moe(hidden, logits, w13, w2, K, True), atol=0, rtol=0)


# ---- the small-T (decode) path --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_decode_path_matches_reference(T, renormalize, dtype):
    """One program per (routed slot, output tile): H and I tails masked, several K steps (H > BLOCK_K)."""
    E, K, H, I = 16, 4, 264, 40  # H = 256 + an 8 tail: two K steps in gate/up; I = 2 full + 1 partial 16-row tile
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, dtype, seed=T + 50 * renormalize)
    w, ids = torch.topk(torch.softmax(logits.float(), -1), K, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    check(fused_experts(hidden, w.to(dtype), ids, w13, w2, decode=True), hidden, logits, w13, w2, K, renormalize)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", [fused_moe_module.DECODE_MAX_TOKENS, fused_moe_module.DECODE_MAX_TOKENS + 1])
def test_path_chosen_by_token_count(T, renormalize, monkeypatch):
    """fused_moe takes the small-T path up to DECODE_MAX_TOKENS tokens and the grouped one above; both match."""
    calls = []
    decode_experts = fused_moe_module._decode_experts
    monkeypatch.setattr(fused_moe_module, "_decode_experts", lambda *a: calls.append(1) or decode_experts(*a))
    E, K, H, I = 8, 2, 40, 24
    hidden, logits, w13, w2 = make_inputs(T, E, H, I, torch.float32, seed=T)
    check(fused_moe(hidden, logits, w13, w2, K, renormalize), hidden, logits, w13, w2, K, renormalize)
    assert bool(calls) == (T <= fused_moe_module.DECODE_MAX_TOKENS)


def test_fused_experts_op_matches_the_reference_chain():
    """graphinfer::fused_experts on Triton (routing given: expert parallel's local experts, K = 1, zero rows with
    weight 0 for other ranks' slots) against its reference, the moe_dispatch -> grouped_mlp -> combine chain."""
    from graphinfer.ops.triton import TRITON_OPS

    torch.manual_seed(0)
    N, H, inter, E = 12, 32, 16, 4
    rows, ids, weights = (torch.randn(N, H, device=DEVICE), torch.randint(0, E, (N, 1), device=DEVICE),
                          torch.ones(N, 1, device=DEVICE))
    rows[1::4], ids[1::4], weights[1::4] = 0, 0, 0
    w13, w2 = torch.randn(E, 2 * inter, H, device=DEVICE) * 0.2, torch.randn(E, H, inter, device=DEVICE) * 0.2
    got = TRITON_OPS["fused_experts"](rows, ids, weights, w13, w2)
    torch.testing.assert_close(got, torch.ops.graphinfer.fused_experts(rows, ids, weights, w13, w2), rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1::4], torch.zeros_like(got[1::4]))
