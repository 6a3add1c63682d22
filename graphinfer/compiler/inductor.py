"""The cpu platform's compiled lowering: the fused fx graph through TorchInductor (C++ codegen).

The pointwise graphinfer:: ops (norms, add+norm, rotary, silu_and_mul, gelu_and_mul) are inlined as their Python
references, so Inductor sees plain aten ops it fuses into a few C++ loops per layer; attention and the KV
cache write stay opaque custom ops run between the compiled pieces (the cpu platform's implementations,
ops/cpu/attention.py); linears stay aten mm/addmm on oneDNN/MKL. The token count is the one dynamic size
(plus the T = 1 variant dynamo specialises).

Inductor's compiled code is cached on disk (its FX graph cache): `use_inductor_cache(dir)` points that cache at
a directory (a compile artifact's kernel cache), so a later start-up loads the C++ it compiled before.
"""
import copy
import logging
import operator
import os
import time

import torch
from torch import fx

from graphinfer.compiler.split import DEFAULT_SPLITTING_OPS

logger = logging.getLogger(__name__)

# Ops inlined for Inductor: pointwise, functional, with a reference Inductor fuses well.
INLINED_OPS = ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul")
# Ops that run eagerly between the compiled pieces: attention and the ops that write the KV cache.
SPLITTING_OPS = DEFAULT_SPLITTING_OPS + ("graphinfer::reshape_and_cache", "graphinfer::qk_norm_rope_cache",
                                         "graphinfer::concat_and_cache_mla")


def use_inductor_cache(directory: str) -> None:
    """Make Inductor read and write its compiled code (FX graph cache, C++ build outputs) under `directory`."""
    import torch._inductor.config as inductor_config

    os.makedirs(directory, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory  # Inductor reads it whenever it resolves its cache dir
    inductor_config.fx_graph_cache = True


def inline_pointwise_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm (sharing its parameters and buffers) whose INLINED_OPS calls are their Python references,
    and whose all_reduce_add_rms_norm calls (tensor parallel) are the all_reduce, then add_rms_norm's reference:
    the collective stays an opaque call, the add + norm is fused by Inductor as at tp 1."""
    from graphinfer.distributed.communication_op import all_reduce, all_reduce_add_rms_norm

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)  # gm stays as it is
    inlined = {getattr(torch.ops.graphinfer, name).default for name in INLINED_OPS}
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target is all_reduce_add_rms_norm:
            x, residual, weight, eps, group_name = node.args
            with out.graph.inserting_before(node):
                reduced = out.graph.call_function(all_reduce, (x, group_name))
            node.target, node.args = torch.ops.graphinfer.add_rms_norm.default.reference, (reduced, residual, weight, eps)
        elif node.op == "call_function" and node.target in inlined:
            node.target = node.target.reference
    out.recompile()
    return out


def compile_for_cpu(gm: fx.GraphModule) -> fx.GraphModule:
    """gm split at attention and at the cache write (compiler/split.py), every non-empty piece compiled by Inductor.

    The pieces are pure (the KV-cache write runs between them, so Inductor never functionalises a write into
    the whole cache) and take only token-indexed inputs, so the token count is their one dynamic size: no
    recompiles as the number of requests or the block-table width changes. Pieces of the same structure (the
    decoder layers) share one compiled function with the weights as inputs: SmolLM2 compiles 3 graphs, not 31.
    Compiles lazily on the first call of each (warm_up does it up front)."""
    from graphinfer.compiler.split import split_graph

    split = split_graph(inline_pointwise_ops(gm), SPLITTING_OPS)
    for group in split.info.identical_groups:
        if split.info.nodes_per_piece[group[0]] == 0:
            continue  # an empty piece (between the cache write and attention)
        functionals = [_functional(split.pieces[i]) for i in group]
        if functionals[0] is None:  # a module Inductor cannot take apart: compile each piece on its own
            for i in group:
                split.module.add_module(f"piece_{i}", torch.compile(split.pieces[i], dynamic=True, fullgraph=True))
            continue
        compiled = torch.compile(functionals[0][0], dynamic=True, fullgraph=True)
        for i, (_, weights) in zip(group, functionals):
            split.module.add_module(f"piece_{i}", _BoundPiece(compiled, weights))
    return split.module


class _BoundPiece(torch.nn.Module):
    """One piece: a compiled function shared by pieces of its structure, called with this piece's weights."""

    def __init__(self, compiled, weights: list[torch.Tensor]):
        super().__init__()
        self.compiled, self.weights = compiled, weights
        for w in weights:
            torch._dynamo.mark_static(w)  # weights keep their shapes; only the token count is dynamic

    def forward(self, *args):
        return self.compiled(*self.weights, *args)


def _functional(piece: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]] | None:
    """The piece with its parameters and buffers as leading inputs (Linear / Embedding calls as F.linear /
    F.embedding), and those tensors; None if it calls another kind of module."""
    import torch.nn.functional as F
    from torch import nn

    from graphinfer.compiler.trace import is_leaf_layer

    nodes = list(piece.graph.nodes)
    reads: dict[fx.Node, list[torch.Tensor]] = {}
    for n in nodes:
        if n.op == "get_attr":
            reads[n] = [operator.attrgetter(n.target)(piece)]
        elif n.op == "call_module":
            m = piece.get_submodule(n.target)
            if not is_leaf_layer(m):
                return None
            reads[n] = [m.weight] + ([m.bias] if isinstance(m, nn.Linear) and m.bias is not None else [])
    graph, env, weights = fx.Graph(), {}, []
    inputs = {n: [] for n in reads}
    for n, tensors in reads.items():
        for t in tensors:
            inputs[n].append(graph.placeholder(f"w{len(weights)}"))
            weights.append(t)
    for n in nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            env[n] = inputs[n][0]
        elif n.op == "call_module":
            fn = F.linear if isinstance(piece.get_submodule(n.target), nn.Linear) else F.embedding
            env[n] = graph.call_function(fn, (env[n.args[0]], *inputs[n]))
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return fx.GraphModule(torch.nn.Module(), graph, class_name="CpuPiece"), weights


@torch.inference_mode()
def warm_up(module, device: torch.device) -> float:
    """Run `module` (a compiled forward) on token counts 5 and 1 with every row padded (slot -1, context 0:
    nothing is written to the KV cache), so Inductor compiles (or loads from its cache) both variants now,
    not on the first requests. Returns the seconds it took."""
    from graphinfer.models.layers import AttentionMetadata

    start = time.perf_counter()
    for q_lens in ([4, 1], [1]):  # 5 tokens over 2 requests; 1 token
        tokens, int32 = sum(q_lens), dict(dtype=torch.int32, device=device)
        md = AttentionMetadata(torch.full((tokens,), -1, dtype=torch.long, device=device),
                               torch.zeros(len(q_lens), 3, **int32), torch.tensor([0, *q_lens], **int32).cumsum(0).int(),
                               torch.zeros(len(q_lens), **int32))
        module(torch.zeros(tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device), md)
    seconds = time.perf_counter() - start
    logger.info("Inductor: compiled (or loaded) the cpu graph in %.1f s", seconds)
    return seconds
