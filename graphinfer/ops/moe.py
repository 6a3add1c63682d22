"""Mixture-of-experts ops: the naive dispatch -> grouped MLP -> combine chain, fused_experts (that chain as one
op, routing given: expert parallel's local experts) and fused_moe (the whole block, routing included).

Dropless and static-shaped, so the unfused graph traces and captures: T tokens routed to K experts each
give N = T * K rows, whatever the routing. Experts are SwiGLU MLPs over stacked weights
w13 [E, 2I, H] = cat(gate, up) along dim 1 (vLLM's w13, HF's gate_up_proj) and w2 [E, H, I] (down).
Index outputs are int64. No op here reads a value on the host, except moe_grouped_mlp on CPU (see there).
moe_count_experts is the expert-load statistic (EPLB's input): it adds to a per-layer counter in place.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


def _expert(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert, as HF's Qwen3MoeExperts computes it: silu(x @ gate.T) * (x @ up.T), then @ down.T."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _route(router_logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """HF Qwen3MoE's router: softmax in fp32, top-k, optional renormalisation in fp32, then the model dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _dispatch(hidden: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # sorted row i is flat row order[i] = token order[i] // K
    bounds = torch.arange(num_experts + 1, device=flat.device)
    expert_offsets = torch.searchsorted(flat[order], bounds)  # rows before expert e's: no bincount, so no sync
    inverse_perm = torch.empty_like(order)
    inverse_perm[order] = torch.arange(order.shape[0], device=order.device)
    return hidden.index_select(0, order // K), expert_offsets, inverse_perm


def _grouped_mlp(x: Tensor, expert_offsets: Tensor, w13: Tensor, w2: Tensor, sync_free: bool) -> Tensor:
    out = torch.zeros_like(x)
    if not sync_free:  # read the offsets on the host and run each expert on its own rows (exact FLOPs)
        bounds = expert_offsets.tolist()
        for e in range(w13.shape[0]):
            s, t = bounds[e], bounds[e + 1]
            if s < t:
                out[s:t] = _expert(x[s:t], w13[e], w2[e])
        return out
    # Capture-safe: every expert runs over all rows and keeps its own (E x the FLOPs; fused_moe is the fast path).
    rows = torch.arange(x.shape[0], device=x.device)
    expert_of_row = torch.searchsorted(expert_offsets, rows, right=True) - 1
    for e in range(w13.shape[0]):
        out = torch.where((expert_of_row == e).unsqueeze(-1), _expert(x, w13[e], w2[e]), out)
    return out


def _combine(expert_out: Tensor, inverse_perm: Tensor, topk_weights: Tensor) -> Tensor:
    T, K = topk_weights.shape
    rows = expert_out.index_select(0, inverse_perm).view(T, K, expert_out.shape[1])
    return (rows.float() * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)


@graphinfer_op(mutates_args=("expert_counts",))
def moe_count_experts(topk_ids: Tensor, expert_counts: Tensor, num_tokens: Tensor) -> None:
    """expert_counts[e] += the number of slots of the first num_tokens rows of topk_ids [T, K] routed to expert e.

    expert_counts [E] int64; num_tokens [1] int64, the step's real token count on the device: rows past it are
    padding (a captured graph's bucket) and count nothing. No host read, static shapes: capture-safe.
    """
    T, K = topk_ids.shape
    real = (torch.arange(T, device=topk_ids.device) < num_tokens).to(expert_counts.dtype)  # [T] 1 / 0 (padding)
    expert_counts.scatter_add_(0, topk_ids.reshape(-1).long(), real.unsqueeze(1).expand(T, K).reshape(-1))


@register_fake(moe_count_experts)
def _(topk_ids, expert_counts, num_tokens):
    return None


@graphinfer_op()
def moe_dispatch(hidden: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group each token's K expert slots by expert.

    hidden [T, H], topk_ids [T, K] (any int dtype) -> (sorted_hidden [T*K, H], expert_offsets [E+1] int64,
    inverse_perm [T*K] int64): flat slot t*K+k is sorted_hidden row inverse_perm[t*K+k] (a stable sort by
    expert id, so within an expert the rows keep token order); expert e owns rows
    expert_offsets[e]:expert_offsets[e+1] (expert_offsets[0] = 0, expert_offsets[E] = T*K).
    """
    return _dispatch(hidden, topk_ids, num_experts)


@register_fake(moe_dispatch)
def _(hidden, topk_ids, num_experts):
    n = topk_ids.shape[0] * topk_ids.shape[1]
    return (hidden.new_empty(n, hidden.shape[1]), topk_ids.new_empty(num_experts + 1, dtype=torch.int64),
            topk_ids.new_empty(n, dtype=torch.int64))


@graphinfer_op()
def moe_grouped_mlp(sorted_hidden: Tensor, expert_offsets: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Run rows expert_offsets[e]:expert_offsets[e+1] of sorted_hidden [N, H] through expert e -> [N, H].

    w13 [E, 2I, H] (first half gate, second half up), w2 [E, H, I]; in the activation dtype, as HF does.
    The CPU reference reads the offsets on the host (CPU has no device graphs to break); on a device the
    reference stays sync-free so the unfused graph can be captured.
    """
    return _grouped_mlp(sorted_hidden, expert_offsets, w13, w2, sync_free=sorted_hidden.device.type != "cpu")


@register_fake(moe_grouped_mlp)
def _(sorted_hidden, expert_offsets, w13, w2):
    return torch.empty_like(sorted_hidden)


@graphinfer_op()
def moe_combine(expert_out: Tensor, inverse_perm: Tensor, topk_weights: Tensor) -> Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert_out[inverse_perm[t*K + k]] -> [T, H].

    Products and sum in fp32, result in expert_out's dtype. topk_weights is [T, K].
    """
    return _combine(expert_out, inverse_perm, topk_weights)


@register_fake(moe_combine)
def _(expert_out, inverse_perm, topk_weights):
    return expert_out.new_empty(topk_weights.shape[0], expert_out.shape[1])


def _experts(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    sorted_hidden, offsets, inverse_perm = _dispatch(hidden, topk_ids, w13.shape[0])
    out = _grouped_mlp(sorted_hidden, offsets, w13, w2, sync_free=hidden.device.type != "cpu")
    return _combine(out, inverse_perm, topk_weights)


@graphinfer_op()
def fused_experts(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """moe_dispatch -> moe_grouped_mlp -> moe_combine as one op, routing given (vLLM's fused_experts):
    hidden [T, H], topk_ids [T, K] in [0, E), topk_weights [T, K] -> [T, H],
    out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]). The reference is that chain."""
    return _experts(hidden, topk_ids, topk_weights, w13, w2)


@register_fake(fused_experts)
def _(hidden, topk_ids, topk_weights, w13, w2):
    return torch.empty_like(hidden)


@graphinfer_op()
def fused_moe(hidden: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int, renormalize: bool) -> Tensor:
    """The whole softmax-routed MoE block: hidden [T, H], router_logits [T, E] -> [T, H].

        probs = softmax(router_logits.float(), -1); w, ids = topk(probs, top_k)
        if renormalize: w = w / w.sum(-1, keepdim=True)
        w = w.to(hidden.dtype)
        out[t] = sum_k w[t, k] * expert_{ids[t, k]}(hidden[t])
        expert_e(x) = (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

    The reference is the unfused chain itself (same arithmetic), so fusing never changes results on CPU.
    """
    weights, ids = _route(router_logits, top_k, renormalize, hidden.dtype)
    return _experts(hidden, ids, weights, w13, w2)


@register_fake(fused_moe)
def _(hidden, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(hidden)


@graphinfer_op(mutates_args=("expert_load",))
def eplb_map_to_physical_and_record(topk_ids: Tensor, logical_to_physical_map: Tensor, logical_replica_count: Tensor,
                                    expert_load: Tensor, num_tokens: Tensor) -> Tensor:
    """EPLB's routing (vLLM's eplb_map_to_physical_and_record): each slot's logical expert -> one of its physical
    replicas, and the physical load counted.

    topk_ids [T, K] logical ids; logical_to_physical_map [E, max_replicas] (an expert's physical slots, -1 padded);
    logical_replica_count [E]; expert_load [P] int64, += the slots of the first num_tokens rows routed to each physical
    expert (rows past num_tokens[0] are a captured bucket's padding). Slot t*K + k takes replica (t*K + k) % count:
    a hot expert's tokens spread evenly over its replicas, deterministically (vLLM's rule), so greedy output does not
    depend on the placement. Reads the maps from the device (no host read, static shapes): a captured graph stays valid
    when they are rewritten in place. Returns [T, K] int64 physical ids."""
    T, K = topk_ids.shape
    ids = topk_ids.long()
    position = torch.arange(T * K, device=ids.device).view(T, K)
    replica = position % logical_replica_count[ids]
    physical = logical_to_physical_map[ids].gather(-1, replica.unsqueeze(-1)).squeeze(-1)
    real = (torch.arange(T, device=ids.device) < num_tokens).to(expert_load.dtype)
    expert_load.scatter_add_(0, physical.reshape(-1), real.unsqueeze(1).expand(T, K).reshape(-1))
    return physical


@register_fake(eplb_map_to_physical_and_record)
def _(topk_ids, logical_to_physical_map, logical_replica_count, expert_load, num_tokens):
    return topk_ids.new_empty(topk_ids.shape, dtype=torch.int64)
