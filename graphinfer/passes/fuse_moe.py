"""fuse_moe: the naive MoE chain (softmax routing, dispatch, grouped expert MLP, combine) becomes one fused_moe.

Matches, walking back from each graphinfer::moe_combine(expert_out, inverse_perm, weights):
- expert_out = moe_grouped_mlp(d[0], d[1], w13, w2) and inverse_perm = d[2], where d = moe_dispatch(hidden,
  ids, E) and E is w13's expert count when w13 is a parameter;
- ids = topk(probs, k)[1] and weights = [cast](renorm?(topk(probs, k)[0])) for the same topk (k an int,
  over the last dim, largest), where renorm is `w / w.sum(-1, keepdim=True)` and the cast is `.to(dtype)` to
  hidden's or router_logits' dtype (a router Linear shares the model dtype) or to the parameters' dtype;
  with no cast the parameters must be fp32;
- probs = softmax(router_logits, dim=-1) computed in fp32 (dtype=torch.float32, or on `.float()` logits).
Every node of the chain but router_logits and hidden must be used only inside the chain.
Produces: graphinfer::fused_moe(hidden, router_logits, w13, w2, k, renormalize) in place of the combine;
the chain's nodes are erased. Shared experts (Qwen2-MoE style) sit outside the chain, added to the
combine's output, so only the routed part is fused and they stay as they are.
Declines (reason in the report): a router that is not softmax (sigmoid scores, grouped top-k), weights
that pass through anything else (a routed scaling factor, an epsilon in the renormalisation, a cast
before the renormalisation), a softmax not in fp32, expert ids that are not the top-k's (e.g. shared
experts appended to the routed ones), chain values used elsewhere, an expert count that disagrees with w13.
"""
import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.utils import GRAPHINFER, is_op

_SOFTMAX = (F.softmax, torch.softmax)
_LAST = (-1, 1)  # router tensors are [T, E] / [T, K]: dim 1 is the last


def _arg(node: fx.Node, i: int, name: str, default=None):
    """Argument i / `name` of a call (call_method counts self as argument 0, like the function form)."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _calls(node, functions: tuple, method: str) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in functions)
                                          or (node.op == "call_method" and node.target == method))


def _getitem(node, i: int):
    """x if node is x[i], else None."""
    if isinstance(node, fx.Node) and is_op(node, operator.getitem) and node.args[1] == i:
        return node.args[0]
    return None


def _attr(gm: fx.GraphModule, node):
    """The tensor a get_attr node reads (a parameter), else None."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    parent, _, name = node.target.rpartition(".")
    return getattr(gm.get_submodule(parent), name)


def _describe(node) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


class FuseMoEPass(Pass):
    name = "fuse_moe"
    description = "softmax/top-k routing + moe_dispatch/grouped_mlp/combine -> fused_moe"

    def _match(self, gm: fx.GraphModule, combine: fx.Node):
        """(fused_moe args, chain nodes to erase) or None, after declining with the reason."""
        where = combine.name
        expert_out, inverse_perm, weights = combine.args
        if not is_op(expert_out, GRAPHINFER.moe_grouped_mlp.default):
            return self.decline(f"{where}: expert rows do not come from moe_grouped_mlp")
        sorted_hidden, offsets, w13, w2 = expert_out.args
        dispatch = _getitem(sorted_hidden, 0)
        if not (is_op(dispatch, GRAPHINFER.moe_dispatch.default) and _getitem(offsets, 1) is dispatch
                and _getitem(inverse_perm, 2) is dispatch):
            return self.decline(f"{where}: rows, offsets and inverse_perm are not one moe_dispatch's")
        hidden, ids, num_experts = dispatch.args
        w13_tensor = _attr(gm, w13)
        w13_dtype = None if w13_tensor is None else w13_tensor.dtype
        if w13_tensor is not None and w13_tensor.shape[0] != num_experts:
            return self.decline(f"{where}: moe_dispatch has {num_experts} experts, w13 has {w13_tensor.shape[0]}")

        topk = _getitem(ids, 1)
        if not _calls(topk, (torch.topk,), "topk"):
            return self.decline(f"{where}: expert ids come from {_describe(ids)}, not the router's top-k")
        top_k = _arg(topk, 1, "k")
        if not isinstance(top_k, int) or _arg(topk, 2, "dim", -1) not in _LAST or not _arg(topk, 3, "largest", True):
            return self.decline(f"{where}: top-k is not a constant k over the last dim, largest first")

        chain = [combine, expert_out, sorted_hidden, offsets, inverse_perm, dispatch, ids, topk]
        w = weights
        cast = None
        if _calls(w, (), "to"):
            cast, w = _arg(w, 1, "dtype"), w.args[0]
            chain.append(weights)
        renormalize = False
        if _calls(w, (operator.truediv, torch.div), "div") and len(w.args) == 2 and not w.kwargs:
            total = w.args[1]
            if (_calls(total, (torch.sum,), "sum") and total.args[0] is w.args[0]
                    and _arg(total, 1, "dim") in _LAST and _arg(total, 2, "keepdim") is True):
                chain += [w, total]
                renormalize, w = True, w.args[0]
        if _getitem(w, 0) is not topk:
            return self.decline(f"{where}: routing weights pass through {_describe(w)}, which fused_moe cannot "
                                f"express (only top-k, renormalisation and a cast to the model dtype)")
        chain.append(w)

        probs = topk.args[0]
        if not _calls(probs, _SOFTMAX, "softmax"):
            return self.decline(f"{where}: router scores come from {_describe(probs)}, not softmax "
                                f"(fused_moe routes by softmax top-k)")
        if _arg(probs, 1, "dim") not in _LAST:
            return self.decline(f"{where}: softmax is not over the experts (last dim)")
        chain.append(probs)
        router_logits = probs.args[0]
        fp32 = _arg(probs, 3 if probs.target is F.softmax else 2, "dtype") is torch.float32
        if not fp32 and (_calls(router_logits, (), "float") or (
                _calls(router_logits, (), "to") and _arg(router_logits, 1, "dtype") is torch.float32)):
            router_logits, fp32 = router_logits.args[0], True  # fused_moe upcasts the logits itself
        if not fp32:
            return self.decline(f"{where}: softmax is not computed in fp32, fused_moe's is")

        if cast is None:
            if w13_dtype is not torch.float32:
                return self.decline(f"{where}: routing weights are not cast to the model dtype")
        elif isinstance(cast, torch.dtype):
            if cast != w13_dtype:
                return self.decline(f"{where}: routing weights are cast to {cast}, not the parameters' dtype")
        elif not (isinstance(cast, fx.Node) and cast.op == "call_function" and cast.target is getattr
                  and cast.args[0] in (hidden, router_logits) and cast.args[1] == "dtype"):
            return self.decline(f"{where}: routing weights are cast to {_describe(cast)}, not the model dtype")

        inside = set(chain)
        for node in chain[1:]:  # the combine's own users are what the fused op takes over
            if any(user not in inside for user in node.users):
                return self.decline(f"{where}: {node.name} is used outside the MoE chain")
        return (hidden, router_logits, w13, w2, top_k, renormalize), chain

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        for combine in list(g.nodes):
            if not is_op(combine, GRAPHINFER.moe_combine.default) or (found := self._match(gm, combine)) is None:
                continue
            args, chain = found
            with g.inserting_before(combine):  # every input is defined before the combine
                fused = g.call_function(GRAPHINFER.fused_moe.default, args)
            combine.replace_all_uses_with(fused)
            dead = set(chain)
            for node in reversed(list(g.nodes)):  # users before what they use
                if node in dead:
                    inputs = node.all_input_nodes
                    g.erase_node(node)
                    for arg in inputs:  # pure reads left unused: `router_logits.dtype`, `router_logits.float()`
                        if not arg.users and (_calls(arg, (getattr,), "float") or _calls(arg, (), "to")):
                            dead.add(arg)
            matches += 1
        return matches
