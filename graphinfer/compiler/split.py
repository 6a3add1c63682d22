"""Split the fused graph at the splitting ops (attention) into attention-free pieces, for piecewise capture.

    forward(input_ids, positions, md):              split module (runs in Python):
      ...embed, norm, qkv, rotary, cache write...      outs = piece_0(input_ids, positions, md.slot_mapping)
      o = paged_attention(q, ...)            ->        o = paged_attention(outs[0], ..., md.block_tables, ...)
      ...o_proj, add+norm, mlp, ..., qkv...            outs = piece_1(o, outs[1], positions, ...)
      o = paged_attention(...)                         ...
      ...final norm                                    return piece_N(...)[0]

Each piece is an fx.GraphModule over the same parameters and KV-cache buffers as the fused graph (fusions
kept); the splitting ops run between them with the step's attention metadata. Metadata reads
(`md.block_tables`, ...) and parameter reads stay outside the pieces' inputs: pieces take token-indexed
tensors (input_ids, positions, slot_mapping, activations), Python ints (the token count) and nothing whose
shape depends on the number of requests, so one captured piece serves every step padded to its token count.
"""
import hashlib
import operator
from dataclasses import dataclass

from torch import fx, nn

from graphinfer.compiler.trace import node_target_name
from graphinfer.errors import InvalidConfigError

# attention: paged, and MLA's (the model's expanded op, the per-step form absorb_mla writes, the latent attention)
DEFAULT_SPLITTING_OPS = ("graphinfer::paged_attention", "graphinfer::mla_attention", "graphinfer::mla_attention_auto",
                         "graphinfer::mla_latent_attention")

# Metadata fields a piece may read: indexed by token, so padding the token count pads them too.
TOKEN_INDEXED_FIELDS = ("slot_mapping",)


@dataclass
class SplitInfo:
    """What `passes show --split` prints and artifacts record."""
    splitting_ops: list[str]
    num_pieces: int
    num_splits: int  # splitting-op calls between the pieces (one attention per layer)
    nodes_per_piece: list[int]
    identical_groups: list[list[int]]  # pieces with the same structure (differing only in which weights they read)

    def summary(self) -> str:
        shared = [g for g in self.identical_groups if len(g) > 1]
        same = "; ".join(f"pieces {g[0]}..{g[-1]} ({len(g)})" if g == list(range(g[0], g[-1] + 1))
                         else f"pieces {g}" for g in shared) or "none"
        return (f"{self.num_pieces} pieces around {self.num_splits} calls of {', '.join(self.splitting_ops)}; "
                f"nodes per piece {self.nodes_per_piece}; identical structure: {same}")


@dataclass
class SplitGraph:
    module: fx.GraphModule  # the top-level graph: pieces (call_module piece_i) and splitting ops in between
    pieces: list[fx.GraphModule]
    info: SplitInfo


def _is_split_node(node: fx.Node, ops: set[str]) -> bool:
    return node.op == "call_function" and node_target_name(node) in ops


def is_metadata_read(node: fx.Node) -> bool:
    """`md.field` on a graph input: stays in the top level."""
    return (node.op == "call_function" and node.target is getattr and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "placeholder")


def split_graph(gm: fx.GraphModule, splitting_ops: tuple[str, ...] | list[str] = DEFAULT_SPLITTING_OPS) -> SplitGraph:
    """Cut gm at every call of a splitting op (names as `namespace::op`)."""
    ops = set(splitting_ops)
    nodes = list(gm.graph.nodes)
    stage, piece_of = 0, {}
    for node in nodes:
        if _is_split_node(node, ops):
            stage += 1
        elif node.op in ("call_function", "call_method", "call_module") and not is_metadata_read(node):
            piece_of[node] = stage
    if stage == 0:
        raise InvalidConfigError(f"The graph has no call of the splitting ops {sorted(ops)}; nothing to split at. "
                                 f"Use graph_mode FULL_DECODE_ONLY or NONE, or name the ops to split at.")
    num_pieces = stage + 1

    # Values a piece needs from outside (inputs) and values it hands on (outputs), in graph order.
    inputs = [[] for _ in range(num_pieces)]
    outputs = [[] for _ in range(num_pieces)]
    for node in nodes:
        for user in node.users:
            src, dst = piece_of.get(node), piece_of.get(user)
            if node.op == "get_attr" or src == dst:
                continue  # parameters and buffers are read inside the piece that uses them
            if dst is not None and node not in inputs[dst]:
                inputs[dst].append(node)
            if src is not None and node not in outputs[src]:
                outputs[src].append(node)
    order = {n: i for i, n in enumerate(nodes)}
    for needed in inputs:  # graph inputs and metadata first, so pieces of the same structure take the same args
        needed.sort(key=lambda n: (n in piece_of or not (n.op == "placeholder" or is_metadata_read(n)), order[n]))
    for i, needed in enumerate(inputs):
        for node in needed:
            if is_metadata_read(node) and node.args[1] not in TOKEN_INDEXED_FIELDS:
                raise InvalidConfigError(
                    f"Piece {i} reads the attention metadata field {node.args[1]!r} (in {list(node.users)}), whose shape "
                    f"follows the number of requests, so it cannot be captured per token count. Add the op that reads "
                    f"it to the splitting ops.")

    pieces = [_build_piece(gm, [n for n in nodes if piece_of.get(n) == i], inputs[i], outputs[i], i)
              for i in range(num_pieces)]
    module = _build_top(gm, nodes, piece_of, pieces, inputs, outputs)
    info = SplitInfo(sorted(ops), num_pieces, stage, [len([n for n in p.graph.nodes if n.op not in ("placeholder", "output")])
                                                      for p in pieces], _identical_groups(pieces))
    return SplitGraph(module, pieces, info)


def _build_piece(gm: fx.GraphModule, body: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                 index: int) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:  # a parameter or buffer read: copied into the piece
            assert n.op == "get_attr", f"piece {index}: {n} is neither an input nor a get_attr"
            env[n] = graph.node_copy(n)
        return env[n]

    for node in body:
        env[node] = graph.node_copy(node, arg)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph, class_name=f"Piece{index}")


def _build_top(gm: fx.GraphModule, nodes: list[fx.Node], piece_of: dict, pieces: list[fx.GraphModule],
               inputs: list[list[fx.Node]], outputs: list[list[fx.Node]]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    done = set()
    root = nn.Module()
    for i, piece in enumerate(pieces):
        root.add_module(f"piece_{i}", piece)

    def emit_piece(i: int) -> None:
        call = graph.call_module(f"piece_{i}", tuple(env[n] for n in inputs[i]))
        for j, n in enumerate(outputs[i]):
            env[n] = graph.call_function(operator.getitem, (call, j))
        done.add(i)

    # Graph inputs, metadata reads and buffers first (they depend on inputs alone), then pieces and splitting
    # ops in graph order: a piece's inputs then all exist when its first node comes up.
    hoisted = [n for n in nodes if n.op in ("placeholder", "get_attr") or is_metadata_read(n)]
    for node in hoisted + [n for n in nodes if n not in hoisted]:
        i = piece_of.get(node)
        if i is not None:
            if i not in done:
                emit_piece(i)
            continue
        if node.op == "get_attr" and all(u in piece_of for u in node.users):
            continue  # read by pieces only
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(_TopRoot(gm, root), graph, class_name=f"{type(gm).__name__}Split")


class _TopRoot(nn.Module):
    """Owner of what the top level reads: the pieces and the fused graph's buffers the splitting ops take."""

    def __init__(self, gm: fx.GraphModule, pieces: nn.Module):
        super().__init__()
        for name, child in gm.named_children():
            self.add_module(name, child)
        for name, child in pieces.named_children():
            self.add_module(name, child)


def _signature(gm: fx.GraphModule) -> str:
    """Structure of a piece: ops, argument wiring and parameter shapes, not which layer's weights it reads."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    parts = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = operator.attrgetter(n.target)(gm)
            what = f"{tuple(t.shape)}:{t.dtype}"
        elif n.op == "call_module":
            m = gm.get_submodule(n.target)
            what = f"{type(m).__name__}:{[tuple(p.shape) for p in m.parameters()]}"
        elif n.op in ("call_function", "call_method"):
            what = node_target_name(n)
        else:
            what = n.op
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        parts.append(f"{n.op}|{what}|{args}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def _identical_groups(pieces: list[fx.GraphModule]) -> list[list[int]]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pieces):
        groups.setdefault(_signature(p), []).append(i)
    return sorted(groups.values())
