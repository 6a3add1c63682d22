"""Export a traced graph to ONNX for viewing in Netron: a picture of the graph, not a runnable model.

Built by hand with onnx.helper (torch.onnx.export can't handle graphinfer:: ops). One ONNX node per fx
compute node, named after it; getitem on a multi-output node and md.<field> are wiring, not nodes.
Standard ONNX ops only where the fx node fits the ONNX signature as is (Gemm, Gather, Add, Mul, Shape):
the checker validates their inputs and attributes, and shapes that hold symbolic sizes (view(T, 4, 32))
can't be tensor inputs without extra constant nodes. Everything else goes to a custom domain, the op's
namespace ("graphinfer", "aten") or "torch", with non-tensor args as attributes. Parameters and buffers are
typed graph inputs, never initializers: real weights are hundreds of MB and Netron only needs the shape.
"""
import builtins
import functools
import operator

import onnx
import torch
from onnx import TensorProto, helper
from torch import fx, nn

from graphinfer.compiler.trace import node_target_name

_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
           torch.float64: TensorProto.DOUBLE, torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
           torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}
# The runtime's input contract (graphinfer/models/layers.py AttentionMetadata); T tokens, B sequences.
_INPUTS = {"input_ids": (TensorProto.INT64, ["T"]), "positions": (TensorProto.INT64, ["T"]),
           "slot_mapping": (TensorProto.INT64, ["T"]), "block_tables": (TensorProto.INT32, ["B", "max_blocks"]),
           "query_start_loc": (TensorProto.INT32, ["B+1"]), "seq_lens": (TensorProto.INT32, ["B"])}
_BINARY = {operator.add: "Add", torch.add: "Add", operator.mul: "Mul", torch.mul: "Mul"}
_SPLITS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}


def _is_getattr_of(node: fx.Node, pred) -> bool:
    return node.op == "call_function" and node.target is builtins.getattr and pred(node.args[0])


def _is_struct(node: fx.Node) -> bool:
    """A placeholder passed as a dataclass (md): its fields, not itself, are the graph inputs."""
    return (node.op == "placeholder" and node.type not in (None, torch.Tensor) and bool(node.users)
            and all(_is_getattr_of(u, lambda a: a is node) for u in node.users))


def _num_outputs(node: fx.Node) -> int | None:
    """How many outputs a tuple-producing node has (consumers read them through getitem); None: one value."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        if len(rets) != 1:
            return len(rets)  # reshape_and_cache: 0 outputs, add_rms_norm: 2
        if not isinstance(rets[0].type, torch.ListType):
            return None
    elif not (node.op == "call_method" and t in _SPLITS or t in (torch.split, torch.chunk, torch.unbind)):
        return None
    if t == "split" and isinstance(_split_sizes(node), (list, tuple)):
        return len(_split_sizes(node))
    ks = [u.args[1] for u in node.users if u.target is operator.getitem and isinstance(u.args[1], int)]
    return max(ks, default=-1) + 1


def _split_sizes(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size")


def _attr(v, names: dict):
    """A non-tensor arg as an attribute value: None for a tensor (it is an input); symbolic sizes by name."""
    if v is None or isinstance(v, fx.Node):
        return None
    if isinstance(v, (bool, int, float, str)):
        return int(v) if isinstance(v, bool) else v
    if isinstance(v, (list, tuple)) and v and all(type(x) is int for x in v):
        return list(v)
    if isinstance(v, (list, tuple)):  # view(T, 4, 32) -> "[getitem, 4, 32]"; a list of tensors is all inputs
        items = [names[x] if isinstance(x, fx.Node) else str(x) for x in v]
        return None if v and all(isinstance(x, fx.Node) for x in v) else "[" + ", ".join(items) + "]"
    return str(v)


def _meta_type(name: str, node: fx.Node, default_dtype: int, default_shape):
    """Type from shape-propagation metadata when a pass left it, else the given default."""
    v = node.meta.get("val", node.meta.get("tensor_meta"))
    if v is not None and hasattr(v, "shape") and hasattr(v, "dtype"):
        shape = [d if isinstance(d, int) else str(d) for d in v.shape]  # SymInt -> dim_param
        return helper.make_tensor_value_info(name, _DTYPES.get(v.dtype, TensorProto.UNDEFINED), shape)
    return None if default_shape is None else helper.make_tensor_value_info(name, default_dtype, default_shape)


def export_onnx(gm: fx.GraphModule, path: str, *, graph_name: str = "graphinfer") -> onnx.ModelProto:
    """Write gm as an ONNX file at path (for Netron) and return the checked ModelProto."""
    names: dict[fx.Node, str] = {}  # fx value -> ONNX value name
    inputs: dict[str, onnx.ValueInfoProto] = {}
    nodes, value_info, domains = [], [], {"", "graphinfer", "torch"}
    # The graph contract (trace.py) is hidden[T, H] in the parameters' dtype: the guess for untyped values.
    dtypes = [p.dtype for p in gm.parameters() if p.is_floating_point()]
    dtype = _DTYPES.get(max(set(dtypes), key=dtypes.count) if dtypes else torch.float32, TensorProto.FLOAT)

    def add_input(name: str, elem_type: int, shape) -> str:
        inputs.setdefault(name, helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def add_tensor(name: str, t: torch.Tensor) -> str:
        return add_input(name, _DTYPES.get(t.dtype, TensorProto.UNDEFINED), list(t.shape))

    def flat_nodes(a) -> list[str]:
        return [names[n] for n in _flatten(a)]

    def emit(node, domain, op_type, ins, n_out, attrs=()):
        names[node] = node.name
        outs = [node.name] if n_out is None else [f"{node.name}.{k}" for k in range(n_out)]
        n = helper.make_node(op_type, ins, outs, name=node.name, domain=domain, doc_string=node.format_node())
        attrs = [(k, _attr(v, names)) for k, v in attrs]
        n.attribute.extend(helper.make_attribute(k, v) for k, v in attrs if v is not None)
        nodes.append(n)
        domains.add(domain)
        if n_out is None and (vi := _meta_type(node.name, node, 0, None)) is not None:
            value_info.append(vi)

    for node in gm.graph.nodes:
        t, args = node.target, node.args
        if node.op == "placeholder":
            if not _is_struct(node):
                names[node] = node.name
                inputs[node.name] = _meta_type(node.name, node, *_INPUTS.get(node.name, (dtype, ["T", "H"])))
        elif node.op == "get_attr":  # several get_attr nodes may read one buffer: one input
            names[node] = add_tensor(t, functools.reduce(getattr, t.split("."), gm))
        elif _is_getattr_of(node, _is_struct):  # md.slot_mapping -> graph input "md.slot_mapping"
            names[node] = add_input(f"{args[0].name}.{args[1]}", *_INPUTS.get(args[1], (TensorProto.UNDEFINED, ["?"])))
        elif t is operator.getitem and isinstance(args[0], fx.Node) and _num_outputs(args[0]) is not None:
            names[node] = f"{args[0].name}.{args[1]}"  # k-th output of the producer, no node
        elif node.op == "call_module":
            mod = gm.get_submodule(t)
            params = [add_tensor(f"{t}.{p}", v) for p, v in mod.named_parameters()]
            ins = flat_nodes((args, node.kwargs))
            if isinstance(mod, nn.Linear):  # y = x W^T + b
                emit(node, "", "Gemm", ins + params, None, [("transB", 1)])
            elif isinstance(mod, nn.Embedding):
                emit(node, "", "Gather", params + ins, None)
            else:  # e.g. a fused MoE module: its own parameters become inputs too
                emit(node, "torch", type(mod).__name__, ins + params, None,
                     [(f"arg{i}", a) for i, a in enumerate(args)] + list(node.kwargs.items()))
        elif node.op in ("call_function", "call_method"):
            ins, n_out = flat_nodes((args, node.kwargs)), _num_outputs(node)
            if isinstance(t, torch._ops.OpOverload):  # attributes named after the schema's arguments
                schema = [a.name for a in t._schema.arguments]
                attrs = [(schema[i], a) for i, a in enumerate(args)]
                domain, _, op_type = node_target_name(node).partition("::")
                emit(node, domain, op_type, ins, n_out, attrs + list(node.kwargs.items()))
            elif t in _BINARY and len(ins) == len(args) == 2 and not node.kwargs:  # tensor (op) tensor only
                emit(node, "", _BINARY[t], ins, None)
            elif t is builtins.getattr and args[1] == "shape":
                emit(node, "", "Shape", ins, None)
            elif t is operator.getitem:  # indexing a value (T = shape[0]), not wiring
                emit(node, "torch", "getitem", ins, None, [("index", args[1])])
            elif node.op == "call_method" and t in ("view", "reshape"):
                shape = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
                emit(node, "torch", "Reshape", ins, None, [("shape", shape)])
            elif node.op == "call_method" and t == "split":
                dim = args[2] if len(args) > 2 else node.kwargs.get("dim", 0)
                emit(node, "torch", "Split", ins, n_out, [("split", _split_sizes(node)), ("axis", dim)])
            else:  # named after the target; positional non-tensor args as arg<i>, kwargs by name
                op_type = t if isinstance(t, str) else node_target_name(node)
                attrs = [(f"arg{i}", a) for i, a in enumerate(args)]
                emit(node, "torch", op_type, ins, n_out, attrs + list(node.kwargs.items()))
        elif node.op == "output":
            outputs = [_meta_type(names[n], n, dtype, ["T", "H"]) for n in _flatten(args[0])]

    graph = helper.make_graph(nodes, graph_name, list(inputs.values()), outputs, value_info=value_info)
    model = helper.make_model(graph, producer_name="graphinfer",
                              opset_imports=[helper.make_opsetid(d, 18 if d == "" else 1) for d in sorted(domains)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return model


def _flatten(a) -> list[fx.Node]:
    out = []
    fx.node.map_arg(a, out.append)
    return out
