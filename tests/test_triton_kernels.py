"""The Triton kernels (graphinfer.ops.triton) against the reference ops, on small shapes.

Without a CUDA GPU the kernels run under TRITON_INTERPRET=1 (upstream Triton, or Triton-Ascend's
interpreter in the .venv-ascend venv); with one, the same tests run compiled on "cuda" tensors. The
reference is always the op's PyTorch implementation run on CPU copies of the inputs.
This module imports only torch, pytest, graphinfer.ops and graphinfer.ops.triton (the Ascend venv has no more).
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

import graphinfer.ops as ref_ops  # noqa: E402
from attention_cases import (FEATURES, dense_paged_attention, feature_cases, poison_outside_windows,  # noqa: E402
                             to_device)
from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
from graphinfer.ops.triton.attention import paged_attention_impl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _cpu(*ts):
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in ts]


def _close(actual, expected, dtype, **kw):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), **{**TOL[dtype], **kw})


def test_registry_has_every_op():
    # The unfused MoE pieces stay on the reference ops: fuse_moe replaces them with fused_moe. The expert-load
    # count is one scatter_add, capture-safe as it is.
    unfused_moe = {"moe_dispatch", "moe_grouped_mlp", "moe_combine", "moe_count_experts"}
    # EPLB's map from routed slots to physical replicas: a gather, a modulo and a scatter_add, capture-safe as they are
    unfused_moe.add("eplb_map_to_physical_and_record")
    # MLA's expanded op stays on the reference (absorb_mla, a default pass, replaces it); mla_attention_auto is
    # composed of ops that have kernels (bmm, mla_latent_attention, paged_attention).
    expanded_mla = {"mla_attention", "mla_attention_auto"}
    assert set(TRITON_OPS) == set(ref_ops.__all__) - unfused_moe - expanded_mla
    assert "fused_moe" in TRITON_OPS and "paged_attention" in TRITON_OPS


# ---- structured outputs' token bitmask ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [4100, 33])
def test_apply_token_bitmask(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    big = torch.randn(3, vocab + 64, generator=g).to(dtype)  # rows strided past the vocabulary
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # a row without a grammar: untouched
    expected = big[:, :vocab].clone()
    ref_ops.apply_token_bitmask.reference(expected, bitmask)
    out = big.to(DEVICE)
    TRITON_OPS["apply_token_bitmask"](out[:, :vocab], bitmask.to(DEVICE))
    assert torch.equal(out[:, :vocab].cpu(), expected) and torch.equal(out[:, vocab:].cpu(), big[:, vocab:])


# ---- norms -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 100), (2, 1000)])
def test_rms_norm(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    out = TRITON_OPS["rms_norm"](x.to(DEVICE), w.to(DEVICE), 1e-6)
    _close(out, ref_ops.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 100), (1, 1000)])
def test_add_rms_norm(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    out, res = TRITON_OPS["add_rms_norm"](x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-5)
    ref_out, ref_res = ref_ops.add_rms_norm(x, r, w, 1e-5)
    # The same rounded add; the interpreters truncate fp32 -> bf16 where devices round, so exact only in fp32.
    _close(res, ref_res, dtype, **(dict(atol=0, rtol=0) if dtype == torch.float32 else {}))
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_with_rows_packed(dtype, monkeypatch):
    """Wide rows, several per program (the launch rule packs them past _MIN_PROGRAMS rows), a ragged last program."""
    norm_module = importlib.import_module("graphinfer.ops.triton.norm")
    monkeypatch.setattr(norm_module, "_MIN_PROGRAMS", 2)
    norm_module._launch_params.cache_clear()
    try:
        assert norm_module._launch_params(7, 1000)[:3] == ((2,), 4, 1024)
        g = torch.Generator().manual_seed(4)
        x, r = (torch.randn(7, 1000, generator=g).to(dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(1000, generator=g)).to(dtype)
        _close(TRITON_OPS["rms_norm"](x.to(DEVICE), w.to(DEVICE), 1e-6), ref_ops.rms_norm(x, w, 1e-6), dtype)
        out, res = TRITON_OPS["add_rms_norm"](x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-5)
        ref_out, ref_res = ref_ops.add_rms_norm(x, r, w, 1e-5)
        _close(res, ref_res, dtype)
        _close(out, ref_out, dtype)
    finally:
        norm_module._launch_params.cache_clear()  # forget the packed launches


def test_rms_norm_strided_rows():
    """A row-strided view (a slice of a wider activation) is read in place."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 80, generator=g)
    w = torch.randn(48, generator=g)
    out = TRITON_OPS["rms_norm"](wide.to(DEVICE)[:, 16:64], w.to(DEVICE), 1e-6)
    _close(out, ref_ops.rms_norm(wide[:, 16:64], w, 1e-6), torch.float32)


# ---- silu_and_mul ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 200), (3, 3000)])
def test_silu_and_mul(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    _close(TRITON_OPS["silu_and_mul"](x.to(DEVICE)), ref_ops.silu_and_mul(x), dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 200), (3, 3000), (1, 2 * 1025)])
def test_gelu_and_mul(shape, dtype, approximate):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x.view(-1)[:4] = torch.tensor([-60.0, 60.0, -1e4, 1e4])  # the tails: tanh's exp saturates, no NaN
    _close(TRITON_OPS["gelu_and_mul"](x.to(DEVICE), approximate), ref_ops.gelu_and_mul(x, approximate), dtype)


def test_gelu_and_mul_strided_rows():
    """A row-strided view, as a slice of a wider gate_up output, and a bad approximate refused like F.gelu."""
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    _close(TRITON_OPS["gelu_and_mul"](wide.to(DEVICE)[:, 50:250], "tanh"), ref_ops.gelu_and_mul(wide[:, 50:250], "tanh"),
           torch.float32)
    with pytest.raises(ValueError, match="approximate='sigmoid'"):
        TRITON_OPS["gelu_and_mul"](wide.to(DEVICE), "sigmoid")


# ---- rotary ------------------------------------------------------------------------------------------------------

def _cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
@pytest.mark.parametrize("layout", ["flat", "heads"])
def test_rotary_embedding(layout, rot_dim, is_neox, dtype):
    g = torch.Generator().manual_seed(4)
    n_tokens, n_q, n_kv, head = 6, 4, 2, 32  # GQA 2:1; rot_dim 16 = partial rotary
    positions = torch.randint(0, 64, (n_tokens,), generator=g)
    cache = _cos_sin_cache(64, rot_dim)
    q = torch.randn(n_tokens, n_q, head, generator=g).to(dtype)
    k = torch.randn(n_tokens, n_kv, head, generator=g).to(dtype)
    if layout == "flat":
        q, k = q.flatten(1), k.flatten(1)
    args = (positions, q, k, head, cache, is_neox)
    q_out, k_out = TRITON_OPS["rotary_embedding"](*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    q_ref, k_ref = ref_ops.rotary_embedding(*args)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)


def test_rotary_embedding_qkv_slices():
    """query/key as column slices of one fused qkv activation (the fuse_qkv layout): strided rows."""
    g = torch.Generator().manual_seed(5)
    n_tokens, n_q, n_kv, head = 5, 4, 1, 64
    qkv = torch.randn(n_tokens, (n_q + 2 * n_kv) * head, generator=g)
    q, k = qkv[:, :n_q * head], qkv[:, n_q * head:(n_q + n_kv) * head]
    positions = torch.tensor([0, 1, 2, 40, 99])
    cache = _cos_sin_cache(100, 64, base=500000.0)
    d_qkv = qkv.to(DEVICE)
    d_q, d_k = d_qkv[:, :n_q * head], d_qkv[:, n_q * head:(n_q + n_kv) * head]
    q_out, k_out = TRITON_OPS["rotary_embedding"](positions.to(DEVICE), d_q, d_k, head, cache.to(DEVICE), True)
    q_ref, k_ref = ref_ops.rotary_embedding(positions, q, k, head, cache, True)
    _close(q_out, q_ref, torch.float32)
    _close(k_out, k_ref, torch.float32)


# ---- reshape_and_cache -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reshape_and_cache(block_size, dtype):
    g = torch.Generator().manual_seed(6)
    n_tokens, n_kv, head, n_blocks = 9, 2, 32, 5
    key = torch.randn(n_tokens, n_kv, head, generator=g)
    value = torch.randn(n_tokens, n_kv, head, generator=g)
    slots = torch.randperm(n_blocks * block_size, generator=g)[:n_tokens]
    slots[[2, 5]] = -1  # padded rows: write nothing
    key_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    value_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    kc, vc = key_cache.to(DEVICE), value_cache.to(DEVICE)
    assert TRITON_OPS["reshape_and_cache"](key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE)) is None
    ref_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    _close(kc, key_cache, dtype, atol=0, rtol=0)
    _close(vc, value_cache, dtype, atol=0, rtol=0)


def test_reshape_and_cache_strided_kv():
    """key/value as views of a fused qkv activation, int32 slots."""
    g = torch.Generator().manual_seed(7)
    n_tokens, n_q, n_kv, head, bs = 4, 2, 2, 16, 4
    qkv = torch.randn(n_tokens, (n_q + 2 * n_kv) * head, generator=g)
    slots = torch.tensor([3, -1, 8, 0], dtype=torch.int32)
    caches = [torch.zeros(3, bs, n_kv, head) for _ in range(2)]
    dev_caches = [c.to(DEVICE) for c in caches]

    def split(t):
        return (t[:, n_q * head:(n_q + n_kv) * head].view(n_tokens, n_kv, head),
                t[:, (n_q + n_kv) * head:].view(n_tokens, n_kv, head))

    TRITON_OPS["reshape_and_cache"](*split(qkv.to(DEVICE)), *dev_caches, slots.to(DEVICE))
    ref_ops.reshape_and_cache(*split(qkv), *caches, slots)
    for got, want in zip(dev_caches, caches):
        _close(got, want, torch.float32, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concat_and_cache_mla(dtype):
    """MLA's latent rows [kv_c, k_pe] as the model gives them: strided slices of kv_a_proj's output (k_pe rotated
    into a fresh tensor), DeepSeek-V3's 512 + 64 cut down to odd sizes, padded rows skipped, int32 slots."""
    g = torch.Generator().manual_seed(8)
    n_tokens, lora, rope, bs, n_blocks = 7, 40, 12, 4, 4
    latent = torch.randn(n_tokens, lora + rope, generator=g)
    kv_c, k_pe = latent[:, :lora], latent[:, lora:].contiguous()
    slots = torch.randperm(n_blocks * bs, generator=g)[:n_tokens].to(torch.int32)
    slots[[1, 4]] = -1
    cache = torch.randn(n_blocks, bs, 1, lora + rope, generator=g).to(dtype)
    dev_cache = cache.to(DEVICE)
    assert TRITON_OPS["concat_and_cache_mla"](kv_c.to(DEVICE), k_pe.to(DEVICE), dev_cache, slots.to(DEVICE)) is None
    ref_ops.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    _close(dev_cache, cache, dtype, atol=0, rtol=0)


# ---- paged attention ---------------------------------------------------------------------------------------------

def _paged_batch(q_lens, seq_lens, n_q, n_kv, head, block_size, dtype, seed=0, spare_pages=2, index_dtype=torch.int32):
    """Random paged caches, shuffled block tables (wider than needed) and a flat query for the given lengths."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    width = max(pages) + spare_pages
    n_blocks = sum(pages) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(seq_lens), width, dtype=index_dtype)
    for i, n in enumerate(pages):
        block_tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=index_dtype)
    key_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    value_cache = torch.randn(n_blocks, block_size, n_kv, head, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), n_q, head, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=index_dtype)
    return query, key_cache, value_cache, block_tables, qsl, torch.tensor(seq_lens, dtype=index_dtype)


def _check_attention(args, dtype, **tiling):
    scale = args[0].shape[-1] ** -0.5
    dev = [a.to(DEVICE) for a in args]
    out = paged_attention_impl(*dev, scale, **tiling) if tiling else TRITON_OPS["paged_attention"](*dev, scale)
    _close(out, ref_ops.paged_attention(*args, scale), dtype)
    return out


DECODE_LENS = [5, 17, 0, 33]  # the 0 is a padded row of a captured batch: output zeros


@pytest.mark.parametrize("n_q,n_kv,head,block_size", [(8, 2, 32, 4), (4, 4, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_decode(n_q, n_kv, head, block_size, dtype):
    args = _paged_batch([1] * len(DECODE_LENS), DECODE_LENS, n_q, n_kv, head, block_size, dtype)
    out = _check_attention(args, dtype)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 16), (2, 16)])
def test_paged_attention_decode_splits(num_splits, block_n, monkeypatch):
    """Split-KV decode (incl. more splits than a request has tiles, and splits of several tiles) equals the
    one-pass result. The op's buffers start as NaN: splits without tiles write no partials, and the combine
    must read only the others (and every output row must be written)."""
    args = _paged_batch([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 32, 4, torch.float32, seed=1)
    ref = ref_ops.paged_attention(*args, 32 ** -0.5)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    out = paged_attention_impl(*(a.to(DEVICE) for a in args), 32 ** -0.5, num_splits=num_splits, decode_block_n=block_n)
    _close(out, ref, torch.float32)


def test_paged_attention_decode_padded_qsl():
    """Padded requests given 0 query rows in query_start_loc still get zeros in the pure-decode path."""
    query, kc, vc, bt, _, lens = _paged_batch([1, 1, 1], [9, 0, 0], 4, 2, 32, 4, torch.float32, seed=2)
    qsl = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    out = TRITON_OPS["paged_attention"](*(a.to(DEVICE) for a in (query, kc, vc, bt, qsl, lens)), 32 ** -0.5)
    _close(out, ref_ops.paged_attention(query, kc, vc, bt, qsl, lens, 32 ** -0.5), torch.float32)


# decodes (one padded), a chunk over a cached prefix, a fresh prefill, a long chunk spanning several query tiles
MIXED_Q = [1, 7, 1, 12, 1, 21]
MIXED_L = [9, 20, 0, 12, 3, 30]


@pytest.mark.parametrize("n_q,n_kv,head,block_size", [(8, 2, 32, 4), (4, 4, 64, 16), (4, 1, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed(n_q, n_kv, head, block_size, dtype):
    args = _paged_batch(MIXED_Q, MIXED_L, n_q, n_kv, head, block_size, dtype, seed=3)
    out = _check_attention(args, dtype)
    assert (out[8] == 0).all()  # the padded decode row (request 2)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16)])
def test_paged_attention_mixed_tiling(block_m, block_n):
    """Small query/KV tiles: many query tiles per chunk, tiles straddling pages and the causal diagonal.
    (More flash-kernel cases: tests/test_triton_prefill_attention.py.)"""
    args = _paged_batch(MIXED_Q, MIXED_L, 8, 2, 32, 4, torch.float32, seed=4)
    _check_attention(args, torch.float32, block_m=block_m, block_n=block_n)


def test_paged_attention_prefill_only():
    """A batch of prefill chunks only (no decode rows)."""
    args = _paged_batch([5, 18], [5, 40], 4, 2, 32, 16, torch.float32, seed=5)
    _check_attention(args, torch.float32)


@pytest.mark.parametrize("q_lens,seq_lens", [([1] * 4, DECODE_LENS), (MIXED_Q, MIXED_L)])
def test_paged_attention_int64_metadata(q_lens, seq_lens):
    """int64 block tables / query_start_loc / seq_lens work like int32 ones."""
    args = _paged_batch(q_lens, seq_lens, 4, 2, 32, 4, torch.float16, seed=6, index_dtype=torch.int64)
    _check_attention(args, torch.float16)


# ---- paged attention's optional arguments: sliding window, softcap, sinks ------------------------------------------

def _check_features(args, features, dtype, **tiling):
    """The kernels against dense attention written in the test (tests/attention_cases.py), not the op's reference."""
    scale = args[0].shape[-1] ** -0.5
    dev = [a.to(DEVICE) for a in args]
    out = paged_attention_impl(*dev, scale, **to_device(features, DEVICE), **tiling)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.cpu().double(), dense_paged_attention(*args, scale, **features), **TOL[dtype])
    return out


@pytest.mark.parametrize("tiling", [{}, dict(num_splits=3, decode_block_n=16), dict(num_splits=1)],
                         ids=["default", "3splits", "1split"])
@pytest.mark.parametrize("case", FEATURES)
def test_paged_attention_decode_features(case, tiling):
    """The split-K decode kernel (and its combine: the window's tiles shared among the splits, sinks folded in the
    reduction) over contexts of 5 to 33 tokens in blocks of 4, GQA 4; the padded request stays 0."""
    args = _paged_batch([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 32, 4, torch.float32, seed=7)
    out = _check_features(args, feature_cases(8)[case], torch.float32, **tiling)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("tiling", [{}, dict(block_m=16, block_n=16)], ids=["default", "tiles16"])
@pytest.mark.parametrize("case", FEATURES)
def test_paged_attention_mixed_features(case, tiling):
    """The flash kernel over the mixed batch (decodes, a chunk over a prefix, a fresh prefill, a chunk over several
    query tiles), GQA 4, blocks of 4."""
    args = _paged_batch(MIXED_Q, MIXED_L, 8, 2, 32, 4, torch.float32, seed=8)
    out = _check_features(args, feature_cases(8)[case], torch.float32, **tiling)
    assert (out[8] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_lens,seq_lens", [([1] * 4, DECODE_LENS), (MIXED_Q, MIXED_L)], ids=["decode", "mixed"])
def test_paged_attention_all_features_16bit(q_lens, seq_lens, dtype):
    """Window, softcap and sinks at once on 16-bit caches (sinks in the caches' dtype: the kernels read them as fp32)."""
    args = _paged_batch(q_lens, seq_lens, 4, 1, 64, 16, dtype, seed=9)
    features = feature_cases(4)["all"]
    _check_features(args, {**features, "sinks": features["sinks"].to(dtype)}, dtype)


@pytest.mark.parametrize("q_lens,seq_lens,tiling", [([1] * 4, DECODE_LENS, dict(num_splits=3, decode_block_n=16)),
                                                    ([1] * 4, DECODE_LENS, {}),
                                                    (MIXED_Q, MIXED_L, dict(block_m=16, block_n=16)),
                                                    (MIXED_Q, MIXED_L, {})], ids=["decode3", "decode", "mixed16", "mixed"])
def test_paged_attention_window_skips_blocks(q_lens, seq_lens, tiling):
    """Blocks wholly outside every row's window are never read: NaN there changes nothing."""
    args = _paged_batch(q_lens, seq_lens, 8, 2, 32, 4, torch.float32, seed=10)
    expected = dense_paged_attention(*args, 32 ** -0.5, sliding_window=5)
    poison_outside_windows(*args[1:], sliding_window=5)
    assert args[1].isnan().any()
    out = paged_attention_impl(*(a.to(DEVICE) for a in args), 32 ** -0.5, sliding_window=5, **tiling)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_paged_attention_sinks_shape():
    args = _paged_batch([1], [3], 4, 2, 32, 4, torch.float32)
    with pytest.raises(ValueError, match="one logit per query head"):
        paged_attention_impl(*(a.to(DEVICE) for a in args), 0.1, sinks=torch.zeros(2, device=DEVICE))
