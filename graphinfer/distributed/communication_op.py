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


@graphinfer_op()
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


@graphinfer_op()
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


def tensor_model_parallel_all_reduce(x: Tensor) -> Tensor:
    """x summed over the TP group; x itself at tp 1 (no node in the graph)."""
    return all_reduce(x, ps.TP_GROUP) if ps.tp_size() > 1 else x


def tensor_model_parallel_all_gather(x: Tensor, dim: int = -1) -> Tensor:
    return all_gather(x, dim, ps.tp_size(), ps.TP_GROUP) if ps.tp_size() > 1 else x
