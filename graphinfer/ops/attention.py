"""Paged KV cache ops: the cache write and attention over a flat batch of prefill chunks and decodes.

Cache layout per layer (vLLM's flash layout): key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_size].
A token's slot is block_id * block_size + offset; slot -1 means "write nothing" (padded rows).

Batch layout (flattened as in vLLM): request i owns query rows query_start_loc[i]:query_start_loc[i+1].
seq_lens[i] is its context length *including* those rows, whose K/V reshape_and_cache has already written,
so query row j of a q_len-row chunk sits at position seq_lens[i] - q_len + j and attends causally to
cache positions 0..that position. A request with seq_len 0 (a padded row) attends to nothing: output 0.
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


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, L, D], boolean mask [B, 1, Q, L] (True = attend)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@graphinfer_op()
def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
    query_start_loc: Tensor, seq_lens: Tensor, scale: float,
) -> Tensor:
    """Causal GQA attention of query [T, Hq, D] over each request's paged context -> [T, Hq, D].

    Reference implementation: decode rows (q_len 1) go through one padded batched attention,
    prefill chunks one request at a time (padding those to a common length would cost quadratic memory).
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    decode = [i for i, (n, L) in enumerate(zip(q_lens, lens)) if n == 1 and L > 0]
    prefill = [i for i, (n, L) in enumerate(zip(q_lens, lens)) if n > 1 and L > 0]
    if len(decode) == len(lens) == query.shape[0]:  # a pure decode batch: rows are requests, no indexing needed
        max_len = max(lens)
        k = _gather(key_cache, block_tables, max_len).transpose(1, 2)
        v = _gather(value_cache, block_tables, max_len).transpose(1, 2)
        mask = torch.arange(max_len, device=query.device) < seq_lens.unsqueeze(1)
        return _attend(query.unsqueeze(2), k, v, mask[:, None, None, :], scale).squeeze(2).to(query.dtype)
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=query.device)
        idx = torch.tensor(decode, device=query.device)
        max_len = max(lens[i] for i in decode)
        k = _gather(key_cache, block_tables[idx], max_len).transpose(1, 2)
        v = _gather(value_cache, block_tables[idx], max_len).transpose(1, 2)
        mask = torch.arange(max_len, device=query.device) < seq_lens[idx].unsqueeze(1)
        q = query[rows].unsqueeze(2)  # [B, Hq, 1, D]
        out[rows] = _attend(q, k, v, mask[:, None, None, :], scale).squeeze(2).to(out.dtype)
    for i in prefill:
        s, n, L = starts[i], q_lens[i], lens[i]
        k = _gather(key_cache, block_tables[i: i + 1], L).transpose(1, 2)
        v = _gather(value_cache, block_tables[i: i + 1], L).transpose(1, 2)
        q_pos = torch.arange(L - n, L, device=query.device)
        mask = torch.arange(L, device=query.device) <= q_pos.unsqueeze(1)  # [n, L]
        q = query[s: s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        out[s: s + n] = _attend(q, k, v, mask[None, None], scale)[0].transpose(0, 1).to(out.dtype)
    return out


@register_fake(paged_attention)
def _(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    return torch.empty_like(query)
