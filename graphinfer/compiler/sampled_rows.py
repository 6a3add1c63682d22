"""A lowering step: the forward that runs the layers after the last attention only for the rows whose logits are
sampled.

After a model's last attention nothing mixes tokens: o_proj, the last MLP, the norms and the residual adds compute
each token's row from that token's row alone. A prefill samples one row per sequence, so those layers' work for the
other rows is thrown away by the runner's `hidden[logits_indices]` (a 162-token prompt on SmolLM2: the last layer's
o_proj, MLP and norms for 161 rows, ~3 % of the prefill's FLOPs). The copy built here takes the rows as a fourth input,
`logits_indices`, and selects them where the tail's inputs enter it (the attention's output and the residual stream),
so the tail runs on those rows only and the graph returns [rows, hidden].

Only a tail of ops known to be row-wise is cut: linear leaves (F.linear, cpu PackedLinear), graphinfer ops registered
`row_wise` (norms, activations, quantized linears and their activation quantization, all-reduce), getitem of their
tuples, elementwise add / mul. Anything else there (an MoE layer, whose expert-load counts see every row; LoRA's
per-token adapter indices; a reshape over the token count) keeps the whole forward (the reason is logged). The runner
uses the copy only where a step needs no other row's hidden state (no drafter, no prompt logprobs, no pipeline stage
after it): runtime/worker/model_runner.py.
"""
import operator

import torch
from torch import fx, nn

from graphinfer.compiler.trace import is_leaf_layer, node_target_name

ATTENTION_OPS = ("paged_attention", "mla_attention", "mla_latent_attention", "mla_attention_auto")
_ELEMENTWISE = (operator.add, operator.mul, torch.add, torch.mul, torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)
_RESHAPES = ("view", "reshape", "flatten")


def _graphinfer_op(node: fx.Node) -> str | None:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace == "graphinfer":
        return t._schema.name.partition("::")[2]
    return None


def _what(gm: fx.GraphModule, node: fx.Node) -> str:
    return type(gm.get_submodule(node.target)).__name__ if node.op == "call_module" else node_target_name(node)


def _row_wise(gm: fx.GraphModule, node: fx.Node) -> bool:
    """node computes each row of its outputs from the same rows of its inputs."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        return getattr(mod, "row_wise", False) or (isinstance(mod, nn.Linear) and is_leaf_layer(mod))
    if node.op != "call_function":
        return False
    return getattr(node.target, "row_wise", False) or node.target in _ELEMENTWISE


def _row_producer(gm: fx.GraphModule, node: fx.Node) -> bool:
    """node (before the tail) holds one row per token: a row-wise op's output or an element of one's tuple."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return _row_wise(gm, node)


def sampled_rows_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule | None, str]:
    """(a copy of gm taking `logits_indices` [rows] int64 after its inputs and returning only those rows, why), or
    (None, why not). gm itself is untouched; the copy shares its modules and weights."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    if not isinstance(output.args[0], fx.Node):
        return None, "the graph returns more than the hidden states"
    attention = [n for n in nodes if _graphinfer_op(n) in ATTENTION_OPS]
    if not attention:
        return None, "the graph has no attention op"
    cut = attention[-1]
    while len(cut.users) == 1 and (user := next(iter(cut.users))).op == "call_method" and user.target in _RESHAPES:
        cut = user  # the attention's output reshaped to [tokens, hidden]: selected after it
    tail = [n for n in nodes[nodes.index(cut) + 1:-1] if n.op != "get_attr"]
    in_tail, entering = set(tail), []
    for node in tail:
        tuple_item = node.op == "call_function" and node.target is operator.getitem and node.args[0] in in_tail
        if not (tuple_item or _row_wise(gm, node)):
            return None, f"{node.name} ({_what(gm, node)}) after the last attention is not known to be row-wise"
        for arg in node.all_input_nodes:
            if arg in in_tail or arg.op == "get_attr" or arg in entering:
                continue
            if arg is not cut and not _row_producer(gm, arg):
                return None, (f"{node.name} after the last attention reads {arg.name} ({_what(gm, arg)}), not known "
                              f"to hold a row per token")
            entering.append(arg)
    if not any(n.op == "call_module" or _graphinfer_op(n) for n in tail):
        return None, "nothing runs after the last attention"
    # cut a copy (gm untouched), wrapped in a GraphModule once cut: one code generation
    graph, copied = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copied))
    cut, tail, entering = copied[cut], [copied[n] for n in tail], [copied[n] for n in entering]
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        rows = graph.placeholder("logits_indices")
    for value in entering:
        with graph.inserting_after(cut):
            selected = graph.call_function(torch.index_select, (value, 0, rows))
        for node in tail:
            node.replace_input_with(value, selected)
    graph.lint()
    why = f"{len(tail)} nodes after the last attention run on the sampled rows only"
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__), why
