"""Paged KV cache ops: the cache write and attention over a flat batch of prefill chunks and decodes.

Cache layout per layer (vLLM's flash layout): key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_size].
A token's slot is block_id * block_size + offset; slot -1 means "write nothing" (padded rows).
The caches may hold another dtype than key/value/query (kv_cache_dtype): rows are cast as written, and read back in the
query's dtype.

Batch layout (flattened as in vLLM): request i owns query rows query_start_loc[i]:query_start_loc[i+1].
seq_lens[i] is its context length *including* those rows, whose K/V reshape_and_cache has already written,
so query row j of a q_len-row chunk sits at position seq_lens[i] - q_len + j and attends causally to
cache positions 0..that position. A request with seq_len 0 (a padded row) attends to nothing: output 0.

paged_attention's optional arguments are what Hugging Face attention layers declare beyond plain causal attention
(defaults: none of them, so 7-argument calls keep their meaning):
  - sliding_window W > 0: the row at position p attends to positions j with p - W < j <= p (transformers'
    sliding_window_causal_mask_function: the last W positions, its own included; Mistral, Gemma 2/3 local layers).
  - softcap c > 0: each logit, after the scale, becomes c * tanh(logit / c) (Gemma 2's attn_logit_softcapping).
  - sinks [Hq]: one more logit per query head that joins the softmax's denominator and adds no value (gpt-oss):
    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)). Sinks are read as fp32 and the softmax runs in fp32,
    as in every implementation of this op; transformers' eager gpt-oss layer computes the same formula in the
    logits' dtype (bf16 for a bf16 model), so it agrees with this op to that dtype's rounding.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op(mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write key/value [T, num_kv_heads, head_size] into the paged caches at slot_mapping [T]; skip slot -1."""
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value.to(value_cache.dtype))


@register_fake(reshape_and_cache)
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


def _gather(cache: Tensor, block_tables: Tensor, max_len: int) -> Tensor:
    """Per-request contiguous view of the cache: [B, max_len, num_kv_heads, head_size]."""
    block_size = cache.shape[1]
    pos = torch.arange(max_len, device=cache.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


def _visible(k_pos: Tensor, q_pos: Tensor, seq_len: Tensor, sliding_window: int) -> Tensor:
    """Which cache positions k_pos [L] the rows at q_pos [..., 1] see, within contexts of seq_len [..., 1]."""
    mask = (k_pos <= q_pos) & (k_pos < seq_len)
    return mask & (k_pos > q_pos - sliding_window) if sliding_window > 0 else mask


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
            sinks: Tensor | None = None) -> Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], boolean mask [B, 1, Q, L] (True = attend).

    Plain attention is SDPA; with a softcap or sinks, the same softmax attention written out in fp32 (SDPA has
    neither). A row that attends to nothing comes out 0 either way."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = q.float() @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # the sink's column joins the softmax, then is dropped: it weighs no value
        s = torch.cat((s, sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # nan: a row with no key and no sink
    return (p[..., :k.shape[2]] @ v).to(q.dtype)


@graphinfer_op()
def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
    sliding_window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None,
) -> Tensor:
    """Causal GQA attention of query [T, Hq, D] over each request's paged context -> [T, Hq, D]; optionally over a
    sliding window, with logit soft-capping, with per-head attention sinks [Hq] (see the module docstring).

    Reference implementation: decode rows (q_len 1) go through one padded batched attention,
    prefill chunks one request at a time (padding those to a common length would cost quadratic memory).
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    decode = [i for i, (n, L) in enumerate(zip(q_lens, lens)) if n == 1 and L > 0]
    prefill = [i for i, (n, L) in enumerate(zip(q_lens, lens)) if n > 1 and L > 0]
    extra = dict(softcap=softcap, sinks=sinks)
    if len(decode) == len(lens) == query.shape[0]:  # a pure decode batch: rows are requests, no indexing needed
        max_len = max(lens)
        k = _gather(key_cache, block_tables, max_len).transpose(1, 2)
        v = _gather(value_cache, block_tables, max_len).transpose(1, 2)
        L = seq_lens.unsqueeze(1)
        mask = _visible(torch.arange(max_len, device=query.device), L - 1, L, sliding_window)
        return _attend(query.unsqueeze(2), k, v, mask[:, None, None, :], scale, **extra).squeeze(2).to(query.dtype)
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=query.device)
        idx = torch.tensor(decode, device=query.device)
        max_len = max(lens[i] for i in decode)
        k = _gather(key_cache, block_tables[idx], max_len).transpose(1, 2)
        v = _gather(value_cache, block_tables[idx], max_len).transpose(1, 2)
        L = seq_lens[idx].unsqueeze(1)
        mask = _visible(torch.arange(max_len, device=query.device), L - 1, L, sliding_window)
        q = query[rows].unsqueeze(2)  # [B, Hq, 1, D]
        out[rows] = _attend(q, k, v, mask[:, None, None, :], scale, **extra).squeeze(2).to(out.dtype)
    for i in prefill:
        s, n, L = starts[i], q_lens[i], lens[i]
        k = _gather(key_cache, block_tables[i: i + 1], L).transpose(1, 2)
        v = _gather(value_cache, block_tables[i: i + 1], L).transpose(1, 2)
        q_pos = torch.arange(L - n, L, device=query.device)
        mask = _visible(torch.arange(L, device=query.device), q_pos.unsqueeze(1), L, sliding_window)  # [n, L]
        q = query[s: s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        out[s: s + n] = _attend(q, k, v, mask[None, None], scale, **extra)[0].transpose(0, 1).to(out.dtype)
    return out


@register_fake(paged_attention)
def _(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=0, softcap=0.0,
      sinks=None):
    return torch.empty_like(query)
