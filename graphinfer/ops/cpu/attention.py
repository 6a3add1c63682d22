"""CPU implementations of the paged KV-cache ops (the cpu platform's default; ops/attention.py stays the oracle).

- the C++ kernel of csrc/cpu/paged_attention.cpp (built by `make`, see ops/cpu/ext.py) runs every decode row and
  every prefill chunk over at most NATIVE_PREFILL_CONTEXT tokens, reading K/V in place from the paged cache, all
  requests and KV heads in one parallel call, fp32 accumulation.
- longer prefill chunks run on ATen's flash CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`: tiled
  GEMMs, all cores, fp32 accumulation for bf16 inputs, GQA without repeating K/V) and never build a boolean mask:
  the n new rows of a chunk over a context of L tokens attend causally to themselves (is_causal) and fully to the
  cached prefix of L - n tokens; the two partials merge through their log-sum-exps, as split-KV flash attention
  does. One call per such request and layer; its K/V are gathered once (whole blocks).
- without the library, decode rows fall back to PyTorch: rows sorted by context length and cut into groups whose
  padding stays small, each group's K/V gathered by whole blocks (index_select, a memcpy per block) and attended
  by one SDPA call; every prefill chunk takes the flash path.
Rows with seq_len 0 (padding) and cache writes to slot -1 are skipped, as in the reference.
Caches of another dtype than the model's (kv_cache_dtype): the C++ kernels take an fp32 model's bf16 / fp16 caches
(rows narrowed as written, widened as read); other pairs, and the fallbacks, cast K/V rows to the query's dtype.
MLA's latent attention (mla_latent_attention) runs as this paged attention with the concatenated query and the latent
cache as key and value.

The op's optional arguments (sliding window, softcap, sinks; graphinfer/ops/attention.py) are native in the C++ kernel,
which then takes every chunk, however long: ATen's flash kernel has none of them, and under a window the kernel reads
only the window's blocks. Without the library such calls run the reference op.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.attention import paged_attention
from graphinfer.ops.cpu import ext
from graphinfer.ops.qk_norm_rope import chain_cache_write, qk_norm_rope

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
# Prefill chunks over contexts up to this long run in the C++ kernel, longer ones on ATen flash, whose tiled GEMMs win
# there: on AVX-512 at 2,048 tokens (in bf16 too without AMX: 328 vs 684 us at 162 tokens, 38.7 vs 41.2 ms at 2,048 on
# the AMD EPYC VM with avx512_bf16, 2026-11-29); bf16 / fp16 ones on AMX already at ~160 tokens (use_amx); on AVX2
# (8-lane tiles) the kernel wins at 512 tokens and flash at 1,024 in both dtypes.
# tools/cpu_attention_bench.py on the 2-core dev VMs, Intel and AMD EPYC (docs/benchmarks.md).
NATIVE_PREFILL_CONTEXT = ({torch.float32: 2048, torch.bfloat16: 2048, torch.float16: 2048}
                          if torch.backends.cpu.get_cpu_capability().startswith("AVX512")
                          else {torch.float32: 512, torch.bfloat16: 512, torch.float16: 512})


def use_amx(amx: bool) -> None:
    """Called by the cpu platform, which reads the CPU's flags (torch's capability string does not name AMX)."""
    if amx and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        NATIVE_PREFILL_CONTEXT.update({torch.bfloat16: 128, torch.float16: 128})


_DECODE_PAD_SLACK = 1.25  # a decode group attends over at most this times its rows' real context tokens


def reshape_and_cache_cpu(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
    if (ext.available() and _native_dtypes(key.dtype, key_cache.dtype) and value.dtype == key.dtype
            and value_cache.dtype == key_cache.dtype and slot_mapping.dtype == torch.int64
            and key.stride(1) == key.shape[2] and key.stride(2) == 1
            and value.stride(1) == value.shape[2] and value.stride(2) == 1):
        torch.ops.graphinfer_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
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
    k = _gather(key_cache, block_table, length).transpose(1, 2).to(q.dtype)  # [1, Hkv, L, D]
    v = _gather(value_cache, block_table, length).transpose(1, 2).to(q.dtype)
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
    k = _gather(key_cache, block_tables, max_len).transpose(1, 2).to(q.dtype)  # [B, Hkv, max_len, D]
    v = _gather(value_cache, block_tables, max_len).transpose(1, 2).to(q.dtype)
    mask = (torch.arange(max_len) < seq_lens.unsqueeze(1))[:, None, None, :]
    if bool(mask.all()):
        mask = None  # every row uses the whole length: no mask
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(2)


def paged_attention_cpu(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        query_start_loc: Tensor, seq_lens: Tensor, scale: float, sliding_window: int = 0,
                        softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    native = _native(query, key_cache, block_tables)
    # A pure decode batch (one token per request: known from the shapes alone), or the optional arguments ATen's
    # flash kernel lacks: every row on the C++ kernel, through the op a traced decode graph can record.
    every_row = query.shape[0] == query_start_loc.shape[0] - 1
    if sliding_window > 0 or softcap > 0 or sinks is not None or (native and every_row):
        if not native:
            return paged_attention.reference(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                             scale, sliding_window, softcap, sinks)
        out = torch.empty_like(query)
        torch.ops.graphinfer_cpu.paged_attention_all(out, query, key_cache, value_cache, block_tables,
                                                     query_start_loc, seq_lens, scale, sliding_window, float(softcap),
                                                     None if sinks is None else sinks.float().contiguous())
        return out
    if native:
        # The C++ kernel (csrc/cpu/) reads the paged cache in place for every decode row and every prefill chunk
        # over at most `native` tokens of context, zeroes padding rows, and returns how many chunks it left here.
        out = torch.empty_like(query)
        if not torch.ops.graphinfer_cpu.paged_attention(out, query, key_cache, value_cache, block_tables,
                                                        query_start_loc, seq_lens, scale, native):
            return out
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    if not native:
        out = _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, starts, q_lens, lens, scale)
    for i, (s, n, L) in enumerate(zip(starts, q_lens, lens)):
        if n > 1 and L > native:  # longer than the kernel took
            out[s: s + n] = _prefill(query[s: s + n], key_cache, value_cache, block_tables[i: i + 1], L,
                                     scale).to(out.dtype)
    return out


def _native(query: Tensor, key_cache: Tensor, block_tables: Tensor) -> int:
    """The longest prefill context the C++ kernel takes here (it takes every decode row); 0 where it cannot run."""
    if not (ext.available() and hasattr(torch.ops.graphinfer_cpu, "paged_attention_all")
            and _native_dtypes(query.dtype, key_cache.dtype) and query.stride(-1) == 1 and key_cache.is_contiguous()
            and block_tables.dtype == torch.int32):
        return 0
    return NATIVE_PREFILL_CONTEXT.get(query.dtype, 128)


def _native_dtypes(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the C++ kernels take rows of dtype over caches of cache_dtype: one dtype, or an fp32 model's bf16 /
    fp16 cache (kv_cache_dtype)."""
    return dtype == cache_dtype or (dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16))


def _decode_rows(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 starts: list[int], q_lens: list[int], lens: list[int], scale: float) -> Tensor:
    """Without the C++ kernel: decode rows in groups of similar context lengths, each gathered and attended."""
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
    return out


def mla_latent_attention_cpu(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                             query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """MLA's absorbed attention (graphinfer/ops/mla.py) as paged_attention_cpu with the query [q_latent, q_pe] and the
    latent cache as both key and value (one KV head of L + R), its output's first L columns: every decode row and short
    chunk on the C++ kernel, reading the cache in place. Against the reference op (gather + SDPA) at DeepSeek-V3's
    shape (H 16, L 512, R 64, batch 8 decode over 512 tokens; 2-vCPU AMD EPYC, AVX-512, 2 threads): bf16 24-30 ms vs
    145-197, fp32 6-11 ms vs 36-82 (tools/mla_attention_cpu_bench.py, docs/benchmarks.md "CPU: MLA latent attention
    alone"). It still reads each row twice (K and V) and computes the value's R-column tail only to drop it; a
    dedicated loop reading each row once would save that (not written)."""
    query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)
    out = paged_attention_cpu(query, kv_cache, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    return out[..., :q_latent.shape[-1]]


CPU_OPS = {"reshape_and_cache": reshape_and_cache_cpu, "paged_attention": paged_attention_cpu,
           "mla_latent_attention": mla_latent_attention_cpu,
           # its cache write as reshape_and_cache_cpu (no boolean-mask host sync unless there are padded rows)
           "qk_norm_rope_cache": chain_cache_write(qk_norm_rope.reference, reshape_and_cache_cpu, __name__)}
