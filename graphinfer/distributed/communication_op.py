"""Collectives as `graphinfer::` custom ops, so tracing keeps them as graph nodes that passes can match and
device graphs capture (vLLM registers torch.ops.vllm.all_reduce & co. the same way).

Each takes the name of its process group (parallel_state.TP_GROUP) and works out of place: the graph keeps
value semantics. The implementation is torch.distributed on the group's backend (gloo / NCCL / HCCL), which
is what every platform runs; fake impls give the shapes.
"""
import torch
import torch.distributed as dist
from torch import Tensor

from graphinfer.distributed import parallel_state as ps
from graphinfer.ops.library import graphinfer_op, register_fake

# torch 2.13 renamed all_gather_into_tensor (the GPU image's torch 2.11 has only the old name)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@graphinfer_op(row_wise=True)
def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """The sum of x over the group's ranks."""
    out = x.clone()
    ps.collective("all_reduce", group_name, lambda group: dist.all_reduce(out, group=group))
    return out


@register_fake(all_reduce)
def _(x, group_name):
    return torch.empty_like(x)


@graphinfer_op()
def all_gather(x: Tensor, dim: int, world_size: int, group_name: str) -> Tensor:
    """The ranks' x concatenated along dim, in rank order."""
    dim %= x.dim()
    x = x.contiguous()
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    ps.collective("all_gather", group_name, lambda group: _all_gather_into(out, x, group=group))
    if dim == 0:
        return out
    return out.view(world_size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


@register_fake(all_gather)
def _(x, dim, world_size, group_name):
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


@graphinfer_op()
def reduce_scatter(x: Tensor, dim: int, world_size: int, group_name: str) -> Tensor:
    """Rank r's part of the sum over ranks: chunk r (of world_size along dim) of sum(x)."""
    dim %= x.dim()
    inp = x.movedim(dim, 0).contiguous()
    out = inp.new_empty((inp.shape[0] // world_size, *inp.shape[1:]))
    ps.collective("reduce_scatter", group_name, lambda group: dist.reduce_scatter_tensor(out, inp, group=group))
    return out.movedim(0, dim).contiguous()


@register_fake(reduce_scatter)
def _(x, dim, world_size, group_name):
    shape = list(x.shape)
    shape[dim] //= world_size
    return x.new_empty(shape)


@graphinfer_op(row_wise=True)
def all_reduce_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                            group_name: str) -> tuple[Tensor, Tensor]:
    """add_rms_norm(all_reduce(x), residual): (rms_norm(sum + residual), sum + residual), as one node.

    What fuse_allreduce_add_rmsnorm produces (vLLM's AllReduceFusionPass). Here it is the chain through the
    dispatcher, so each platform's add_rms_norm runs (Triton on cuda, torch_npu's npu_add_rms_norm after the
    HCCL all-reduce on npu); a one-kernel implementation (an IPC all-reduce with the norm in its epilogue)
    registers over it per dispatch key, as for every other op."""
    reduced = torch.ops.graphinfer.all_reduce(x, group_name)
    return torch.ops.graphinfer.add_rms_norm(reduced, residual, weight, eps)


@register_fake(all_reduce_add_rms_norm)
def _(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)


@graphinfer_op()
def sequence_parallel_chunk(x: Tensor, world_size: int, group_name: str) -> Tensor:
    """This rank's contiguous part of the rows of x (vLLM's sequence_parallel_chunk): x padded with zero rows to
    a multiple of world_size, then chunk `rank` of world_size -> [ceil(T / world_size), ...]. The rank is the
    process's rank in the group (a host int), so every rank's graph is the same code."""
    rows = -(-x.shape[0] // world_size)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, rows * world_size - x.shape[0]))
    return padded[ps.group_rank(group_name) * rows:][:rows].clone()


@register_fake(sequence_parallel_chunk)
def _(x, world_size, group_name):
    return x.new_empty((-(-x.shape[0] // world_size), *x.shape[1:]))


def _all_to_all(x: Tensor, what: str, group_name: str) -> Tensor:
    out = torch.empty_like(x)
    ps.collective(what, group_name, lambda group: dist.all_to_all_single(out, x, group=group))
    return out


def combine_metadata_size(tokens: int, top_k: int, num_experts: int, ep_size: int) -> int:
    """Length of ep_dispatch's combine_metadata (int32): room for what Ascend MC2's combine takes back from its
    dispatch: expand_idx [Tl*K], ep_recv_counts [E], tp_recv_counts [<= 1] and expand_scales [<= ep*Tl*K] (fp32
    bits). One size for every implementation, so the graph's shapes do not depend on the platform."""
    return tokens * top_k * (1 + ep_size) + num_experts + 1


@graphinfer_op()
def ep_dispatch(hidden: Tensor, topk_ids: Tensor, num_experts: int, ep_size: int,
                group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """Send each routed slot to the EP rank owning its expert (rank r owns experts [r*E/ep, (r+1)*E/ep)).

    hidden [Tl, H], topk_ids [Tl, K] (global ids) -> (recv_hidden [ep*Tl*K, H], recv_ids [ep*Tl*K] int64,
    combine_metadata int32 [combine_metadata_size]). recv_ids are local expert ids, -1 for a zero row; which
    received row holds which slot is the implementation's, and combine_metadata is what its ep_combine needs to
    route the rows back (opaque: zeros here, MC2's routing tensors on npu).

    Here the send buffer is the worst case, [ep, Tl*K, H]: chunk d row j holds flat slot j (token j // K) if its
    expert lives on rank d, else zeros with id -1; one all_to_all with equal splits (and one for the ids).
    So row s*Tl*K + j received here is source rank s's slot j: its local expert id, or -1 and a zero row.
    Static shapes, no sort, no host read: capturable."""
    Tl, K = topk_ids.shape
    per_rank = num_experts // ep_size
    ids = topk_ids.reshape(-1).long()
    owner = ids // per_rank
    mine = owner == torch.arange(ep_size, device=ids.device).unsqueeze(1)  # [ep, Tl*K]
    rows = hidden.unsqueeze(1).expand(Tl, K, hidden.shape[1]).reshape(Tl * K, hidden.shape[1])
    send = torch.where(mine.unsqueeze(-1), rows, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    send_ids = torch.where(mine, ids - owner * per_rank, -1)
    recv = _all_to_all(send, "ep_dispatch", group_name)
    recv_ids = _all_to_all(send_ids, "ep_dispatch(ids)", group_name)
    meta = torch.zeros(combine_metadata_size(Tl, K, num_experts, ep_size), dtype=torch.int32, device=ids.device)
    return recv.view(-1, hidden.shape[1]), recv_ids.view(-1), meta


@register_fake(ep_dispatch)
def _(hidden, topk_ids, num_experts, ep_size, group_name):
    Tl, K = topk_ids.shape
    n = ep_size * Tl * K
    return (hidden.new_empty((n, hidden.shape[1])), topk_ids.new_empty(n, dtype=torch.int64),
            topk_ids.new_empty(combine_metadata_size(Tl, K, num_experts, ep_size), dtype=torch.int32))


@graphinfer_op()
def ep_combine(expert_rows: Tensor, topk_ids: Tensor, topk_weights: Tensor, combine_metadata: Tensor,
               num_experts: int, ep_size: int, group_name: str) -> Tensor:
    """ep_dispatch's way back: expert_rows [ep*Tl*K, H] (this rank's expert output for each row ep_dispatch gave
    it, zero for its -1 rows), with the dispatch's topk_ids [Tl, K] and combine_metadata -> out [Tl, H],
    out[t] = sum_k topk_weights[t, k] * the output row of slot t*K + k.

    Here (row s*Tl*K + j: rank s's slot j, zero where slot j is not this rank's): one all_to_all, then the ep
    partial rows of each slot summed (exactly one is non-zero, so the sum is that row) and weighted in fp32, as
    moe_combine does; the result in expert_rows' dtype. topk_ids and combine_metadata are not needed."""
    Tl, K = topk_weights.shape
    back = _all_to_all(expert_rows.reshape(ep_size, Tl * K, -1), "ep_combine", group_name)
    rows = back.float().sum(dim=0).view(Tl, K, -1)
    return (rows * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(expert_rows.dtype)


@register_fake(ep_combine)
def _(expert_rows, topk_ids, topk_weights, combine_metadata, num_experts, ep_size, group_name):
    return expert_rows.new_empty((topk_weights.shape[0], expert_rows.shape[1]))


@graphinfer_op()
def send(x: Tensor, dst_stage: int, group_name: str) -> Tensor:
    """Pipeline parallel: x to this rank's partner in pipeline stage dst_stage (the next stage), point to point on
    the group (gloo / NCCL / HCCL), without waiting for the receive; returns a copy of x (the stage graph's output,
    so the node stays live and the passes' checks compare what a stage sends). Alone (ps.pipeline_local), nothing
    is sent."""
    if not ps.p2p_local():
        ps.isend(x, dst_stage, "the hidden state", group_name)
    return x.clone()


@register_fake(send)
def _(x, dst_stage, group_name):
    return torch.empty_like(x)


@graphinfer_op()
def recv(like: Tensor, hidden_size: int, dtype: torch.dtype, src_stage: int, group_name: str) -> Tensor:
    """Pipeline parallel: the [T, hidden_size] tensor this rank's partner in stage src_stage sends (T = like's rows:
    the step's token count), waiting at most the distributed timeout. Alone (ps.pipeline_local): seeded random
    values, the same for every call of one shape, so a pass's check compares its graphs on equal inputs."""
    shape = (like.shape[0], hidden_size)
    if ps.p2p_local():
        g = torch.Generator().manual_seed(like.shape[0])
        return torch.randn(shape, generator=g).to(device=like.device, dtype=dtype)
    return ps.recv(shape, dtype, like.device, src_stage, "the hidden state", group_name)


@register_fake(recv)
def _(like, hidden_size, dtype, src_stage, group_name):
    return like.new_empty((like.shape[0], hidden_size), dtype=dtype)


def tensor_model_parallel_all_reduce(x: Tensor) -> Tensor:
    """x summed over the TP group; x itself at tp 1 (no node in the graph)."""
    return all_reduce(x, ps.TP_GROUP) if ps.tp_size() > 1 else x


def tensor_model_parallel_all_gather(x: Tensor, dim: int = -1) -> Tensor:
    return all_gather(x, dim, ps.tp_size(), ps.TP_GROUP) if ps.tp_size() > 1 else x
