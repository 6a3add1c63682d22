"""Every graphinfer:: op against an independent reference, plus torch.library's registration checks."""
import pytest
import torch
import torch.nn.functional as F

from graphinfer import ops


def test_rms_norm_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(5, 64)
    ref = LlamaRMSNorm(64, eps=1e-5)
    ref.weight.data.normal_()
    torch.testing.assert_close(ops.rms_norm(x, ref.weight, 1e-5), ref(x), rtol=0, atol=0)


def test_add_rms_norm_is_add_then_norm():
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    out, new_res = ops.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(new_res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, ops.rms_norm(x + r, w, 1e-6), rtol=0, atol=0)


def test_silu_and_mul():
    x = torch.randn(7, 2 * 24)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T, Hq, Hk, D, theta = 6, 4, 2, 32, 10000.0
    positions = torch.tensor([0, 1, 2, 7, 30, 100])
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(128).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    q, k = torch.randn(T, Hq * D, dtype=dtype), torch.randn(T, Hk * D, dtype=dtype)
    oq, ok = ops.rotary_embedding(positions, q, k, D, cache, True)
    emb = torch.cat((freqs[positions], freqs[positions]), -1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]  # HF: [1, T, D]
    rq, rk = apply_rotary_pos_emb(q.view(T, Hq, D).transpose(0, 1)[None], k.view(T, Hk, D).transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(oq, rq[0].transpose(0, 1).reshape(T, -1), rtol=0, atol=0)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1).reshape(T, -1), rtol=0, atol=0)


def test_reshape_and_cache_skips_padding_slots():
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.reshape_and_cache(k, v, kc, vc, torch.tensor([5, -1, 14]))
    flat_k, flat_v = kc.view(16, 2, 8), vc.view(16, 2, 8)
    torch.testing.assert_close(flat_k[5], k[0]); torch.testing.assert_close(flat_k[14], k[2])
    torch.testing.assert_close(flat_v[5], v[0]); torch.testing.assert_close(flat_v[14], v[2])
    written = torch.zeros(16, dtype=torch.bool); written[[5, 14]] = True
    assert flat_k[~written].abs().sum() == 0 and flat_v[~written].abs().sum() == 0


def _dense_causal_attention(q, k, v, q_pos, scale):
    """q [n, Hq, D] at positions q_pos; k, v [L, Hkv, D] for positions 0..L-1. Loops, no SDPA."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i, p in enumerate(q_pos):
        for h in range(q.shape[1]):
            kk, vv = k[: p + 1, h // groups], v[: p + 1, h // groups]
            w = torch.softmax((kk @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ vv
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed_batch(dtype):
    """Prefill over a cached prefix, decodes, a fresh prefill and a padded row, in one flat batch."""
    torch.manual_seed(0)
    Hq, Hk, D, bs, num_blocks = 4, 2, 16, 4, 32
    # (context length incl. new tokens, new query tokens); seq_len 0 = padded row
    reqs = [(12, 7), (20, 1), (9, 9), (0, 1), (3, 1)]
    kc = torch.zeros(num_blocks, bs, Hk, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(-(-L // bs) for L, _ in reqs)
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    queries, expected, starts = [], [], [0]
    scale = D ** -0.5
    for i, (L, n) in enumerate(reqs):
        nb = -(-L // bs)
        block_tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        k, v = torch.randn(L, Hk, D, dtype=dtype), torch.randn(L, Hk, D, dtype=dtype)
        slots = (block_tables[i, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs)
        ops.reshape_and_cache(k, v, kc, vc, slots)
        q = torch.randn(n, Hq, D, dtype=dtype)
        queries.append(q)
        starts.append(starts[-1] + n)
        if L == 0:
            expected.append(torch.zeros_like(q))
        else:
            expected.append(_dense_causal_attention(q.float(), k.float(), v.float(), range(L - n, L), scale).to(dtype))
    out = ops.paged_attention(torch.cat(queries), kc, vc, block_tables, torch.tensor(starts, dtype=torch.int32),
                              torch.tensor([L for L, _ in reqs], dtype=torch.int32), scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, torch.cat(expected), **tol)


def _opcheck_cases():
    kc = torch.zeros(8, 4, 2, 16)
    return [
        (torch.ops.graphinfer.rms_norm, (torch.randn(3, 16), torch.randn(16), 1e-6)),
        (torch.ops.graphinfer.add_rms_norm, (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
        (torch.ops.graphinfer.silu_and_mul, (torch.randn(3, 32),)),
        (torch.ops.graphinfer.rotary_embedding,
         (torch.tensor([0, 3, 5]), torch.randn(3, 64), torch.randn(3, 32), 16, torch.randn(16, 16), True)),
        (torch.ops.graphinfer.reshape_and_cache,
         (torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc.clone(), torch.tensor([0, -1, 9]))),
        (torch.ops.graphinfer.paged_attention,
         (torch.randn(3, 4, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16),
          torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
          torch.tensor([6, 3], dtype=torch.int32), 0.25)),
    ]


@pytest.mark.parametrize("op,args", _opcheck_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_op_registration(op, args):
    """Schema, fake (meta) impl and dispatch agree with the real impl (torch.library.opcheck)."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
