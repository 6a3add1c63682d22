"""The flash-attention Triton kernel (prefill / mixed batches over the paged cache) against the reference op.

Ragged batches of every kind the runner builds: prefill only, decode only (through the flash kernel, as a
piecewise graph's padded decode step runs it), mixed prefill chunks and decode rows, chunked prefill over a
cached prefix; with rows past query_start_loc[-1] (padding) and seq_len-0 requests, which must come out as
zeros. GQA ratios 1 / 2 / 8, head dims 64 / 128, block sizes 16 / 32 (every pair of them), fp32 and bf16.
Without a CUDA GPU the kernel runs under TRITON_INTERPRET=1 (upstream Triton here, Triton-Ascend's
interpreter in `make test-triton-ascend`); with one, compiled on "cuda" tensors. The reference is the op's
PyTorch implementation on CPU copies. Imports only torch, pytest and graphinfer.ops(.triton) (the Ascend
venv has no more).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

import graphinfer.ops as ref_ops  # noqa: E402
from attention_cases import (FEATURES, dense_paged_attention, feature_cases, poison_outside_windows,  # noqa: E402
                             to_device)
import graphinfer.ops.triton.attention as attention  # noqa: E402
from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
from graphinfer.ops.triton.attention import paged_attention_impl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# name -> (q_lens, seq_lens, padding rows past query_start_loc[-1])
SCENARIOS = {
    # fresh prompts, one spanning several query and KV tiles
    "prefill": ([5, 18, 70], [5, 18, 70], 4),
    # decode rows only, padded to a token bucket (T > B): the flash kernel, not the split-K decode kernel
    "decode": ([1, 1, 1, 1, 1], [5, 17, 0, 33, 80], 3),
    # decodes (one a padded request with seq_len 0), a chunk over a prefix, a fresh prefill, a seq_len-0 chunk
    "mixed": ([1, 7, 1, 12, 1, 21, 3], [9, 20, 0, 12, 3, 30, 0], 5),
    # chunks over a cached prefix longer than a KV tile (tiles below the diagonal run unmasked)
    "chunked": ([20, 9, 1], [150, 73, 40], 2),
}
# (GQA group, kv heads, head dim, block size): every GQA x head-dim and GQA x block-size pair appears.
CONFIGS = [(1, 2, 64, 16), (1, 2, 128, 32), (2, 2, 64, 32), (2, 2, 128, 16), (8, 1, 64, 32), (8, 1, 128, 16)]


def _batch(q_lens, seq_lens, pad, n_q, n_kv, head, block_size, dtype, seed=0):
    """Random paged caches (shuffled pages, tables wider than needed) and a flat query with `pad` extra rows."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    width = max(pages) + 2
    n_blocks = sum(pages) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(pages):
        block_tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    key_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    value_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    query = torch.randn(sum(q_lens) + pad, n_q, head, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def _zero_rows(q_lens, seq_lens, pad):
    """Rows the contract says are zero: those of seq_len-0 requests and the padding past query_start_loc[-1]."""
    rows, start = [], 0
    for n, L in zip(q_lens, seq_lens):
        rows += list(range(start, start + n)) if L == 0 else []
        start += n
    return rows + list(range(start, start + pad))


def _check(scenario, group, n_kv, head, block_size, dtype, seed=0, **tiling):
    """scenario: a SCENARIOS name or (q_lens, seq_lens, padding rows)."""
    q_lens, seq_lens, pad = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    args = _batch(q_lens, seq_lens, pad, group * n_kv, n_kv, head, block_size, dtype, seed)
    scale = head ** -0.5
    out = paged_attention_impl(*(a.to(DEVICE) for a in args), scale, kernel="flash", **tiling)
    ref = ref_ops.paged_attention(*args, scale)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), **TOL[dtype])
    zero = _zero_rows(q_lens, seq_lens, pad)
    assert (out[zero] == 0).all()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group,n_kv,head,block_size", CONFIGS, ids=[f"g{c[0]}-d{c[2]}-bs{c[3]}" for c in CONFIGS])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flash_attention_matches_reference(name, group, n_kv, head, block_size, dtype):
    _check(name, group, n_kv, head, block_size, dtype, seed=list(SCENARIOS).index(name) + 10 * group + head)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32), (64, 16)])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flash_attention_small_tiles(name, block_m, block_n):
    """Many query tiles per chunk and KV tiles straddling pages and the causal diagonal (block_m 16 with
    GQA 2: 8 query rows per tile; block_n 16 below the page size 32 and block_n 32 equal to it)."""
    _check(name, 2, 2, 64, 32, torch.float32, seed=7, block_m=block_m, block_n=block_n)


def test_flash_attention_non_power_of_two_group():
    """A GQA group of 3 (SmolLM2: 9 q heads over 3 kv heads) packs 21 query rows x 3 heads into a 64-row tile."""
    _check("mixed", 3, 2, 64, 16, torch.float32, seed=8, block_m=64, block_n=32)


class _Spy:
    """Stands in for a @triton.jit kernel and records its launches."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def test_default_dispatch(monkeypatch):
    """T == B runs the split-K decode kernel (+ its combine), anything else the flash kernel, once."""
    log = []
    for name in ("_flash_kernel", "_decode_kernel", "_combine_kernel"):
        monkeypatch.setattr(attention, name, _Spy(getattr(attention, name), name, log))
    scale = 32 ** -0.5
    cases = [(SCENARIOS["mixed"], ["_flash_kernel"]), (SCENARIOS["prefill"], ["_flash_kernel"]),
             (SCENARIOS["decode"], ["_flash_kernel"]),  # decode rows padded past query_start_loc[-1]: T > B
             (([1] * 4, [5, 17, 0, 33], 0), ["_decode_kernel", "_combine_kernel"])]
    for (q_lens, seq_lens, pad), want in cases:
        args = _batch(q_lens, seq_lens, pad, 4, 2, 32, 16, torch.float32)
        log.clear()
        out = TRITON_OPS["paged_attention"](*(a.to(DEVICE) for a in args), scale)
        assert log == want
        torch.testing.assert_close(out.cpu(), ref_ops.paged_attention(*args, scale), **TOL[torch.float32])
    with pytest.raises(ValueError, match="one query row per request"):
        paged_attention_impl(*_batch([2, 1], [5, 3], 0, 4, 2, 32, 16, torch.float32), scale, kernel="decode")


class _NanEmpty:
    """The torch module with torch.empty returning NaN-filled tensors: catches rows a kernel leaves unwritten."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs):
        size = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        return torch.full(tuple(size), float("nan"), **kwargs)


@pytest.mark.parametrize("name", ["mixed", "decode"])
def test_every_row_written(monkeypatch, name):
    """The output is not zero-filled first: the kernel itself writes the padding and seq_len-0 rows."""
    monkeypatch.setattr(attention, "torch", _NanEmpty())
    out = _check(name, 2, 2, 32, 16, torch.float32, block_m=16, block_n=16)
    assert not out.isnan().any()


@pytest.mark.parametrize("search_block", [16, 128])
def test_many_requests(monkeypatch, search_block):
    """More requests than one pass of the request search covers (search_block 16: three passes for 40)."""
    monkeypatch.setattr(attention, "_FLASH_SEARCH_BLOCK", search_block)
    q_lens = [1] * 36 + [9, 1, 17, 2]
    seq_lens = [3 + 5 * i % 37 for i in range(36)] + [9, 0, 40, 2]
    _check((q_lens, seq_lens, 3), 2, 2, 32, 16, torch.float32, seed=9, block_m=16, block_n=16)


# ---- the op's optional arguments: sliding window, softcap, sinks ---------------------------------------------------

def _check_features(scenario, group, n_kv, head, block_size, dtype, features, seed=0, **tiling):
    """The flash kernel against dense attention written in the test (tests/attention_cases.py), not the op's
    reference; the contract's zero rows stay 0."""
    q_lens, seq_lens, pad = SCENARIOS[scenario]
    args = _batch(q_lens, seq_lens, pad, group * n_kv, n_kv, head, block_size, dtype, seed)
    scale = head ** -0.5
    out = paged_attention_impl(*(a.to(DEVICE) for a in args), scale, **to_device(features, DEVICE), kernel="flash",
                               **tiling)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.cpu().double(), dense_paged_attention(*args, scale, **features), **TOL[dtype])
    assert (out[_zero_rows(q_lens, seq_lens, pad)] == 0).all()


@pytest.mark.parametrize("tiling", [{}, dict(block_m=16, block_n=16)], ids=["default", "tiles16"])
@pytest.mark.parametrize("case", FEATURES)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flash_attention_features(name, case, tiling):
    """Windows of 1, 5 and 19 positions (crossing pages of 16, and KV tiles: tiles16 also crosses query tiles, so tiles
    with the window's edge, unmasked tiles inside every row's window and diagonal tiles all occur), softcap, sinks and
    all three, GQA 2, in every scenario (padding rows and seq_len-0 requests included)."""
    _check_features(name, 2, 2, 64, 16, torch.float32, feature_cases(4)[case], seed=11, **tiling)


@pytest.mark.parametrize("case", ["window19", "all"])
@pytest.mark.parametrize("group,n_kv,head,block_size", [(8, 1, 128, 16), (1, 2, 64, 32)], ids=["g8-d128", "g1-d64"])
def test_flash_attention_features_bf16(case, group, n_kv, head, block_size):
    _check_features("chunked", group, n_kv, head, block_size, torch.bfloat16, feature_cases(group * n_kv)[case],
                    seed=12)


@pytest.mark.parametrize("tiling", [{}, dict(block_m=16, block_n=16)], ids=["default", "tiles16"])
def test_flash_attention_window_skips_blocks(tiling):
    """Chunks over long cached prefixes under a window of 19: the pages wholly before each chunk's first visible
    position hold NaN, which the kernel never reads."""
    q_lens, seq_lens, pad = SCENARIOS["chunked"]
    args = _batch(q_lens, seq_lens, pad, 4, 2, 64, 16, torch.float32, seed=13)
    expected = dense_paged_attention(*args, 0.125, sliding_window=19)
    poison_outside_windows(*args[1:], sliding_window=19)
    assert args[1].isnan().any()
    out = paged_attention_impl(*(a.to(DEVICE) for a in args), 0.125, sliding_window=19, kernel="flash", **tiling)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])
