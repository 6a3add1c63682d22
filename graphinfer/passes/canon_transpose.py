"""canon_transpose: a transpose undone by the same transpose is no transpose. transformers' layers go to
[1, heads, T, head_dim] and graphinfer's attention back to [T, heads, head_dim] (models/transformers.py); once the
pair cancels, what is left between a projection and the attention is views, which the fusion passes follow.

Matches: x.transpose(a, b).transpose(a, b) (either dimension order) where the first transpose has no other user.
Produces: x in the second's place.
"""
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import is_method, single_use


def _dims(node: fx.Node) -> set | None:
    return set(node.args[1:3]) if is_method(node, "transpose") and len(node.args) == 3 else None


class CanonTransposePass(Pass):
    name = "canon_transpose"
    description = "x.transpose(a, b).transpose(a, b) -> x"

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            inner = node.args[0] if node.args else None
            if _dims(node) is None or not isinstance(inner, fx.Node) or _dims(inner) != _dims(node) \
                    or not single_use(inner):
                continue
            node.replace_all_uses_with(inner.args[0])
            matches += 1
        gm.graph.eliminate_dead_code()
        return matches
