"""The cpu platform's paged-attention / cache-write ops (graphinfer/ops/cpu/attention.py) against the reference ops."""
import pytest
import torch

import graphinfer.ops as ref_ops
from graphinfer.ops.cpu import attention as cpu_attention, ext
from graphinfer.ops.cpu.attention import (_decode_groups, mla_latent_attention_cpu, paged_attention_cpu,
                                         reshape_and_cache_cpu)
from attention_cases import FEATURES, dense_paged_attention, feature_cases, poison_outside_windows
from conftest import need_cpu_kernels
from test_mla_kernels import dense_oracle, make_batch
from test_triton_kernels import DECODE_LENS, MIXED_L, MIXED_Q, TOL, _paged_batch

# decodes of widely different lengths (several decode groups, one padded row), a fresh prefill, chunks over a
# cached prefix (one whose prefix ends mid-block, one with a 1-token prefix), in request order mixed
RAGGED_Q = [1, 1, 9, 1, 1, 6, 1, 13, 1, 4]
RAGGED_L = [3, 70, 9, 0, 40, 23, 41, 14, 5, 5]


@pytest.fixture(autouse=True, params=["native", "torch"])
def decode_impl(request, monkeypatch):
    """Every test runs with the C++ decode kernel (csrc/cpu/, built by make) and with the PyTorch fallback."""
    if request.param == "native":
        need_cpu_kernels(ext.available())
    monkeypatch.setattr(ext, "available", lambda: request.param == "native")
    return request.param


def _check(q_lens, seq_lens, n_q, n_kv, head, block_size, dtype, seed=0):
    args = _paged_batch(q_lens, seq_lens, n_q, n_kv, head, block_size, dtype, seed=seed)
    scale = head ** -0.5
    out = paged_attention_cpu(*args, scale)
    ref = ref_ops.paged_attention.reference(*args, scale)  # the Python reference, whatever impl is registered
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    rows = torch.tensor([0, *q_lens]).cumsum(0)
    for i, n in enumerate(seq_lens):
        if n == 0:  # padded rows attend to nothing
            assert (out[rows[i]: rows[i + 1]] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head 72: not a whole number of float vectors (the kernel's tail lanes); heads 64 and 128 in fp32: K and V read
# straight from the cache (blocks of 16 = one vector's scores, and of 32); groups of 5 heads: a prefill tile's query
# vectors are no whole number of tile_values' passes (its tail instances); 16 heads a KV head (a whole vector)
@pytest.mark.parametrize("n_q,n_kv,head,block_size", [(9, 3, 64, 16), (4, 4, 32, 4), (4, 1, 32, 8), (2, 1, 72, 16),
                                                      (4, 2, 128, 32), (10, 2, 64, 16), (16, 1, 64, 16)])
def test_ragged_batch(n_q, n_kv, head, block_size, dtype):
    _check(RAGGED_Q, RAGGED_L, n_q, n_kv, head, block_size, dtype)


@pytest.mark.parametrize("q_lens,seq_lens", [([1] * 4, DECODE_LENS), ([1] * 3, [16, 16, 16]), (MIXED_Q, MIXED_L),
                                             ([5, 18], [5, 40]), ([1, 1, 1], [9, 0, 0])])
def test_batches_of_the_kernel_tests(q_lens, seq_lens):
    """Pure decode (padded, and all equal lengths: no mask), the Triton tests' mixed batch, prefill only."""
    _check(q_lens, seq_lens, 8, 2, 32, 4, torch.float32, seed=1)


def test_rows_past_the_last_request_are_zero():
    """Token rows beyond query_start_loc[-1] (a padded token count) belong to no request: zero, never stale memory."""
    q, kc, vc, bt, qsl, lens = _paged_batch([1, 3], [9, 3], 8, 2, 32, 4, torch.float32, seed=2)
    padded = torch.cat([q, torch.full_like(q[:2], float("nan"))])
    out = paged_attention_cpu(padded, kc, vc, bt, qsl, lens, 32 ** -0.5)
    torch.testing.assert_close(out[:4], paged_attention_cpu(q, kc, vc, bt, qsl, lens, 32 ** -0.5))
    assert (out[4:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_of_several_row_tiles(dtype, monkeypatch):
    """Chunks longer than the kernel's tile of 16 rows, fresh and over prefixes ending mid-block, beside decodes; then
    with the kernel's context limit between them, so the longer chunks take ATen flash in the same batch."""
    q_lens, seq_lens = [40, 1, 33, 1, 17, 16], [70, 90, 33, 5, 50, 16]
    monkeypatch.setitem(cpu_attention.NATIVE_PREFILL_CONTEXT, dtype, 4096)
    _check(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=3)
    monkeypatch.setitem(cpu_attention.NATIVE_PREFILL_CONTEXT, dtype, 40)
    _check(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=3)


def test_long_ragged_decode_with_strided_query():
    """Contexts over many blocks (one ending mid-block), query heads as a strided view (as split from a fused QKV)."""
    lens = [300, 17, 129, 1, 0, 64]
    q, *rest = _paged_batch([1] * len(lens), lens, 6, 2, 64, 16, torch.bfloat16, seed=2)
    qkv = torch.cat([q, torch.zeros_like(q[:, :2])], dim=1)
    strided = qkv[:, :6]
    assert not strided.is_contiguous()
    out = paged_attention_cpu(strided, *rest, 0.125)
    torch.testing.assert_close(out.float(), ref_ops.paged_attention.reference(q, *rest, 0.125).float(),
                               **TOL[torch.bfloat16])


def test_decode_groups_bound_padding():
    lens = [300, 10, 290, 12, 11, 0, 150]
    groups = _decode_groups(lens, [0, 1, 2, 3, 4, 6])
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4, 6]
    for g in groups:
        assert len(g) * max(lens[i] for i in g) <= 1.25 * sum(lens[i] for i in g) or len(g) == 1
    assert _decode_groups([7] * 5, list(range(5))) == [[0, 1, 2, 3, 4]]  # equal lengths: one group


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("key_dtype,cache_dtype,slot_dtype", [(torch.float32, torch.bfloat16, torch.int32),
                                                              (torch.bfloat16, torch.bfloat16, torch.int64),
                                                              (torch.float32, torch.float32, torch.int64)])
def test_reshape_and_cache(pad, key_dtype, cache_dtype, slot_dtype):
    """Mixed dtypes take the PyTorch path; matching dtypes with int64 slots the C++ kernel. Keys are a strided
    view (rows of a fused QKV output), as the model passes them."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 5, 8, generator=g).to(key_dtype)
    key, value = kv[:, 1:3], kv[:, 3:5]
    slots = torch.randperm(20, generator=g)[:6]
    if pad:
        slots[[1, 4]] = -1
    caches = [torch.randn(5, 4, 2, 8, generator=g).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reshape_and_cache_cpu(key, value, *caches, slots.to(slot_dtype))
    ref_ops.reshape_and_cache.reference(key, value, *expected, slots)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_of_whole_block_tasks(dtype):
    """Enough decode rows that each kernel task takes every KV head of its row (8 rows a thread), among a prefill
    chunk and a padded row; heads of 64 (row scores) and 72 (K transposed), 3 and 2 KV heads."""
    rows = 8 * torch.get_num_threads() + 3
    q_lens, seq_lens = [1] * rows + [7, 1], [5 + 37 * i % 200 for i in range(rows)] + [30, 0]
    _check(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=4)
    _check(q_lens, seq_lens, 4, 2, 72, 8, dtype, seed=5)


# ---- the op's optional arguments: sliding window, softcap, sinks (native in the C++ kernel; the fallback: reference)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FEATURES)
@pytest.mark.parametrize("n_q,n_kv,head,block_size", [(9, 3, 64, 16), (4, 1, 32, 8), (2, 1, 72, 16), (4, 2, 128, 32)])
def test_features_ragged_batch(n_q, n_kv, head, block_size, case, dtype):
    """Against dense attention written in the test (tests/attention_cases.py): windows crossing blocks, softcap, sinks,
    all three, over the ragged batch (decode rows, fresh prefills, chunks over prefixes, a padded row) with the
    kernel's row scores (64, 128), transposed K (32, 72), and prefill tiles."""
    args = _paged_batch(RAGGED_Q, RAGGED_L, n_q, n_kv, head, block_size, dtype, seed=6)
    features = feature_cases(n_q)[case]
    out = paged_attention_cpu(*args, head ** -0.5, **features)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), dense_paged_attention(*args, head ** -0.5, **features), **TOL[dtype])


@pytest.mark.parametrize("case", ["window5", "all"])
def test_features_decode_batch_of_whole_block_tasks(case):
    """Decode rows enough for tasks of every KV head (8 rows a thread), beside a prefill chunk and a padded row."""
    rows = 8 * torch.get_num_threads() + 3
    q_lens, seq_lens = [1] * rows + [7, 1], [5 + 37 * i % 200 for i in range(rows)] + [30, 0]
    args = _paged_batch(q_lens, seq_lens, 9, 3, 64, 16, torch.bfloat16, seed=7)
    features = feature_cases(9)[case]
    torch.testing.assert_close(paged_attention_cpu(*args, 0.125, **features).double(),
                               dense_paged_attention(*args, 0.125, **features), **TOL[torch.bfloat16])


def test_features_take_long_chunks_natively(decode_impl, monkeypatch):
    """With any of the optional arguments the kernel takes chunks past NATIVE_PREFILL_CONTEXT too (ATen flash has
    none of them); the fallback runs the reference op."""
    monkeypatch.setitem(cpu_attention.NATIVE_PREFILL_CONTEXT, torch.float32, 16)

    def refuse(*args, **kwargs):
        raise AssertionError("ATen flash got a chunk")

    monkeypatch.setattr(cpu_attention, "_prefill", refuse)
    args = _paged_batch([40, 1, 33], [70, 90, 33], 4, 2, 64, 16, torch.float32, seed=8)
    features = feature_cases(4)["all"]
    torch.testing.assert_close(paged_attention_cpu(*args, 0.125, **features).double(),
                               dense_paged_attention(*args, 0.125, **features), **TOL[torch.float32])


def test_window_skips_blocks(decode_impl):
    """The kernel's block loop starts at the window's first block: NaN in the blocks before it changes nothing."""
    if decode_impl == "torch":
        pytest.skip("the fallback (the reference op) gathers every block")
    args = _paged_batch(RAGGED_Q, RAGGED_L, 9, 3, 64, 4, torch.float32, seed=9)
    expected = dense_paged_attention(*args, 0.125, sliding_window=5)
    poison_outside_windows(*args[1:], sliding_window=5)
    assert args[1].isnan().any()
    torch.testing.assert_close(paged_attention_cpu(*args, 0.125, sliding_window=5).double(), expected,
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,seq_lens,pad", [([1] * 5, [1, 16, 0, 33, 70], 0),
                                                 ([1, 7, 1, 3, 2], [9, 40, 0, 20, 0], 2)],
                         ids=["decode", "mixed"])
def test_mla_latent_attention(q_lens, seq_lens, pad, dtype):
    """MLA's latent attention on the cpu platform (the paged attention above with the concatenated query, the latent
    cache as key and value): equal to the reference op and a dense oracle; padded rows 0. Strided q_latent / q_pe."""
    args = make_batch(q_lens, seq_lens, pad=pad, heads=8, latent=64, rope=32, dtype=dtype)
    out = mla_latent_attention_cpu(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    ref = ref_ops.mla_latent_attention.reference(*args)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.double(), dense_oracle(*args), **TOL[dtype])
    assert not out[args[4][2]].any() and not out[sum(q_lens):].any()  # request 2 has seq_len 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["none", "window150", "sinks", "all"])
def test_small_decode_batches_split_over_the_threads(case, dtype, decode_impl):
    """Fewer decode tasks than 2 a thread (batch 1, 2 threads: 3 KV heads): each row's blocks cut into parts whose
    softmax partials merge (a window starting inside the first part, sinks joining the merged denominator)."""
    torch.set_num_threads(2)  # the split needs threads > 1; conftest's suite runs with 2
    features = {"none": {}, "window150": dict(sliding_window=150), "sinks": feature_cases(9)["sinks"],
                "all": dict(feature_cases(9)["all"], sliding_window=150)}[case]
    for q_lens, seq_lens in [([1], [300]), ([1, 1], [257, 65]), ([1, 5], [200, 5])]:
        args = _paged_batch(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=8)
        torch.testing.assert_close(paged_attention_cpu(*args, 0.125, **features).double(),
                                   dense_paged_attention(*args, 0.125, **features), **TOL[dtype])


def test_amx_hands_half_precision_prefills_past_128_tokens_to_flash(monkeypatch):
    """The cpu platform says whether the CPU has AMX (its flags): there bf16 / fp16 flash wins from ~160 tokens."""
    monkeypatch.setattr(cpu_attention, "NATIVE_PREFILL_CONTEXT", dict(cpu_attention.NATIVE_PREFILL_CONTEXT))
    before = dict(cpu_attention.NATIVE_PREFILL_CONTEXT)
    cpu_attention.use_amx(False)
    assert cpu_attention.NATIVE_PREFILL_CONTEXT == before
    cpu_attention.use_amx(True)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert cpu_attention.NATIVE_PREFILL_CONTEXT == ({**before, torch.bfloat16: 128, torch.float16: 128}
                                                    if avx512 else before)
