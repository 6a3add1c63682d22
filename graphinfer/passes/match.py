"""The matcher toolkit: small helpers for reading and rewriting torch.fx graphs in a pass.

    from graphinfer.passes.match import is_op, is_call, arg, getitem_of, single_use, replace_pattern, ...

Matching
- is_op(node, *ops): node is a call_function of one of `ops`: a graphinfer / aten op given as its overload
  packet (`torch.ops.graphinfer.rms_norm`) or an overload (`.default`), matched whichever of the two the
  graph holds, or any Python callable (`operator.add`, `F.silu`). Anything that is not an fx.Node is no match.
- is_method(node, *names): a call_method such as `x.view(...)`;  is_call(node, *targets): either
  (strings name methods, everything else goes to is_op), e.g. `is_call(n, torch.topk, "topk")`.
- arg(node, i, name, default): argument i, or keyword `name` (a method call counts self as argument 0).
- getitem_of(node, i): x if node is `x[i]`;  get_param(gm, node): the tensor a get_attr node reads.
- target_name(node): a short readable name of what a node calls (for decline messages).

Users
- single_use(node): exactly one user;  used_only_by(node, nodes): every user is one of `nodes`.
- is_view(node) / through_views(node): views (view, reshape, contiguous, ...) and the value before them;
  walk_users(node): the users of node's value, following views (or any `through` predicate) forward.

Rewriting
- hoist_inputs(graph): moves nodes up so each comes after its inputs (after inserting a node where one of
  its inputs is not defined yet); never moves a node with side effects.
- replace_pattern(gm, pattern, replacement): a thin wrapper over torch.fx.subgraph_rewriter for
  pattern/replacement function pairs; returns the number of matches.
"""
import operator
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import fx
from torch.fx import subgraph_rewriter

VIEW_METHODS = ("view", "reshape", "contiguous", "view_as", "flatten", "unflatten", "squeeze", "unsqueeze")
VIEW_FUNCTIONS = (torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze)


def _op_key(op) -> tuple[str, str | None] | None:
    """(qualified name, overload name or None for a packet) of a torch op, else None."""
    if isinstance(op, torch._ops.OpOverload):
        return op._overloadpacket._qualified_op_name, op._overloadname
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name, None
    return None


def _same_op(target, op) -> bool:
    if target is op:
        return True
    t, o = _op_key(target), _op_key(op)
    if t is None or o is None or t[0] != o[0]:
        return False
    # A packet matches every overload; a packet in the graph resolves to its default overload.
    return o[1] is None or t[1] == o[1] or (t[1] is None and o[1] == "default")


def is_op(node, *ops) -> bool:
    """node calls one of `ops` (torch ops as packet or overload, or Python callables)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and any(_same_op(node.target, op) for op in ops)


def is_method(node, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def is_call(node, *targets) -> bool:
    """is_method for the strings in targets, is_op for the rest: `is_call(n, F.softmax, torch.softmax, "softmax")`."""
    names = [t for t in targets if isinstance(t, str)]
    ops = [t for t in targets if not isinstance(t, str)]
    return (bool(names) and is_method(node, *names)) or (bool(ops) and is_op(node, *ops))


def arg(node: fx.Node, i: int, name: str, default=None):
    """Argument i / `name` of a call (call_method counts self as argument 0, like the function form)."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def getitem_of(node, i: int):
    """x if node is x[i], else None."""
    if is_op(node, operator.getitem) and node.args[1] == i:
        return node.args[0]
    return None


def get_param(gm: fx.GraphModule, node):
    """The tensor a get_attr node reads (a parameter or buffer), else None."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    parent, _, name = node.target.rpartition(".")
    return getattr(gm.get_submodule(parent), name)


def target_name(node) -> str:
    """'graphinfer::rms_norm', 'add', 'view', 'model.layers.0.mlp.gate_proj' or, for a constant, its repr."""
    if not isinstance(node, fx.Node):
        return repr(node)
    t = node.target
    if (key := _op_key(t)) is not None:
        return key[0]
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def single_use(node: fx.Node) -> bool:
    return len(node.users) == 1


def used_only_by(node: fx.Node, nodes: Iterable[fx.Node]) -> bool:
    allowed = set(nodes)
    return all(user in allowed for user in node.users)


def is_view(node) -> bool:
    """A call that only reshapes its first argument (view, reshape, contiguous, flatten, squeeze, ...)."""
    return is_method(node, *VIEW_METHODS) or is_op(node, *VIEW_FUNCTIONS)


def through_views(node):
    """The value a chain of views starts from: through_views(x.view(a).reshape(b)) is x."""
    while is_view(node):
        node = node.args[0]
    return node


def walk_users(node: fx.Node, through: Callable[[fx.Node], bool] = is_view, depth: int = 8) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(user, value) for every user of node's value, following `through` nodes forward (views by default) up to
    `depth` steps; `value` is the node the user reads (node itself or one of the nodes passed through).
    The `through` nodes themselves are yielded too, before what follows them."""
    for user in list(node.users):
        yield user, node
        if depth and through(user) and user.args and user.args[0] is node:
            yield from walk_users(user, through, depth - 1)


def hoist_inputs(graph: fx.Graph) -> int:
    """Move nodes up so that every node comes after its inputs; returns how many moved.

    A stable order: a node used before it is defined moves (with any of its own inputs that are also late) to
    just before its first use, and nothing else moves. Moving a definition up never breaks a use, so this
    is safe for pure nodes (parameter reads, views, arithmetic); a node with side effects (a cache write) is
    never moved: that raises ValueError, as the rewrite that needs it is wrong."""
    seen: set[fx.Node] = set()
    placing: set[fx.Node] = set()
    moved = 0

    def place(node: fx.Node, before: fx.Node) -> None:
        nonlocal moved
        if node in placing:
            raise ValueError(f"{node.name} depends on itself through its inputs (a cycle): the rewrite is wrong")
        if node.op == "placeholder" or node.is_impure():
            raise ValueError(f"{node.name} ({target_name(node)}) is used by {before.name} before it is defined, and "
                             f"it cannot move up (it has side effects or is an input); insert the new node later")
        placing.add(node)
        before.prepend(node)
        moved += 1
        for inp in node.all_input_nodes:
            if inp not in seen:
                place(inp, node)
        placing.discard(node)
        seen.add(node)

    for node in list(graph.nodes):
        if node in seen:
            continue
        for inp in node.all_input_nodes:
            if inp not in seen:
                place(inp, node)
        seen.add(node)
    return moved


def canonicalize_overloads(graph: fx.Graph) -> int:
    """Rewrite calls of an op packet (`torch.ops.ns.op`) that has only a default overload to `.default`, the
    form models trace to; returns how many changed."""
    changed = 0
    for node in graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, torch._ops.OpOverloadPacket) and t.overloads() == ["default"]:
            node.target = t.default
            changed += 1
    return changed


def replace_pattern(gm: fx.GraphModule, pattern: Callable, replacement: Callable, *,
                    match_filters: list[Callable] | None = None, ignore_literals: bool = False) -> int:
    """Replace every non-overlapping match of `pattern` in gm by `replacement` (two functions with the same
    arguments, traced by torch.fx; see torch.fx.subgraph_rewriter); returns the number of matches.

    On top of torch's rewriter: op packets in the graph are matched as their default overload, and nodes the
    replacement reads (e.g. a parameter read that came after the pattern's first node) are moved up where
    needed (hoist_inputs). A pattern returning several values (a tuple) matches a subgraph whose inner values
    are also used outside it; the replacement must return as many. match_filters: functions
    (match, original_graph, pattern_graph) -> bool that can veto a match. ignore_literals: constants in the
    pattern (an eps) match any constant, and the matched one is kept."""
    canonicalize_overloads(gm.graph)
    matches = subgraph_rewriter.replace_pattern_with_filters(
        gm, pattern, replacement, match_filters=list(match_filters or []), ignore_literals=ignore_literals)
    hoist_inputs(gm.graph)
    return len(matches)
