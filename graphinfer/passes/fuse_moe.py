"""fuse_moe: the naive MoE chain (softmax routing, dispatch, grouped expert MLP, combine) becomes one fused_moe.

Matches, walking back from each graphinfer::moe_combine(expert_out, inverse_perm, weights):
- expert_out = moe_grouped_mlp(d[0], d[1], w13, w2) and inverse_perm = d[2], where d = moe_dispatch(hidden,
  ids, E) and E is w13's expert count when w13 is a parameter;
- ids = topk(probs, k)[1] and weights = [cast](renorm?(topk(probs, k)[0])) for the same topk (k an int,
  over the last dim, largest), where renorm is `w / w.sum(-1, keepdim=True)` and the cast is `.to(dtype)` to
  hidden's or router_logits' dtype (a router Linear shares the model dtype) or to the parameters' dtype;
  with no cast the parameters must be fp32;
- probs = softmax(router_logits, dim=-1) computed in fp32 (dtype=torch.float32, or on `.float()` logits).
Every node of the chain but router_logits and hidden must be used only inside the chain, except the expert ids,
which graphinfer::moe_count_experts (the expert-load statistic) may read too.
Produces: graphinfer::fused_moe(hidden, router_logits, w13, w2, k, renormalize) in place of the combine;
the chain's nodes are erased, but for the routing (softmax, top-k, ids) that a moe_count_experts still reads:
fused_moe routes again inside (a softmax and a top-k over [T, E], small beside the experts). Shared experts (Qwen2-MoE style) sit outside the chain, added to the
combine's output, so only the routed part is fused and they stay as they are.
Expert parallel's local experts (models/parallel_layers.MoEExperts with EP on): a chain whose ids come from
graphinfer::ep_dispatch (through elementwise / view ops: the clamp of its -1 ids) has its routing on other
ranks, so it becomes graphinfer::fused_experts(hidden, ids, weights, w13, w2) (the chain as one op, weights
the combine's); ep_dispatch / ep_combine stay separate nodes.
Routing fused_moe does not express (sigmoid scores, DeepSeek's grouped top-k with a correction bias, weights that
pass through anything else: a routed scaling factor, an epsilon in the renormalisation, a cast before the
renormalisation; a softmax not in fp32; expert ids that are not the top-k's, e.g. shared experts appended; routing
values used elsewhere) stays as it is, and the experts alone become graphinfer::fused_experts(hidden, ids, weights,
w13, w2), the report saying why the routing was left.
Declines (reason in the report): expert-chain values used elsewhere, an expert count that disagrees with w13.
"""
import operator

import torch
import torch.nn.functional as F
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, get_param, getitem_of, is_call, is_op, target_name, used_only_by
from graphinfer.passes.utils import GRAPHINFER

_SOFTMAX = (F.softmax, torch.softmax, "softmax")
_LAST = (-1, 1)  # router tensors are [T, E] / [T, K]: dim 1 is the last
_ID_STEPS = ("clamp", "unsqueeze", "view", "reshape", "to", "long")  # what may sit between ep_dispatch and ids


def _from_ep_dispatch(ids: fx.Node) -> bool:
    """ids are ep_dispatch's received expert ids, through a few single-input steps (clamp, unsqueeze, ...)."""
    node = ids
    while is_call(node, *_ID_STEPS):
        node = node.args[0]
    return is_op(getitem_of(node, 1), GRAPHINFER.ep_dispatch.default)


class FuseMoEPass(Pass):
    name = "fuse_moe"
    description = ("softmax/top-k routing + moe_dispatch/grouped_mlp/combine -> fused_moe (expert parallel's local "
                   "experts -> fused_experts)")

    def _match(self, gm: fx.GraphModule, combine: fx.Node):
        """(fused op, its args, chain nodes to erase) or None, after declining with the reason."""
        where = combine.name
        expert_out, inverse_perm, weights = combine.args
        if not is_op(expert_out, GRAPHINFER.moe_grouped_mlp.default):
            return self.decline(f"{where}: expert rows do not come from moe_grouped_mlp")
        sorted_hidden, offsets, w13, w2 = expert_out.args
        dispatch = getitem_of(sorted_hidden, 0)
        if not (is_op(dispatch, GRAPHINFER.moe_dispatch.default) and getitem_of(offsets, 1) is dispatch
                and getitem_of(inverse_perm, 2) is dispatch):
            return self.decline(f"{where}: rows, offsets and inverse_perm are not one moe_dispatch's")
        hidden, ids, num_experts = dispatch.args
        w13_tensor = get_param(gm, w13)
        w13_dtype = None if w13_tensor is None else w13_tensor.dtype
        if w13_tensor is not None and w13_tensor.shape[0] != num_experts:
            return self.decline(f"{where}: moe_dispatch has {num_experts} experts, w13 has {w13_tensor.shape[0]}")

        chain = [combine, expert_out, sorted_hidden, offsets, inverse_perm, dispatch]
        routing = None if _from_ep_dispatch(ids) else self._routing(ids, weights, hidden, w13_dtype)
        if isinstance(routing, tuple):
            router_logits, top_k, renormalize, routing_chain = routing
            counts = [u for u in ids.users if is_op(u, GRAPHINFER.moe_count_experts.default)]
            full = chain + routing_chain
            inside = set(full) | set(counts)
            if all(used_only_by(node, inside) for node in full[1:]):  # the combine's users: the fused op's
                kept = {ids, routing_chain[1], routing_chain[-1]} if counts else set()  # what the count reads
                return GRAPHINFER.fused_moe.default, (hidden, router_logits, w13, w2, top_k, renormalize), \
                    [n for n in full if n not in kept]
            routing = "a routing value is used outside the MoE chain"
        # Routed elsewhere (expert parallel: on the source ranks) or in a way fused_moe does not express (DeepSeek's
        # grouped sigmoid top-k, scaled weights): the experts alone, with the ids and weights as given.
        if bad := [n.name for n in chain[1:] if not used_only_by(n, set(chain))]:
            return self.decline(f"{where}: {bad[0]} is used outside the MoE chain")
        if routing is not None:
            self.decline(f"{where}: routing left as it is, experts fused ({routing})")
        return GRAPHINFER.fused_experts.default, (hidden, ids, weights, w13, w2), chain

    def _routing(self, ids: fx.Node, weights: fx.Node, hidden: fx.Node, w13_dtype):
        """(router_logits, top_k, renormalize, chain: [ids, topk, ..., probs]) for softmax top-k routing that
        fused_moe expresses, else why not."""
        topk = getitem_of(ids, 1)
        if not is_call(topk, torch.topk, "topk"):
            return f"expert ids come from {target_name(ids)}, not the router's top-k"
        top_k = arg(topk, 1, "k")
        if not isinstance(top_k, int) or arg(topk, 2, "dim", -1) not in _LAST or not arg(topk, 3, "largest", True):
            return "top-k is not a constant k over the last dim, largest first"
        chain = [ids, topk]
        w = weights
        cast = None
        if is_call(w, "to"):
            cast, w = arg(w, 1, "dtype"), w.args[0]
            chain.append(weights)
        renormalize = False
        if is_call(w, operator.truediv, torch.div, "div") and len(w.args) == 2 and not w.kwargs:
            total = w.args[1]
            if (is_call(total, torch.sum, "sum") and total.args[0] is w.args[0]
                    and arg(total, 1, "dim") in _LAST and arg(total, 2, "keepdim") is True):
                chain += [w, total]
                renormalize, w = True, w.args[0]
        if getitem_of(w, 0) is not topk:
            return (f"routing weights pass through {target_name(w)}, which fused_moe cannot express (only top-k, "
                    f"renormalisation and a cast to the model dtype)")
        chain.append(w)
        probs = topk.args[0]
        if not is_call(probs, *_SOFTMAX):
            return f"router scores come from {target_name(probs)}, not softmax (fused_moe routes by softmax top-k)"
        if arg(probs, 1, "dim") not in _LAST:
            return "softmax is not over the experts (last dim)"
        chain.append(probs)
        router_logits = probs.args[0]
        fp32 = arg(probs, 3 if probs.target is F.softmax else 2, "dtype") is torch.float32
        if not fp32 and (is_call(router_logits, "float") or (
                is_call(router_logits, "to") and arg(router_logits, 1, "dtype") is torch.float32)):
            router_logits, fp32 = router_logits.args[0], True  # fused_moe upcasts the logits itself
        if not fp32:
            return "softmax is not computed in fp32, fused_moe's is"
        if cast is None:
            if w13_dtype is not torch.float32:
                return "routing weights are not cast to the model dtype"
        elif isinstance(cast, torch.dtype):
            if cast != w13_dtype:
                return f"routing weights are cast to {cast}, not the parameters' dtype"
        elif not (is_op(cast, getattr) and cast.args[0] in (hidden, router_logits) and cast.args[1] == "dtype"):
            return f"routing weights are cast to {target_name(cast)}, not the model dtype"
        return router_logits, top_k, renormalize, chain

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        for combine in list(g.nodes):
            if not is_op(combine, GRAPHINFER.moe_combine.default) or (found := self._match(gm, combine)) is None:
                continue
            op, args, chain = found
            with g.inserting_before(combine):  # every input is defined before the combine
                fused = g.call_function(op, args)
            combine.replace_all_uses_with(fused)
            dead = set(chain)
            for node in reversed(list(g.nodes)):  # users before what they use
                if node in dead:
                    inputs = node.all_input_nodes
                    g.erase_node(node)
                    for inp in inputs:  # pure reads left unused: `router_logits.dtype`, `router_logits.float()`
                        if not inp.users and is_call(inp, getattr, "float", "to"):
                            dead.add(inp)
            matches += 1
        return matches
