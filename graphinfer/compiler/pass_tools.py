"""What `graphinfer passes list | show | diff | verify` print: tooling for people who write passes.

MODEL is a checkpoint path or a named preset with random weights (e.g. tiny-qwen3), so a pass can be tried
on a 2-layer graph in a second. PASSES, wherever taken, is a pipeline as `--passes` / `LLM(passes=)` take
it: 'default', 'none', 'a,b,c', 'default,my_pass' or a list of names and Pass instances. `show` and `diff`
take tp: the graph of rank 0 of a tensor-parallel layout (its shard, the collectives as nodes), built in this
one process: nothing runs, so no other rank is needed.
"""
import contextlib

import warnings

import torch
from torch import fx

from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.report import histogram_table, pass_table
from graphinfer.compiler.trace import node_target_name, op_histogram
from graphinfer.config import resolve_dtype
from graphinfer.distributed import parallel_state as ps
from graphinfer.model_loader import load_model
from graphinfer.models.loader import load_config
from graphinfer.models.parallel_layers import check_tensor_parallel
from graphinfer.passes.base import PassReports
from graphinfer.passes.manager import PassManager
from graphinfer.passes.registry import DEFAULT_PASSES, available_passes, resolve_passes


def list_passes() -> str:
    with warnings.catch_warnings(record=True) as caught:  # broken plugins get a row, and the warning on stderr
        warnings.simplefilter("always")
        passes = available_passes(include_broken=True)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    rows = []
    for name, info in passes.items():
        if info.cls is None:
            rows.append(f"| {name} | cannot be used: {info.error} | {info.origin} |")
        else:
            rows.append(f"| {name} | {info.cls.description} | {info.origin} |")
    default = ", ".join(DEFAULT_PASSES)
    return "\n".join(["| pass | description | origin |", "|---|---|---|", *rows, "", f"default pipeline: {default}"])


def pipeline_through(name: str | None, passes="default") -> list:
    """The pipeline `passes` up to and including the pass `name`; a pass not in it runs after all of it."""
    pipeline = resolve_passes(passes)
    if name is None:
        return pipeline
    names = [p.name for p in pipeline]
    if name in names:
        return pipeline[: names.index(name) + 1]
    return pipeline + resolve_passes([name])  # a clear error for an unknown name


def _title(passes: list) -> str:
    return " -> ".join(p.name for p in passes)


def _compile(model: str, passes: list, dtype: str, check: bool, atol=None, rtol=None,
             dump_dir: str | None = None, tp: int = 1, ep: bool = False,
             quantization: str | None = None) -> tuple[fx.GraphModule, PassReports]:
    layout = contextlib.nullcontext()
    if tp > 1:
        check_tensor_parallel(load_config(model), tp, ep)
        layout = ps.layout(0, tp, expert_parallel=ep)
    with layout:
        m, _ = load_model(model, resolve_dtype(dtype), quantization=quantization)
        return compile_model(m, passes, check=check, atol=atol, rtol=rtol, dump_dir=dump_dir)


def _export(gm: fx.GraphModule, onnx: str | None) -> str:
    if not onnx:
        return ""
    from graphinfer.compiler.onnx_export import export_onnx

    export_onnx(gm, onnx)
    return f"\nONNX view written to {onnx} (graphinfer:: ops in the 'graphinfer' domain; open it in Netron)\n"


def show(model: str, after: str | None = None, dtype: str = "auto", onnx: str | None = None, split: bool = False,
         passes=None, dump_dir: str | None = None, tp: int = 1, ep: bool = False,
         quantization: str | None = None) -> str:
    """The graph after `passes` (default: none; with `after`, the default pipeline) up to and including
    `after`, with its op histogram (tp > 1: rank 0's graph; ep: with expert parallel on)."""
    pipeline = pipeline_through(after, passes or "default") if after else resolve_passes(passes or "none")
    gm, _ = _compile(model, pipeline, dtype, check=False, dump_dir=dump_dir, tp=tp, ep=ep, quantization=quantization)
    title = f"after {_title(pipeline)}" if pipeline else "as traced (no passes)"
    if tp > 1:
        title += f", rank 0 of tensor_parallel_size={tp}" + (", expert parallel" if ep else "")
    return (f"# {model}: graph {title}, {len(gm.graph.nodes)} nodes\n{gm.code}\n## Op histogram\n\n"
            f"{histogram_table(op_histogram(gm))}\n{_export(gm, onnx)}" + (show_split(gm) if split else ""))


def show_split(gm: fx.GraphModule) -> str:
    """The pieces PIECEWISE capture records: the top-level module, a table of pieces, the code of each distinct one."""
    from graphinfer.compiler.split import split_graph

    s = split_graph(gm)
    group_of = {i: g[0] for g in s.info.identical_groups for i in g}
    rows = []
    for i, piece in enumerate(s.pieces):
        phs = [n for n in piece.graph.nodes if n.op == "placeholder"]
        outs = next(n for n in piece.graph.nodes if n.op == "output").args[0]
        same = "" if group_of[i] == i else f"as piece {group_of[i]}"
        rows.append(f"| {i} | {s.info.nodes_per_piece[i]} | {len(phs)} | {len(outs)} | {same} |")
    distinct = "\n".join(f"### piece {i}\n{s.pieces[i].code}" for i in sorted(set(group_of.values())))
    return (f"\n## Piecewise split\n\n{s.info.summary()}\n\n### top level (runs the pieces and, eagerly, the "
            f"splitting ops)\n{s.module.code}\n| piece | nodes | inputs | outputs | identical structure |\n"
            f"|---|---|---|---|---|\n" + "\n".join(rows) + f"\n\n{distinct}")


class _Name:
    def __init__(self, node: fx.Node):
        self.node = node

    def __repr__(self) -> str:
        return "%" + self.node.name


def _args(node: fx.Node) -> str:
    """The arguments as in the graph's IR: %node for nodes, repr for constants."""
    args = [repr(fx.node.map_arg(a, _Name)) for a in node.args]
    return ", ".join(args + [f"{k}={fx.node.map_arg(v, _Name)!r}" for k, v in node.kwargs.items()])


def _describe(node: fx.Node) -> str:
    if node.op == "get_attr":
        return f"%{node.name} = get_attr {node.target}"
    if node.op in ("placeholder", "output"):
        return f"{node.op} {_args(node) if node.op == 'output' else node.target}"
    target = node.target if node.op == "call_module" else node_target_name(node)
    method = "." if node.op == "call_method" else ""
    return f"%{node.name} = {method}{target}({_args(node)})"


def diff(model: str, pass_name: str, dtype: str = "auto", passes="default", dump_dir: str | None = None,
         tp: int = 1, ep: bool = False, quantization: str | None = None) -> str:
    """What `pass_name` changed, applied where it sits in the pipeline `passes` (or after all of it): the nodes
    it removed and added, and the nodes it kept whose arguments it rewired, with their arguments (tp > 1: on
    rank 0's graph)."""
    pipeline = pipeline_through(pass_name, passes)
    before_passes, p = pipeline[:-1], pipeline[-1]
    gm, _ = _compile(model, before_passes, dtype, check=False, tp=tp, ep=ep, quantization=quantization)
    before = {n: _describe(n) for n in gm.graph.nodes}
    [report] = PassManager([p], dump_dir=dump_dir).run(gm)
    after = {n: _describe(n) for n in gm.graph.nodes}
    removed = [before[n] for n in before if n not in after]
    added = [after[n] for n in after if n not in before]
    rewired = [f"~ {before[n]}\n    now {after[n]}" for n in after if n in before and after[n] != before[n]]
    context = f"after {_title(before_passes)}" if before_passes else "on the traced graph"
    return "\n".join([f"# {pass_name} {context}: {report.matches} matches, {len(removed)} nodes removed, "
                      f"{len(added)} added, {len(rewired)} rewired", "", "## removed", *[f"- {r}" for r in removed],
                      "", "## added", *[f"+ {a}" for a in added], "", "## rewired (kept, arguments changed)",
                      *rewired, *[f"declined: {d}" for d in report.declined]])


def verify(model: str, passes="default", dtype: str = "auto", onnx: str | None = None, atol: float | None = None,
           rtol: float | None = None, dump_dir: str | None = None,
           quantization: str | None = None) -> tuple[str, PassReports]:
    """Every pass's numeric check (against the graph before it) and the pipeline's (against the unfused graph)
    on a prefill + decode mini-batch; `reports.passed` says whether all are within the tolerances."""
    torch.manual_seed(0)
    gm, reports = _compile(model, resolve_passes(passes), dtype, check=True, atol=atol, rtol=rtol, dump_dir=dump_dir,
                           quantization=quantization)
    verdict = "all checks passed" if reports.passed else "CHECK FAILED"
    return f"# {model}: pass verification: {verdict}\n\n{pass_table(reports)}\n{_export(gm, onnx)}", reports
