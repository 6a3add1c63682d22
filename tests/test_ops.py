"""Every graphinfer:: op against an independent reference, plus torch.library's registration checks."""
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention_cases import FEATURES, dense_paged_attention, feature_cases
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


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul(approximate):
    x = torch.randn(7, 2 * 24)
    torch.testing.assert_close(ops.gelu_and_mul(x, approximate), F.gelu(x[:, :24], approximate=approximate) * x[:, 24:])


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


def _paged_inputs(reqs, Hq, Hk, D, bs, dtype, seed=0):
    """A flat batch for [(context length, query rows)] (context 0: a padded row): K/V written through
    reshape_and_cache into shuffled blocks, one query per row -> paged_attention's first six arguments."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-L // bs) for L, _ in reqs) + 2
    kc = torch.zeros(num_blocks, bs, Hk, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(reqs), max(-(-L // bs) for L, _ in reqs) + 1, dtype=torch.int32)
    for i, (L, _) in enumerate(reqs):
        nb = -(-L // bs)
        block_tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        slots = block_tables[i, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs
        ops.reshape_and_cache(torch.randn(L, Hk, D, generator=g).to(dtype), torch.randn(L, Hk, D, generator=g).to(dtype),
                              kc, vc, slots)
    query = torch.randn(sum(n for _, n in reqs), Hq, D, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor([n for _, n in reqs]).cumsum(0).tolist()], dtype=torch.int32)
    return query, kc, vc, block_tables, starts, torch.tensor([L for L, _ in reqs], dtype=torch.int32)


# a prefill chunk over a cached prefix, decodes, a fresh prefill, a padded row; then a pure decode batch
FEATURE_BATCHES = {"mixed": [(12, 7), (20, 1), (9, 9), (0, 1), (3, 1), (26, 1)], "decode": [(12, 1), (0, 1), (30, 1)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", FEATURES)
@pytest.mark.parametrize("batch", list(FEATURE_BATCHES))
def test_paged_attention_features(batch, case, dtype):
    """Sliding window, softcap, sinks and all three, against dense attention written in the test (GQA 3, blocks of
    4: windows cross blocks); padded rows stay 0."""
    args = _paged_inputs(FEATURE_BATCHES[batch], 6, 2, 16, 4, dtype, seed=1)
    features = feature_cases(6)[case]
    out = ops.paged_attention(*args, 0.25, **features)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), dense_paged_attention(*args, 0.25, **features), **tol)


def _one_request(dtype, n=5, L=23, Hq=4, Hk=2, D=16, seed=2):
    """A chunk of n rows over a context of L tokens: HF's layout (q [1, Hq, n, D], k / v [1, Hk, L, D]) and the op's."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, m, D, generator=g).to(dtype) for h, m in ((Hq, n), (Hk, L), (Hk, L)))
    kc, vc = torch.zeros(8, 4, Hk, D, dtype=dtype), torch.zeros(8, 4, Hk, D, dtype=dtype)
    block_table = torch.randperm(8, generator=g)[None, :].to(torch.int32)
    slots = block_table[0, torch.arange(L) // 4].long() * 4 + torch.arange(L) % 4
    ops.reshape_and_cache(k[0].transpose(0, 1), v[0].transpose(0, 1), kc, vc, slots)
    paged = (q[0].transpose(0, 1), kc, vc, block_table, torch.tensor([0, n], dtype=torch.int32),
             torch.tensor([L], dtype=torch.int32))
    return (q, k, v), paged


def _hf_mask(n, L, sliding_window, dtype):
    """transformers' additive mask for the last n of L positions under its sliding-window causal mask function."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    visible = sliding_window_causal_mask_function(sliding_window)(0, 0, torch.arange(L - n, L)[:, None],
                                                                  torch.arange(L)[None, :])
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_hf_gpt_oss_eager(dtype):
    """transformers' gpt-oss eager attention (sliding window + sinks, s_aux) on one request equals the op. In bf16
    transformers takes its softmax in bf16 (the op: fp32): they agree to bf16's rounding there."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    (q, k, v), paged = _one_request(dtype)
    sinks = (torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    layer = types.SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    want, _ = eager_attention_forward(layer, q, k, v, _hf_mask(5, 23, 7, dtype), scaling=0.25)
    got = ops.paged_attention(*paged, 0.25, sliding_window=7, sinks=sinks)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want[0].float(), **tol)


def test_paged_attention_matches_hf_gemma2_eager():
    """transformers' Gemma 2 eager attention (sliding window + attn_logit_softcapping) on one request equals the op."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    (q, k, v), paged = _one_request(torch.float32)
    layer = types.SimpleNamespace(num_key_value_groups=2, head_dim=16, training=False)
    want, _ = eager_attention_forward(layer, q, k, v, _hf_mask(5, 23, 6, torch.float32), scaling=0.25, softcap=1.5)
    torch.testing.assert_close(ops.paged_attention(*paged, 0.25, sliding_window=6, softcap=1.5), want[0])


class _Attention(nn.Module):
    def __init__(self, **options):
        super().__init__()
        from graphinfer.models.layers import PagedAttention

        self.attn = PagedAttention(4, 2, 16, **options)

    def forward(self, q, k, v, slot_mapping, block_tables, query_start_loc, seq_lens):
        from graphinfer.models.layers import AttentionMetadata

        return self.attn(q, k, v, AttentionMetadata(slot_mapping, block_tables, query_start_loc, seq_lens))


@pytest.mark.parametrize("options", [{}, dict(sliding_window=5, softcap=2.0, sinks=True)], ids=["plain", "all"])
def test_paged_attention_layer_options(options):
    """PagedAttention passes sliding_window / softcap / sinks to the op only when set: a plain layer traces to the
    7-argument call; with them, the traced graph computes the op with them."""
    from graphinfer.compiler.trace import GraphinferTracer

    _, (q, kc, vc, bt, qsl, lens) = _one_request(torch.float32)
    model = _Attention(**options)
    if options:
        model.attn.sinks.data.normal_()
    model.attn.k_cache, model.attn.v_cache = kc.clone(), vc.clone()
    gm = torch.fx.GraphModule(model, GraphinferTracer().trace(model))
    node, = [n for n in gm.graph.nodes if n.target is torch.ops.graphinfer.paged_attention.default]
    assert len(node.args) == 7
    assert set(node.kwargs) == ({"sliding_window", "softcap", "sinks"} if options else set())
    kv = q[:, :2].reshape(5, 32)  # written nowhere (slot -1): the context is in the cache already
    got = gm(q.reshape(5, 64), kv, kv, torch.full((5,), -1), bt, qsl, lens)
    features = dict(sliding_window=5, softcap=2.0, sinks=model.attn.sinks) if options else {}
    torch.testing.assert_close(got, ops.paged_attention(q, kc, vc, bt, qsl, lens, 0.25, **features).reshape(5, 64))


def _opcheck_cases():
    kc = torch.zeros(8, 4, 2, 16)
    return [
        (torch.ops.graphinfer.rms_norm, (torch.randn(3, 16), torch.randn(16), 1e-6)),
        (torch.ops.graphinfer.add_rms_norm, (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
        (torch.ops.graphinfer.silu_and_mul, (torch.randn(3, 32),)),
        (torch.ops.graphinfer.gelu_and_mul, (torch.randn(3, 32), "tanh")),
        (torch.ops.graphinfer.rotary_embedding,
         (torch.tensor([0, 3, 5]), torch.randn(3, 64), torch.randn(3, 32), 16, torch.randn(16, 16), True)),
        (torch.ops.graphinfer.reshape_and_cache,
         (torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc.clone(), torch.tensor([0, -1, 9]))),
        (torch.ops.graphinfer.paged_attention,
         (torch.randn(3, 4, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16),
          torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
          torch.tensor([6, 3], dtype=torch.int32), 0.25)),
        (torch.ops.graphinfer.paged_attention,  # sliding window, softcap, sinks
         (torch.randn(3, 4, 16), torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16),
          torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
          torch.tensor([6, 3], dtype=torch.int32), 0.25, 3, 2.0, torch.randn(4))),
    ]


@pytest.mark.parametrize("op,args", _opcheck_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_op_registration(op, args):
    """Schema, fake (meta) impl and dispatch agree with the real impl (torch.library.opcheck)."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
