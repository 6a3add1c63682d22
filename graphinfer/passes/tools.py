"""What `graphinfer passes list | show | diff | verify` print: tooling for people who write passes.

MODEL is a checkpoint path or a named preset with random weights (e.g. tiny-qwen3), so a pass can be tried
on a 2-layer graph in a second.
"""
import torch
from torch import fx

from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.report import histogram_table, pass_table
from graphinfer.compiler.trace import node_target_name, op_histogram
from graphinfer.config import resolve_dtype
from graphinfer.models.loader import load_model
from graphinfer.passes.base import PassReport
from graphinfer.passes.registry import DEFAULT_PASSES, available_passes, resolve_passes


def list_passes() -> str:
    rows = [f"| {name} | {info.cls.description} | {info.origin} |" for name, info in available_passes().items()]
    default = ", ".join(DEFAULT_PASSES)
    return "\n".join(["| pass | description | origin |", "|---|---|---|", *rows, "", f"default pipeline: {default}"])


def pipeline_through(name: str | None) -> list[str]:
    """The default pipeline up to and including `name`; a pass outside it runs after the whole default pipeline."""
    if name is None:
        return []
    resolve_passes([name])  # a clear error for an unknown name
    defaults = list(DEFAULT_PASSES)
    return defaults[: defaults.index(name) + 1] if name in defaults else defaults + [name]


def _compile(model: str, passes: list[str], dtype: str, check: bool) -> tuple[fx.GraphModule, list[PassReport]]:
    m, _ = load_model(model, resolve_dtype(dtype))
    return compile_model(m, resolve_passes(passes), check=check)


def _export(gm: fx.GraphModule, onnx: str | None) -> str:
    if not onnx:
        return ""
    from graphinfer.compiler.onnx_export import export_onnx

    export_onnx(gm, onnx)
    return f"\nONNX view written to {onnx} (graphinfer:: ops in the 'graphinfer' domain; open it in Netron)\n"


def show(model: str, after: str | None = None, dtype: str = "auto", onnx: str | None = None, split: bool = False) -> str:
    passes = pipeline_through(after)
    gm, _ = _compile(model, passes, dtype, check=False)
    title = f"after {' -> '.join(passes)}" if passes else "as traced (no passes)"
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


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.name} = {node.target}(...)"
    if node.op == "get_attr":
        return f"{node.name} = get_attr {node.target}"
    return f"{node.name} = {node.op} {node_target_name(node)}"


def diff(model: str, pass_name: str, dtype: str = "auto") -> str:
    """The nodes `pass_name` removed and added, applied where it sits in the pipeline (see pipeline_through)."""
    before_passes = pipeline_through(pass_name)[:-1]
    gm, _ = _compile(model, before_passes, dtype, check=False)
    before = {n.name: _describe(n) for n in gm.graph.nodes}
    [p] = resolve_passes([pass_name])
    from graphinfer.passes.manager import PassManager

    [report] = PassManager([p]).run(gm)
    after = {n.name: _describe(n) for n in gm.graph.nodes}
    removed = [before[k] for k in before if k not in after]
    added = [after[k] for k in after if k not in before]
    context = f"after {' -> '.join(before_passes)}" if before_passes else "on the traced graph"
    return "\n".join([f"# {pass_name} {context}: {report.matches} matches, {len(removed)} nodes removed, "
                      f"{len(added)} added", "", "## removed", *[f"- {r}" for r in removed],
                      "", "## added", *[f"+ {a}" for a in added], *[f"declined: {d}" for d in report.declined]])


def verify(model: str, passes: str = "default", dtype: str = "auto", onnx: str | None = None) -> tuple[str, list[PassReport]]:
    """Every pass's numeric self-check (fused vs unfused outputs on a prefill + decode mini-batch)."""
    torch.manual_seed(0)
    gm, reports = _compile(model, passes, dtype, check=True)
    return f"# {model}: pass verification\n\n{pass_table(reports)}\n{_export(gm, onnx)}", reports
