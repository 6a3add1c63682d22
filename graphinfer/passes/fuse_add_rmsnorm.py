"""fuse_add_rmsnorm: a residual add feeding rms_norm becomes one add_rms_norm with two outputs.

Matches: rms_norm(a + b, weight, eps) where a and b are tensors (graph nodes). The sum's other users
(the next residual) read the op's second output, the norm's users its first.
Produces: graphinfer::add_rms_norm(a, b, weight, eps) -> (normed, a + b), placed where the add was.
Declines: when the norm's weight is not a parameter read (get_attr) that can move up to the add.
"""
import operator

from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.utils import GRAPHINFER, is_op


class FuseAddRMSNormPass(Pass):
    name = "fuse_add_rmsnorm"
    description = "rms_norm(x + residual) -> add_rms_norm(x, residual) returning (normed, new residual)"

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        for norm in list(g.nodes):
            if not is_op(norm, GRAPHINFER.rms_norm.default):
                continue
            add, weight, eps = norm.args
            if not (isinstance(add, fx.Node) and is_op(add, operator.add) and len(add.args) == 2
                    and all(isinstance(a, fx.Node) for a in add.args)):
                continue
            if weight.op != "get_attr":
                self.decline(f"{norm.name}: norm weight is computed, not a parameter")
                continue
            add.prepend(weight)  # the fused op sits where the add was, so its weight must be read before
            with g.inserting_before(add):
                fused = g.call_function(GRAPHINFER.add_rms_norm.default, (*add.args, weight, eps))
                normed = g.call_function(operator.getitem, (fused, 0))
                residual = g.call_function(operator.getitem, (fused, 1))
            norm.replace_all_uses_with(normed)
            add.replace_all_uses_with(residual)
            g.erase_node(norm)
            g.erase_node(add)
            matches += 1
        return matches
