"""Pipeline parallel, the compiler side: the traced graph of the whole model cut at decoder-layer boundaries into
this rank's stage (vLLM splits its models by hand in each model file; here the graph is cut once, for every family).

Each node belongs to a position: its decoder layer (from its module path), or, outside the layers, the latest
layer it depends on (-1, before the layers: the embedding; after the last layer: the final norm); nodes computed
from the placeholders alone (no weight) belong anywhere. A stage keeps the nodes of its layers (the first stage
also those before layer 0, the last those after the last layer). A value made by an earlier stage and used here or
later arrives through a graphinfer::recv at the top of the graph; a value this stage holds that a later stage uses
leaves through a graphinfer::send at its end, which is the stage graph's output (the last stage returns the model's
output). For the Llama / Qwen / MoE families that is one tensor, the hidden state [T, hidden]. The cut runs before
the passes, so they, the lowering, the splitting and the capture see an ordinary graph, with the point-to-point ops
as opaque nodes as the collectives are.
"""
from torch import fx

from graphinfer.distributed import parallel_state as ps
from graphinfer.distributed.communication_op import recv, send
from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.pipeline_stage import layer_index, stage_of_layer

_FREE = None  # placeholder-only values: every stage computes its own


def _path(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr"):
        return node.target
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _positions(gm: fx.GraphModule) -> dict:
    """node -> its decoder layer, -1 before the layers, or _FREE; nodes outside any layer take the latest layer
    they depend on (the final norm: the last layer's)."""
    pos = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = layer_index(_path(node))
        if layer is None:
            deps = [pos[a] for a in node.all_input_nodes if a in pos and pos[a] is not _FREE]
            weighted = node.op in ("call_module", "get_attr")
            layer = max(deps) if deps else (-1 if weighted else _FREE)
        pos[node] = layer
    return pos


def cut_stage(gm: fx.GraphModule, num_layers: int, hidden_size: int, dtype) -> fx.GraphModule:
    """This rank's stage of gm (ps.pp_rank() of ps.pp_size()), a new GraphModule over gm's modules."""
    stage, last = ps.pp_rank(), ps.pp_size() - 1
    pos = _positions(gm)

    def stage_of(node: fx.Node):
        if node.op == "output":
            return last
        p = pos.get(node)
        if p is _FREE or node.op == "get_attr":
            return _FREE
        return 0 if p < 0 else stage_of_layer(num_layers, p)

    def crossing(boundary: int) -> list[fx.Node]:
        """Values made before stage `boundary` and used from it on."""
        return [n for n in gm.graph.nodes if n in pos and stage_of(n) is not _FREE and stage_of(n) < boundary
                and any(stage_of(u) is not _FREE and stage_of(u) >= boundary for u in n.users)]

    incoming = crossing(stage) if stage > 0 else []
    outgoing = crossing(stage + 1) if stage < last else []
    graph, env = fx.Graph(), {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = graph.node_copy(node, env.__getitem__)
    for node in incoming:  # at the top, in the order the previous stage sends them
        env[node] = graph.call_function(recv, (env[placeholders[0]], hidden_size, dtype, stage - 1, ps.PP_GROUP))
    for node in gm.graph.nodes:
        if node in env or node.op == "output":
            continue
        s = stage_of(node)
        if s is _FREE or s == stage:
            env[node] = graph.node_copy(node, env.__getitem__)
    if stage == last:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        graph.node_copy(out, env.__getitem__)
    else:
        sent = [graph.call_function(send, (env[n], stage + 1, ps.PP_GROUP)) for n in outgoing]
        graph.output(sent[0] if len(sent) == 1 else tuple(sent))
    if stage < last and not outgoing:
        raise UnsupportedArchitectureError(f"pipeline stage {stage} of this model hands nothing to the next stage: its "
                                           f"graph could not be cut at decoder-layer boundaries.")
    out = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Stage{stage}")
    out.graph.eliminate_dead_code()  # the other stages' weights' reads, unused shape arithmetic
    out.recompile()
    return fx.GraphModule(out, out.graph, class_name=out.__class__.__name__)  # only the modules still called

