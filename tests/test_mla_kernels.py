"""The MLA latent attention Triton kernel (graphinfer/ops/triton/mla_attention.py) against the reference op and an
independent dense oracle: decode batches (contexts across block and tile boundaries, seq_len-0 padded rows, one long
context split across programs), mixed prefill + decode batches (chunks over a cached prefix, spec-verify-like rows,
padding rows past query_start_loc[-1]), fp32 and bf16, head counts below / above one 16-head tile.

Without a CUDA GPU the kernel runs under TRITON_INTERPRET=1 (upstream Triton in the default suite, Triton-Ascend's
interpreter in `make test-triton-ascend`); with one, compiled on "cuda" tensors. Imports only torch, pytest and
graphinfer.ops(.triton) (the Ascend venv has no more). Shapes stay small: interpreters are slow.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: set before the import

import graphinfer.ops  # noqa: E402,F401  (registers the graphinfer:: ops)
from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
from graphinfer.ops.triton.mla_attention import mla_latent_attention_impl  # noqa: E402

ref = torch.ops.graphinfer
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_batch(q_lens, seq_lens, pad=0, heads=16, latent=32, rope=16, block_size=16, dtype=torch.float32, seed=0):
    """Random latent cache (shuffled pages, a table wider than needed), q_latent as absorb_mla makes it (a
    transposed bmm output: not contiguous) and q_pe as a slice of the query (row stride > R)."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    width = max(pages, default=0) + 2
    n_blocks = sum(pages) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(pages):
        block_tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.randn(n_blocks, block_size, 1, latent + rope, generator=g).to(dtype)
    T = sum(q_lens) + pad
    q_latent = torch.randn(heads, T, latent, generator=g).to(dtype).transpose(0, 1)  # [T, H, L], strided
    q_pe = torch.randn(T, heads, 8 + rope, generator=g).to(dtype)[..., 8:]  # [T, H, R], a slice
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return q_latent, q_pe, cache, block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), (latent + rope) ** -0.5


def dense_oracle(q_latent, q_pe, cache, block_tables, qsl, seq_lens, scale):
    """fp64, written out: score = q_latent . c + q_pe . k_pe over positions 0..p, value c; empty rows 0."""
    T, H, L = q_latent.shape
    out = torch.zeros(T, H, L, dtype=torch.float64)
    bs = cache.shape[1]
    starts = qsl.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        if n == 0 or e == s:
            continue
        pos = torch.arange(n)
        rows = cache[block_tables[i].long()[pos // bs], pos % bs, 0].double()  # [n, L + R]
        c, k_pe = rows[:, :L], rows[:, L:]
        logits = (torch.einsum("thl,nl->htn", q_latent[s:e].double(), c)
                  + torch.einsum("thr,nr->htn", q_pe[s:e].double(), k_pe)) * scale
        q_pos = torch.arange(n - (e - s), n)[:, None]
        logits = logits.masked_fill(pos[None, :] > q_pos, float("-inf"))
        out[s:e] = torch.einsum("htn,nl->thl", torch.softmax(logits, -1), c)
    return out


def run(args, **kw):
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return mla_latent_attention_impl(*dev, **kw).cpu()


def check(args, dtype, **kw):
    got = run(args, **kw)
    assert got.dtype == dtype and got.shape == args[0].shape
    expected = ref.mla_latent_attention(*args)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(got.double(), dense_oracle(*args), **TOL[dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_contexts_and_padded_rows(dtype):
    """Contexts of 1, a block's end (16), a block + 1 (17), a tile's end (32), 45; a padded request (seq_len 0)."""
    args = make_batch([1] * 6, [1, 16, 17, 0, 32, 45], dtype=dtype)
    got = check(args, dtype)
    assert not got[3].any()


@pytest.mark.parametrize("splits", [1, 3, None])
def test_decode_long_context_split(splits):
    """B = 1 over 150 tokens: split-K across programs (None: the shape rule, which splits here), combined by LSE;
    3 splits of 10 tiles leave the last split short."""
    args = make_batch([1], [150], heads=20)  # 20 heads: two head tiles, the second partly masked
    check(args, torch.float32, num_splits=splits, block_n=16)


def test_decode_splits_with_empty_splits_and_padding():
    """More splits than a short context has tiles: the empty splits' partials must weigh nothing; a seq_len-0 row."""
    args = make_batch([1, 1, 1], [5, 0, 70])
    got = check(args, torch.float32, num_splits=8, block_n=16)
    assert not got[1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode(dtype):
    """Decodes, a chunk over a cached prefix, a fresh prefill, spec-verify-like 3-row requests, a seq_len-0 chunk,
    and padding rows past query_start_loc[-1] (zeros)."""
    args = make_batch([1, 7, 1, 12, 3, 3, 2], [9, 40, 0, 12, 20, 33, 0], pad=3, heads=8, dtype=dtype)
    got = check(args, dtype)
    assert not got[-3:].any() and not got[8].any()


def test_mixed_batch_with_splits():
    args = make_batch([4, 1, 2], [70, 33, 2], heads=4)
    check(args, torch.float32, num_splits=4, block_n=16)


def test_deepseek_v3_dims():
    """L = 512, R = 64 (DeepSeek-V3's kv_lora_rank and rope dim), 16 heads, block size 64: one decode step of two
    requests and a 2-row chunk."""
    args = make_batch([1, 1, 2], [70, 3, 20], latent=512, rope=64, block_size=64, dtype=torch.bfloat16)
    check(args, torch.bfloat16)


def test_empty_batches():
    q_latent, q_pe, cache, bt, _, _, scale = make_batch([1], [4])
    none = torch.zeros(0, dtype=torch.int32)
    got = run((q_latent, q_pe, cache, bt[:0], torch.zeros(1, dtype=torch.int32), none, scale))
    assert not got.any()  # rows but no requests: all padding
    assert run((q_latent[:0], q_pe[:0], cache, bt, torch.tensor([0, 0], dtype=torch.int32),
                torch.tensor([4], dtype=torch.int32), scale)).shape == (0, 16, 32)


def test_registered_with_the_ops_signature():
    assert TRITON_OPS["mla_latent_attention"].__name__ == "mla_latent_attention"
    args = make_batch([1, 1], [3, 20])
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    torch.testing.assert_close(TRITON_OPS["mla_latent_attention"](*dev).cpu(), ref.mla_latent_attention(*args),
                               **TOL[torch.float32])
