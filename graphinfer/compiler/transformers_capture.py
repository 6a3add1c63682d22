"""Capture transformers' modeling code (models/transformers.py) as an fx graph in graphinfer's form.

torch.fx's symbolic tracing cannot run transformers' code (it unpacks shapes, `(*input_shape, -1, head_dim)`, and
builds masks and caches in Python), so TorchDynamo captures it (`torch._dynamo.export`, torch-level IR: torch
functions and tensor methods, not aten; no functionalization, so the in-place KV-cache write stays one op), with the
token count symbolic: one graph serves every step. The graph is then brought to the form native models trace to:

  - the signature forward(input_ids, positions, md): the metadata's four tensors become `md.<field>` reads;
  - parameters and buffers are read by their paths in the model (`model.layers.0.self_attn.q_proj.weight`), not by
    Dynamo's flattened names, and a plain nn.Linear / nn.Embedding is a `call_module` leaf again, so the passes see
    projections as they see a native model's (fuse_qkv, fuse_gate_up, ...);
  - Dynamo's bookkeeping calls (grad mode, API-usage logging) and the nodes nothing uses are gone.

Limits: Dynamo must capture the forward whole (fullgraph: a graph break is an error naming where), and the graph is
specialised on what the model's Python branches on besides the token count (its config, the dtype); a model whose
code branches on the token count itself (e.g. dynamic RoPE past its original context) is captured for the branch
the example takes, which the capture refuses rather than guess (export fails on such a guard).
"""
import operator

import torch
from torch import fx, nn

from graphinfer.compiler.inplace import inplace
from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.layers import AttentionMetadata
from graphinfer.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

_MD_FIELDS = ("slot_mapping", "block_tables", "query_start_loc", "seq_lens")
_BOOKKEEPING = {torch._C._set_grad_enabled, torch._C._log_api_usage_once}


class _FlatInputs(nn.Module):
    """The model with the metadata's tensors as separate inputs (what Dynamo can take)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens):
        return self.model(input_ids, positions, AttentionMetadata(slot_mapping, block_tables, query_start_loc, seq_lens))


def _example_inputs(model: nn.Module, tokens: int = 11):
    """A prefill of `tokens` tokens that writes no KV (slots -1): shapes for the capture; no value matters."""
    device = next(model.parameters()).device
    i32, i64 = torch.int32, torch.int64
    return (torch.zeros(tokens, dtype=i64, device=device), torch.arange(tokens, device=device),
            torch.full((tokens,), -1, dtype=i64, device=device), torch.zeros(1, 2, dtype=i32, device=device),
            torch.tensor([0, tokens], dtype=i32, device=device), torch.tensor([tokens], dtype=i32, device=device))


@torch.inference_mode(False)
def capture_transformers(model: nn.Module) -> fx.GraphModule:
    """model (TransformersForCausalLM) as an fx.GraphModule over model's own module tree: forward(input_ids,
    positions, md) -> hidden [T, H]."""
    import torch._dynamo

    try:
        with torch.no_grad():
            captured, _ = torch._dynamo.export(_FlatInputs(model), assume_static_by_default=False)(
                *_example_inputs(model))
    except Exception as e:  # Dynamo's: a graph break, data-dependent control flow, an unsupported construct
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedArchitectureError(
            f"{model.config.architectures}: TorchDynamo cannot capture transformers' forward of this model as one "
            f"graph ({type(e).__name__}: {first}), so it cannot run through model_impl='transformers' yet.") from e
    return _canonical(captured, model)


def _canonical(captured: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    paths = {}  # tensor id -> its path in model (the first one: a tied weight keeps its embedding's)
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        paths.setdefault(id(t), name)
    # plain leaves only (a subclass's forward may do more; a tp layer with a collective is traced through), by kind:
    # a tied embedding shares its weight with the LM head
    owners = {(nn.Linear if isinstance(m, nn.Linear) else nn.Embedding, id(m.weight)): (name, m)
              for name, m in model.named_modules() if _is_leaf(m)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in captured.graph.nodes if n.op == "placeholder"]
    input_ids, positions = graph.placeholder("input_ids"), graph.placeholder("positions")
    md = graph.placeholder("md")
    env[placeholders[0]], env[placeholders[1]] = input_ids, positions
    for node, field in zip(placeholders[2:], _MD_FIELDS):
        env[node] = graph.call_function(getattr, (md, field))
    for node in captured.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":  # Dynamo returns its outputs flattened: one tensor here
            (out,) = node.args[0]
            graph.output(env[out])
            continue
        if node.op == "call_function" and node.target in _BOOKKEEPING:
            continue
        if node.op == "get_attr":
            t = getattr(captured, node.target)
            if id(t) not in paths:
                raise RuntimeError(f"captured graph reads {node.target}, which is no parameter or buffer of the model")
            env[node] = graph.get_attr(paths[id(t)])
            continue
        leaf = _leaf_call(node, captured, owners)
        if leaf is not None:
            path, x = leaf
            env[node] = graph.call_module(path, (env[x],))
            continue
        if _is_inplace_method(node) or node.target is operator.setitem:  # see compiler/inplace.py
            name = "__setitem__" if node.target is operator.setitem else node.target
            env[node] = graph.call_function(inplace, (name, *fx.map_arg(node.args, env.get)),
                                            fx.map_arg(node.kwargs, env.get))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    gm = fx.GraphModule(model, graph, class_name=f"{type(model.model).__name__}Graph")
    gm.meta["max_position_embeddings"] = model.config.max_position_embeddings  # for canon_rotary's cos/sin cache
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _is_inplace_method(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else ""
    return name.endswith("_") and not name.startswith("_") and hasattr(torch.Tensor, name)


def _is_leaf(m: nn.Module) -> bool:
    return type(m) in (nn.Linear, nn.Embedding, ColumnParallelLinear) or (
        type(m) is RowParallelLinear and not m.has_collective)


def _leaf_call(node: fx.Node, captured: fx.GraphModule, owners: dict) -> tuple[str, fx.Node] | None:
    """(module path, input) when node is a plain nn.Linear's or nn.Embedding's own call on its own parameters."""
    if node.op != "call_function" or node.target not in (torch._C._nn.linear, torch.nn.functional.embedding):
        return None
    x, weight = node.args[0], node.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None
    kind = nn.Linear if node.target is torch._C._nn.linear else nn.Embedding
    owner = owners.get((kind, id(getattr(captured, weight.target))))
    if owner is None:
        return None
    path, module = owner
    if isinstance(module, nn.Linear):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        got = getattr(captured, bias.target) if isinstance(bias, fx.Node) and bias.op == "get_attr" else bias
        if got is not module.bias:
            return None
    elif isinstance(module, nn.Embedding):
        if tuple(node.args[2:]) + tuple(node.kwargs.values()) != (module.padding_idx, module.max_norm, module.norm_type,
                                                                     module.scale_grad_by_freq, module.sparse):
            return None
    return path, x

