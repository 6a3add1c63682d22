"""Trace a model's forward(input_ids[T], positions[T], attn_metadata) -> hidden[T, H] into a torch.fx graph.

torch.fx symbolic tracing, not torch.export (docs/architecture.md says why): nn.Linear and nn.Embedding
stay `call_module` leaves, so a pass can see a projection, read its weight and swap in a fused module;
every graphinfer:: op is one `call_function` node (its impl is opaque to the tracer); the token count T
stays symbolic (`x.shape[0]` becomes graph nodes), so one graph serves every batch shape. Tensor-parallel
layers with a collective (models/parallel_layers.py at tp > 1) are traced through, so the graphinfer::
collectives are nodes passes can see and device graphs capture.
"""
import torch
from torch import fx, nn

from graphinfer.compiler.inplace import inplace


def is_leaf_layer(m: nn.Module) -> bool:
    """A Linear / Embedding whose forward is F.linear / F.embedding (at tp 1 the parallel layers are), or a
    QuantizedLinear (lowered to its ops by the lower_quant_linears pass, after the projections are fused)."""
    from graphinfer.models.pipeline_stage import PPMissingLayer
    from graphinfer.quantization.linear import QuantizedEmbedding, QuantizedLinear

    if isinstance(m, PPMissingLayer):  # another pipeline stage's module: one call the stage cut drops
        return True
    return isinstance(m, (nn.Linear, nn.Embedding, QuantizedLinear, QuantizedEmbedding)) and \
        not getattr(m, "has_collective", False)


class GraphinferTracer(fx.Tracer):
    def __init__(self):
        super().__init__(autowrap_functions=(inplace,))  # a leaf wherever a graph's code calls it

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_layer(m)


def trace_model(model: nn.Module) -> fx.GraphModule:
    """The model's forward as a GraphModule sharing the model's parameters and buffers (KV caches included);
    transformers' modeling code through TorchDynamo (compiler/transformers_capture.py)."""
    from graphinfer.models.transformers import TransformersForCausalLM

    if isinstance(model, TransformersForCausalLM):
        from graphinfer.compiler.transformers_capture import capture_transformers

        return capture_transformers(model)
    graph = GraphinferTracer().trace(model)
    return fx.GraphModule(model, graph, class_name=f"{type(model).__name__}Graph")


def with_modules(gm: fx.GraphModule, swaps: dict[str, nn.Module]) -> fx.GraphModule:
    """A copy of gm (same nodes, its own module tree; gm untouched) with the call_module targets in `swaps`
    replaced: how a lowering step gives the runner its own graph while artifacts save gm."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for target, module in swaps.items():
        parent, _, name = target.rpartition(".")
        setattr(copy.get_submodule(parent) if parent else copy, name, module)
    return copy


HOISTED = "_hoisted_attrs"  # in a GraphModule's __dict__: {flat attribute: the module path it was read from}


def rebind_buffers(model: nn.Module, *roots) -> None:
    """Point the buffer reads of every fx graph in `roots` (GraphModules, their submodules included: a split graph's
    pieces; None and non-module callables are skipped) at model's current buffers of the same path (e.g. a
    re-allocated KV cache): a GraphModule keeps its own module tree, holding the tensors that existed when it was
    traced or copied."""
    buffers = dict(model.named_buffers(remove_duplicate=False))  # a tensor shared by layers, at each path
    graphs = {id(m): m for root in roots if isinstance(root, nn.Module)
              for m in root.modules() if isinstance(m, fx.GraphModule)}
    for gm in graphs.values():
        hoisted = gm.__dict__.get(HOISTED, {})  # compiler/bind_ops.hoist_attrs: flat name -> path
        for node in gm.graph.nodes:
            path = hoisted.get(node.target, node.target)
            if node.op == "get_attr" and path in buffers:
                if node.target in hoisted:
                    gm.__dict__[node.target] = buffers[path]
                else:
                    parent, _, name = path.rpartition(".")
                    setattr(gm.get_submodule(parent), name, buffers[path])


def op_histogram(gm: fx.GraphModule) -> dict[str, int]:
    """How many nodes of each kind: graphinfer ops by name, modules by class, other calls by target name."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            key = type(gm.get_submodule(node.target)).__name__
        elif node.op in ("call_function", "call_method"):
            key = node_target_name(node)
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def node_target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}::{t._schema.name.split('::')[-1]}"
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))
