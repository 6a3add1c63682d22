"""Linear-layer helpers shared by the passes (the generic matchers are in graphinfer.passes.match)."""
import operator

import torch
from torch import fx, nn

from graphinfer.passes.match import is_op  # noqa: F401  (kept importable from here)
from graphinfer.quantization.linear import QuantizedLinear

GRAPHINFER = torch.ops.graphinfer


def is_linear(gm: fx.GraphModule, node) -> bool:
    """A call of a Linear module: float (nn.Linear) or quantized (not yet lowered to its ops)."""
    return isinstance(node, fx.Node) and node.op == "call_module" and \
        isinstance(gm.get_submodule(node.target), (nn.Linear, QuantizedLinear))


def fuse_linears(gm: fx.GraphModule, nodes: list[fx.Node], new_target: str) -> fx.Node | None:
    """Replace Linear nodes that read the same input by one Linear over the concatenated weights (created
    here, once, at compile time) and return its node; the caller rewires the old nodes' users and erases them.
    Quantized layers fuse into one QuantizedLinear with their packed tensors stacked (same scheme only).
    Returns None (nothing changed) when the layers cannot be concatenated (bias on some only, dtypes or schemes
    differ)."""
    mods = [gm.get_submodule(n.target) for n in nodes]
    if len({type(m) is QuantizedLinear for m in mods}) != 1 or len({m.bias is not None for m in mods}) != 1 \
            or len({m.weight.dtype for m in mods}) != 1 or len({m.in_features for m in mods}) != 1:
        return None
    fused = QuantizedLinear.concat(mods) if isinstance(mods[0], QuantizedLinear) else concat_linears(mods)
    if fused is None:
        return None
    gm.add_submodule(new_target, fused)
    # The recipe lets an artifact rebuild the fused weights from the checkpoint without re-running the pass.
    gm.meta.setdefault("fused_linears", {})[new_target] = [n.target for n in nodes]
    first = nodes[0].args[0]  # the shared input; the earliest of the Linears follows it in graph order
    while first not in nodes:
        first = first.next
    with gm.graph.inserting_before(first):
        return gm.graph.call_module(new_target, (nodes[0].args[0],))


@torch.no_grad()
def concat_linears(mods: list[nn.Linear]) -> nn.Linear:
    """One Linear whose outputs are the given Linears' outputs, concatenated (weights and biases stacked)."""
    w = torch.cat([m.weight for m in mods])
    # built on meta, then given the stacked tensors: no random init of weights about to be replaced
    fused = nn.Linear(w.shape[1], w.shape[0], bias=mods[0].bias is not None, device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=mods[0].weight.requires_grad)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=mods[0].bias.requires_grad)
    return fused


def split_outputs(graph: fx.Graph, node: fx.Node, sizes: list[int]) -> list[fx.Node]:
    """node.split(sizes, dim=-1) and a getitem per piece, inserted right after node."""
    with graph.inserting_after(node):
        split = graph.call_method("split", (node, sizes), {"dim": -1})
    pieces, prev = [], split
    for i in range(len(sizes)):
        with graph.inserting_after(prev):
            prev = graph.call_function(operator.getitem, (split, i))
        pieces.append(prev)
    return pieces


def sibling_submodule(target: str, name: str) -> str:
    """'model.layers.0.self_attn.q_proj', 'qkv_proj' -> 'model.layers.0.self_attn.qkv_proj'."""
    parent = target.rpartition(".")[0]
    return f"{parent}.{name}" if parent else name


def release_fused_sources(model: nn.Module, fused_linears: dict[str, list[str]]) -> None:
    """Delete the projections that fused ones replaced from `model`, so their weights are freed
    (a GraphModule has its own module tree, so the pass's cleanup cannot do this for the model)."""
    for sources in fused_linears.values():
        for target in sources:
            parent, _, name = target.rpartition(".")
            delattr(model.get_submodule(parent), name)
