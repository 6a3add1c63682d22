"""cleanup: dead-code elimination, de-duplication of pure reads, and removal of no-op views.

Matches (each counts once):
- a repeated pure read: a parameter / buffer (get_attr), `x.shape`, `md.field` and `getitem` on them,
  computed again with the same inputs (every layer re-reads the attention metadata and the token count);
- a view/reshape of a view/reshape used only there (the inner one is skipped: view(view(x, a), b) = view(x, b));
- a view/reshape of a view/reshape with the same sizes (a no-op);
- a dead node (DCE; ops that mutate their inputs, like the KV-cache write, are never dead).
Submodules no graph node uses any more (projections replaced by fused ones) are dropped from the module.
"""
import operator

from torch import fx

from graphinfer.passes.base import Pass

_VIEWS = ("view", "reshape")


def _is_view(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in _VIEWS


class CleanupPass(Pass):
    name = "cleanup"
    description = "dead code, repeated shape/metadata reads, chained and no-op views"

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        seen: dict[tuple, fx.Node] = {}
        for node in list(g.nodes):
            if node.op == "get_attr":  # the same parameter / buffer read twice
                key = ("get_attr", node.target)
                if key in seen:
                    node.replace_all_uses_with(seen[key])
                    g.erase_node(node)
                    matches += 1
                else:
                    seen[key] = node
            elif node.op == "call_function" and node.target in (getattr, operator.getitem) and \
                    isinstance(node.args[0], fx.Node) and (node.target is getattr or self._pure(node.args[0])):
                key = (node.target, node.args)
                if key in seen:
                    node.replace_all_uses_with(seen[key])
                    g.erase_node(node)
                    matches += 1
                else:
                    seen[key] = node
            elif _is_view(node) and _is_view(node.args[0]):
                inner = node.args[0]
                if inner.args[1:] == node.args[1:]:  # same sizes again: a no-op
                    node.replace_all_uses_with(inner)
                    g.erase_node(node)
                    matches += 1
                elif len(inner.users) == 1:  # reshape: the merged view may not be expressible as a view
                    with g.inserting_before(node):
                        merged = g.call_method("reshape", (inner.args[0], *node.args[1:]))
                    node.replace_all_uses_with(merged)
                    g.erase_node(node)
                    g.erase_node(inner)
                    matches += 1
        before = len(g.nodes)
        g.eliminate_dead_code()
        matches += before - len(g.nodes)
        gm.delete_all_unused_submodules()
        return matches

    @staticmethod
    def _pure(node: fx.Node) -> bool:
        """A getitem is de-duplicated only on shape / metadata reads, never on op outputs."""
        return node.op == "call_function" and node.target in (getattr, operator.getitem) or node.op == "placeholder"
