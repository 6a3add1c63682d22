"""Dense attention for the paged-attention tests, written out independently of the op's reference
(graphinfer/ops/attention.py): plain softmax attention in fp64 over each request's whole context with an explicit
mask (causal, and the sliding window as transformers defines it: kv > q - window), the softcap, and sinks as an extra
logit per head that weighs no value. Imports only torch (the Triton-Ascend venv runs tests that use it)."""
import torch


def dense_attention(q, k, v, q_pos, scale, sliding_window=0, softcap=0.0, sinks=None):
    """q [n, Hq, D] at positions q_pos; k, v [L, Hkv, D] at positions 0..L-1 -> [n, Hq, D] in fp64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    kv_pos, q_pos = torch.arange(k.shape[0]), torch.tensor(list(q_pos))[:, None]
    mask = kv_pos <= q_pos
    if sliding_window:
        mask &= kv_pos > q_pos - sliding_window
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat((logits, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def dense_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, **features):
    """What paged_attention must return (fp64): each request's context read from the paged cache position by position,
    then dense_attention; rows of seq_len-0 requests and rows past query_start_loc[-1] are 0."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, L in enumerate(seq_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        if L == 0 or e == s:
            continue
        pos = torch.arange(L)
        blocks = block_tables[i].long()[pos // block_size]
        k, v = key_cache[blocks, pos % block_size], value_cache[blocks, pos % block_size]
        out[s:e] = dense_attention(query[s:e], k, v, range(L - (e - s), L), scale, **features)
    return out


def feature_cases(n_q_heads: int, seed: int = 0) -> dict[str, dict]:
    """The op's optional arguments as tested: windows of 1 (itself only), 5 and 19 positions (shorter than most
    contexts, crossing blocks), a softcap below the logits' range, sinks of either sign, and all three at once."""
    sinks = torch.randn(n_q_heads, generator=torch.Generator().manual_seed(seed)) * 2
    return {"window1": dict(sliding_window=1), "window5": dict(sliding_window=5), "window19": dict(sliding_window=19),
            "softcap": dict(softcap=1.5), "sinks": dict(sinks=sinks),
            "all": dict(sliding_window=6, softcap=2.0, sinks=sinks)}


FEATURES = list(feature_cases(1))


def to_device(features: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}


def poison_outside_windows(key_cache, value_cache, block_tables, query_start_loc, seq_lens, sliding_window):
    """NaN into every cache block that lies wholly before its request's first visible position (no row's window
    reaches it): an implementation that skips such blocks, as the kernels do, is unaffected. Blocks must not be
    shared between requests."""
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, L in enumerate(seq_lens.tolist()):
        first_visible = max(0, L - (starts[i + 1] - starts[i]) - sliding_window + 1)
        for p in range(first_visible // block_size):
            key_cache[block_tables[i, p]] = float("nan")
            value_cache[block_tables[i, p]] = float("nan")
