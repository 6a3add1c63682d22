"""The qk_norm_rope Triton kernel against its reference op (the unfused rms_norm + rotary chain), and its
WRITE_CACHE form, qk_norm_rope_cache, against that chain followed by reshape_and_cache (the caches compared).

Without a CUDA GPU it runs under TRITON_INTERPRET=1 (upstream Triton, or Triton-Ascend's interpreter in the
.venv-ascend venv, see the Makefile's test-triton-ascend); with one, compiled on "cuda" tensors. Imports only
torch, pytest, graphinfer.ops and graphinfer.ops.triton (the Ascend venv has no more).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

import graphinfer.ops as ref_ops  # noqa: E402
from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
from graphinfer.ops.triton.qk_norm_rope import _launch_params  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _case(n_tokens, n_q, n_kv, head, rot_dim, dtype, seed=0, max_pos=64):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n_tokens, (n_q + 2 * n_kv) * head, generator=g) * 3).to(dtype)
    # Gains far from 1 and different for q and k: a kernel that swaps or drops one shows.
    q_w = (0.5 + torch.rand(head, generator=g)).to(dtype)
    k_w = (1.5 + torch.rand(head, generator=g)).to(dtype)
    positions = torch.randint(0, max_pos, (n_tokens,), generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return qkv, n_q, n_kv, head, q_w, k_w, 1e-6, positions, cache


def _check(args, is_neox, dtype):
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    got = TRITON_OPS["qk_norm_rope"](*dev, is_neox)
    want = ref_ops.qk_norm_rope(*args, is_neox)
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        torch.testing.assert_close(a.cpu().float(), b.float(), **TOL[dtype], msg=lambda m: f"{name}: {m}")
    assert torch.equal(got[2].cpu(), want[2])  # v is a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # 16: partial rotary, the tail of each head passes through
def test_qk_norm_rope(rot_dim, is_neox, dtype):
    _check(_case(5, 4, 2, 32, rot_dim, dtype), is_neox, dtype)


@pytest.mark.parametrize("n_tokens,n_q,n_kv,head", [
    (1, 16, 8, 128),  # Qwen3-0.6B at batch 1: two programs, q in one, k and v in the other
    (3, 12, 4, 128),  # a program holding q and k heads; v in the next
    (4, 3, 1, 24),  # head_size not a power of two: masked channels
])
def test_qk_norm_rope_shapes(n_tokens, n_q, n_kv, head):
    _check(_case(n_tokens, n_q, n_kv, head, head, torch.float32, seed=1), True, torch.float32)


def test_qk_norm_rope_strided_qkv_and_no_tokens():
    args = list(_case(4, 4, 2, 32, 32, torch.float32, seed=2))
    wide = torch.randn(4, args[0].shape[1] + 16)
    wide[:, 8:-8] = args[0]
    args[0] = wide[:, 8:-8]  # rows of a wider activation: read in place
    _check(args, True, torch.float32)
    empty = [torch.empty(0, args[0].shape[1])] + args[1:7] + [torch.empty(0, dtype=torch.long), args[8]]
    outs = TRITON_OPS["qk_norm_rope"](*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in empty], True)
    assert [tuple(o.shape) for o in outs] == [(0, 128), (0, 64), (0, 64)]


def _cache_case(n_q, n_kv, head, dtype, cache_dtype, block_size, slots, seed=3):
    """qk_norm_rope args for len(slots) tokens, plus caches of 4 blocks filled with noise (what a write leaves
    alone must stay) and the slot mapping."""
    args = _case(len(slots), n_q, n_kv, head, head, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    caches = [torch.randn(4, block_size, n_kv, head, generator=g).to(cache_dtype) for _ in range(2)]
    return args, caches, torch.tensor(slots)


def _check_cache(args, caches, slots, is_neox):
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    got_caches = [c.to(DEVICE) for c in caches]
    want_caches = [c.clone() for c in caches]
    got = TRITON_OPS["qk_norm_rope_cache"](*dev, is_neox, *got_caches, slots.to(DEVICE))
    want = ref_ops.qk_norm_rope_cache(*args, is_neox, *want_caches, slots)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[args[0].dtype] if caches[0].dtype == torch.float32 else TOL[torch.bfloat16]
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[args[0].dtype], msg=lambda m: f"q: {m}")
    torch.testing.assert_close(got_caches[0].cpu().float(), want_caches[0].float(), **tol,
                               msg=lambda m: f"key cache: {m}")
    if caches[1].dtype == args[0].dtype:
        assert torch.equal(got_caches[1].cpu(), want_caches[1])  # v is copied
    else:  # cast once to the cache dtype; Triton's interpreter rounds fp32 -> bf16 toward zero, torch to nearest
        torch.testing.assert_close(got_caches[1].cpu().float(), want_caches[1].float(), **tol,
                                   msg=lambda m: f"value cache: {m}")


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_qk_norm_rope_cache(dtype, cache_dtype, block_size):
    # Scattered over blocks, out of order, with padded rows (slot -1: nothing written).
    slots = [3 * block_size + 5, -1, 7, 2 * block_size, -1, block_size - 1]
    _check_cache(*_cache_case(4, 2, 32, dtype, cache_dtype, block_size, slots), is_neox=True)


@pytest.mark.parametrize("is_neox", [True, False])
def test_qk_norm_rope_cache_qwen3_heads(is_neox):
    # Qwen3-0.6B's 16 q / 8 kv heads of 128 at batch 3 (one padded): k and v heads split across programs.
    slots = [20, -1, 33]
    _check_cache(*_cache_case(16, 8, 128, torch.float32, torch.float32, 16, slots, seed=4), is_neox=is_neox)


def test_qk_norm_rope_cache_no_tokens():
    args, caches, _ = _cache_case(4, 2, 32, torch.float32, torch.float32, 16, [0])
    empty = [torch.empty(0, args[0].shape[1])] + list(args[1:7]) + [torch.empty(0, dtype=torch.long), args[8]]
    before = [c.clone() for c in caches]
    dev = [c.to(DEVICE) for c in caches]
    q = TRITON_OPS["qk_norm_rope_cache"](*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in empty], True,
                                         *dev, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert tuple(q.shape) == (0, 128) and all(torch.equal(a.cpu(), b) for a, b in zip(dev, before))


def test_grid_stays_within_triton_ascends_limit():
    grid, n_blocks, block_h, block_d = _launch_params(1, 32, 128)
    assert (grid, n_blocks, block_h, block_d) == ((2,), 2, 16, 128)
    grid, n_blocks, block_h, _ = _launch_params(40000, 96, 128)  # a long prefill of a 64:16-head model
    assert grid[0] <= 65535 and grid[0] == 40000 * n_blocks and block_h * n_blocks >= 96
