"""Multi-head latent attention (MLA: DeepSeek-V2 / V3) over a paged latent cache.

The cache holds one row per token: the normalised KV latent c_kv (kv_lora_rank L) then the rotated shared key part
k_pe (qk_rope_head_dim R), laid out as a one-KV-head cache [num_blocks, block_size, 1, L + R] (vLLM's MLA cache, with
the head axis kept so the paged-attention ops read it as it is).

Two forms compute the same attention (query heads H, q = [q_nope (N), q_pe (R)] per head):
  - expanded (mla_attention, the model's form): each context row's latent goes through kv_b_proj to per-head
    k_nope (N) and v (V); k = [k_nope, k_pe]; causal multi-head attention with dimension N + R;
  - absorbed (what the absorb_mla pass writes): q_nope x W_UK (kv_b_proj's key rows) gives the query in the latent
    space, so attention is multi-query over the cached rows themselves (graphinfer::paged_attention with the latent
    cache as key and value, dimension L + R), and the output's first L columns x W_UV (the value rows) give v.
"""
import torch
from torch import Tensor

from graphinfer.ops.attention import _attend, _gather, _visible, paged_attention
from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op(mutates_args=("kv_cache",))
def concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write [kv_c (T, L), k_pe (T, R)] rows into the latent cache [num_blocks, block_size, 1, L + R] at slot_mapping
    [T]; skip slot -1 (vLLM's concat_and_cache_mla)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    rows = torch.cat((kv_c[keep], k_pe[keep]), dim=-1).to(kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots[keep], rows)


@register_fake(concat_and_cache_mla)
def _(kv_c, k_pe, kv_cache, slot_mapping):
    return None


@graphinfer_op()
def mla_attention(query: Tensor, kv_cache: Tensor, kv_b_weight: Tensor, block_tables: Tensor,
                  query_start_loc: Tensor, seq_lens: Tensor, scale: float, qk_nope_head_dim: int,
                  v_head_dim: int) -> Tensor:
    """Causal MLA of query [T, H, N + R] over each request's paged latent context, expanded: kv_b_weight
    [H * (N + V), L] (kv_b_proj's weight, this rank's heads) turns each cached latent into per-head k_nope and v.
    -> [T, H, V]. The batch layout is paged_attention's (graphinfer/ops/attention.py)."""
    T, H, _ = query.shape
    N, V = qk_nope_head_dim, v_head_dim
    L = kv_b_weight.shape[1]
    out = query.new_zeros(T, H, V)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    w = kv_b_weight.view(H, N + V, L)
    for i, (s, e, ctx) in enumerate(zip(starts[:-1], starts[1:], lens)):
        n = e - s
        if n == 0 or ctx == 0:
            continue
        rows = _gather(kv_cache, block_tables[i: i + 1], ctx)[0, :, 0]  # [ctx, L + R]
        c, k_pe = rows[:, :L].to(query.dtype), rows[:, L:].to(query.dtype)
        kv = torch.einsum("sl,hdl->hsd", c, w.to(query.dtype))  # [H, ctx, N + V]
        k = torch.cat((kv[..., :N], k_pe.unsqueeze(0).expand(H, -1, -1)), dim=-1)
        q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, N + R]
        positions = torch.arange(ctx, device=query.device)
        mask = _visible(positions, torch.arange(ctx - n, ctx, device=query.device).unsqueeze(1), ctx, 0)
        o = _attend(q, k.unsqueeze(0), kv[..., N:].unsqueeze(0), mask[None, None], scale)  # [1, H, n, V]
        out[s:e] = o[0].transpose(0, 1).to(out.dtype)
    return out


@register_fake(mla_attention)
def _(query, kv_cache, kv_b_weight, block_tables, query_start_loc, seq_lens, scale, qk_nope_head_dim, v_head_dim):
    return query.new_empty(query.shape[0], query.shape[1], v_head_dim)


@graphinfer_op()
def mla_latent_attention(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                         query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """The absorbed form's attention: causal multi-query attention of H query heads over the latent rows
    [c (L), k_pe (R)] of the paged cache [num_blocks, block_size, 1, L + R], with score q_latent . c + q_pe . k_pe
    (q_latent [T, H, L], q_pe [T, H, R]) and value c, the rows' first L columns -> [T, H, L]. vLLM's FlashMLA /
    Triton MLA decode computes the same. Reference: paged_attention with the cache as key and value, sliced.
    Platform impls: Triton (ops/triton/mla_attention.py: each latent row read once per head tile, split-K), cpu (the
    C++ paged attention, ops/cpu/attention.py), torch_npu (FIA through the paged_attention adapter, ops/npu/ops.py)."""
    L = q_latent.shape[-1]
    query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)
    return paged_attention(query, kv_cache, kv_cache, block_tables, query_start_loc, seq_lens, scale)[..., :L]


@register_fake(mla_latent_attention)
def _(q_latent, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale):
    return torch.empty_like(q_latent)


@graphinfer_op()
def mla_attention_auto(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, w_uk: Tensor, w_uv: Tensor,
                       block_tables: Tensor, query_start_loc: Tensor, seq_lens: Tensor, scale: float,
                       expand_min_query_len: int, expand_max_tokens: int) -> Tensor:
    """MLA from the split weights W_UK [H, N, L] and W_UV [H, L, V] (what absorb_mla writes), in the form that does
    fewer FLOPs for the step, chosen from shapes alone (no host read: capture-safe, and a captured decode graph holds
    the absorbed form only). q_nope [T, H, N], q_pe [T, H, R] -> [T, H, V].

      - absorbed (decode, short chunks): q_nope x W_UK, mla_latent_attention over the latent rows, x W_UV;
      - expanded (T >= expand_min_query_len per request, i.e. long prefill chunks, and the context of the batch's
        block tables <= expand_max_tokens rows): every latent row the block tables reach goes through W_UK / W_UV once
        into a temporary per-head K [N + R] / V cache (V zero-padded to K's width: vLLM pads V for flash attention
        the same way), then plain paged_attention. The workspace is bounded by expand_max_tokens, not the prompt."""
    T, B = q_nope.shape[0], seq_lens.shape[0]
    W = block_tables.shape[1]
    bs = kv_cache.shape[1]
    if T < expand_min_query_len * B or B * W * bs > expand_max_tokens:
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        o = mla_latent_attention(q_latent, q_pe, kv_cache, block_tables, query_start_loc, seq_lens, scale)
        return torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)
    H, N, L = w_uk.shape
    R, V = q_pe.shape[-1], w_uv.shape[-1]
    rows = kv_cache.view(-1, bs, L + R)[block_tables.long().clamp_min(0).flatten()].to(q_nope.dtype)  # [B*W, bs, L+R]
    c, k_pe = rows[..., :L], rows[..., L:]
    k = torch.cat((torch.einsum("xsl,hnl->xshn", c, w_uk), k_pe.unsqueeze(2).expand(-1, -1, H, -1)), dim=-1)
    v = torch.einsum("xsl,hlv->xshv", c, w_uv)
    D = max(N + R, V)
    k, v = (torch.nn.functional.pad(t, (0, D - t.shape[-1])) for t in (k, v))
    query = torch.nn.functional.pad(torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1), (0, D - N - R))
    tables = torch.arange(B * W, dtype=block_tables.dtype, device=block_tables.device).view(B, W)
    return paged_attention(query, k, v, tables, query_start_loc, seq_lens, scale)[..., :V]


@register_fake(mla_attention_auto)
def _(q_nope, q_pe, kv_cache, w_uk, w_uv, block_tables, query_start_loc, seq_lens, scale, expand_min_query_len,
      expand_max_tokens):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[-1])
