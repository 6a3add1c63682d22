"""CPU implementations of the paged KV-cache ops (the cpu platform's default; ops/attention.py stays the oracle).

Attention runs on ATen's flash CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`: tiled, all cores,
fp32 accumulation for bf16 inputs, GQA without repeating K/V) and never builds a boolean mask for prefill:
- prefill chunk of n rows over a context of L tokens: the n new rows attend causally to themselves (is_causal)
  and fully to the cached prefix of L - n tokens; the two partials merge through their log-sum-exps, as
  split-KV flash attention does;
- decode rows: sorted by context length and cut into groups whose padding stays small, so a batch whose
  lengths differ widely does not gather and attend over max(len) for every row; one flash call per group.
K/V are gathered by whole blocks (index_select: a memcpy per block), once per request or decode group and layer.
Rows with seq_len 0 (padding) and cache writes to slot -1 are skipped, as in the reference.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.qk_norm_rope import chain_cache_write, qk_norm_rope

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_DECODE_PAD_SLACK = 1.25  # a decode group attends over at most this times its rows' real context tokens


def reshape_and_cache_cpu(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:  # padded rows: the reference's masking, only when there are some
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value.to(value_cache.dtype))


def _gather(cache: Tensor, block_tables: Tensor, length: int) -> Tensor:
    """Positions 0..length-1 of each request's context: [B, length, Hkv, D]. Whole blocks through index_select
    (one memcpy per block, several times faster on CPU than indexing token by token)."""
    n_blocks = -(-length // cache.shape[1])
    blocks = cache.index_select(0, block_tables[:, :n_blocks].reshape(-1).long())
    return blocks.view(block_tables.shape[0], -1, *cache.shape[2:])[:, :length]


def _merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Combine two softmax-attention partials over disjoint key sets (o [.., H, n, D], lse [.., H, n]) in fp32."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp_().unsqueeze(-1), (lse2 - m).exp_().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def _prefill(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor, length: int,
             scale: float) -> Tensor:
    """q [n, Hq, D]: the last n positions of a context of `length` tokens (block_table [1, W]) -> [n, Hq, D]."""
    n = q.shape[0]
    k = _gather(key_cache, block_table, length).transpose(1, 2)  # [1, Hkv, L, D]
    v = _gather(value_cache, block_table, length).transpose(1, 2)
    q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    prefix = length - n
    out, lse = _flash(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)
    if prefix:
        out_p, lse_p = _flash(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
        out = _merge(out, lse, out_p, lse_p)
    return out[0].transpose(0, 1)


def _decode_groups(lens: list[int], rows: list[int]) -> list[list[int]]:
    """Rows sorted by length, longest first, cut where padding to the group's longest would exceed the slack."""
    order = sorted(rows, key=lambda i: -lens[i])
    groups, cur, real = [], [], 0
    for i in order:
        if cur and (len(cur) + 1) * lens[cur[0]] > _DECODE_PAD_SLACK * (real + lens[i]):
            groups.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lens[i]
    return groups + [cur] if cur else groups


def _decode(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, max_len: int,
            scale: float) -> Tensor:
    """q [B, Hq, D], one row per request, over contexts of seq_lens (<= max_len) -> [B, Hq, D]."""
    k = _gather(key_cache, block_tables, max_len).transpose(1, 2)  # [B, Hkv, max_len, D]
    v = _gather(value_cache, block_tables, max_len).transpose(1, 2)
    mask = (torch.arange(max_len) < seq_lens.unsqueeze(1))[:, None, None, :]
    if bool(mask.all()):
        mask = None  # every row uses the whole length: no mask
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(2)


def paged_attention_cpu(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    decode = [i for i, (n, L) in enumerate(zip(q_lens, lens)) if n == 1 and L > 0]
    out = query.new_zeros(query.shape) if len(decode) < query.shape[0] else query.new_empty(query.shape)
    for group in _decode_groups(lens, decode):
        if len(group) == len(lens) == query.shape[0]:  # a pure decode batch in one group: rows are requests
            out.copy_(_decode(query, key_cache, value_cache, block_tables, seq_lens, lens[group[0]], scale))
            break
        idx = torch.tensor(group)
        rows = torch.tensor([starts[i] for i in group])
        out.index_copy_(0, rows, _decode(query.index_select(0, rows), key_cache, value_cache,
                                         block_tables.index_select(0, idx), seq_lens.index_select(0, idx),
                                         lens[group[0]], scale).to(out.dtype))
    for i, (s, n, L) in enumerate(zip(starts, q_lens, lens)):
        if n > 1 and L > 0:
            out[s: s + n] = _prefill(query[s: s + n], key_cache, value_cache, block_tables[i: i + 1], L,
                                     scale).to(out.dtype)
    return out


CPU_OPS = {"reshape_and_cache": reshape_and_cache_cpu, "paged_attention": paged_attention_cpu,
           # its cache write as reshape_and_cache_cpu (no boolean-mask host sync unless there are padded rows)
           "qk_norm_rope_cache": chain_cache_write(qk_norm_rope.reference, reshape_and_cache_cpu, __name__)}
