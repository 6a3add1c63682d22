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
from graphinfer.passes.match import is_method


def _is_view(node) -> bool:
    return is_method(node, "view", "reshape")


def _pure_read_key(node: fx.Node) -> tuple | None:
    """Equal for nodes that read the same thing: a parameter / buffer, `x.shape` / `md.field`, or a getitem
    on such a read or an input. None for anything else (a getitem on an op's output is never merged)."""
    if node.op == "get_attr":
        return ("get_attr", node.target)
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if node.target is getattr or (node.target is operator.getitem and (
            src.op == "placeholder" or (src.op == "call_function" and src.target in (getattr, operator.getitem)))):
        key = (node.target, _hashable(node.args))
        try:
            hash(key)
        except TypeError:  # an argument we cannot compare cheaply: never merged
            return None
        return key
    return None


def _hashable(a):
    """Arguments as a hashable key: slices (unhashable before Python 3.12), lists and dicts made tuples."""
    if isinstance(a, slice):
        return ("slice", _hashable(a.start), _hashable(a.stop), _hashable(a.step))
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, *(_hashable(x) for x in a))
    if isinstance(a, dict):
        return ("dict", *((k, _hashable(v)) for k, v in a.items()))
    return a


def _merge_views(g: fx.Graph, node: fx.Node) -> int:
    """view(view(x, a), a) -> view(x, a); view(view(x, a), b) -> reshape(x, b) when the inner has no other use."""
    inner = node.args[0]
    if inner.args[1:] == node.args[1:]:
        node.replace_all_uses_with(inner)
        g.erase_node(node)
        return 1
    if len(inner.users) == 1:  # reshape: the merged view may not be expressible as a view
        with g.inserting_before(node):
            merged = g.call_method("reshape", (inner.args[0], *node.args[1:]))
        node.replace_all_uses_with(merged)
        g.erase_node(node)
        g.erase_node(inner)
        return 1
    return 0


class CleanupPass(Pass):
    name = "cleanup"
    description = "dead code, repeated shape/metadata reads, chained and no-op views"

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        seen: dict[tuple, fx.Node] = {}
        for node in list(g.nodes):
            if (key := _pure_read_key(node)) is not None:
                if key in seen:
                    node.replace_all_uses_with(seen[key])
                    g.erase_node(node)
                    matches += 1
                else:
                    seen[key] = node
            elif _is_view(node) and _is_view(node.args[0]):
                matches += _merge_views(g, node)
        before = len(g.nodes)
        g.eliminate_dead_code()
        matches += before - len(g.nodes)
        gm.delete_all_unused_submodules()
        return matches
