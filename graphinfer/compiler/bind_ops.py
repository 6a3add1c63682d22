"""A lowering step for graphs that run eagerly from Python (the cpu default): graphinfer op nodes call the
platform's implementation functions directly instead of through the op.

A graphinfer:: op whose platform kernel is a Python function (platforms' op_impls: they check their inputs, then
call C++ or fall back to the reference) pays the dispatcher's trip into Python on every call: at batch 1 on the
2-core AVX2 dev VM, add_rms_norm costs 10.6 us through the op against 6.6 us calling the function (4.8 us of it the
C++ kernel; tools/cpu_gemv_bench.py's "call_us"), and a SmolLM2 step makes 181 such calls.
The runner's copy of the graph calls the same functions with the same arguments, so results are unchanged; the
engine's graph (artifacts, passes, tooling) keeps its op nodes.
"""
from collections.abc import Callable

from torch import fx

from graphinfer.compiler.trace import with_modules


def bind_op_impls(gm: fx.GraphModule, impls: dict[str, Callable]) -> fx.GraphModule:
    """A copy of gm (gm untouched) whose graphinfer::<name>.default nodes call impls[name] where impls has one."""
    def impl_of(node: fx.Node) -> Callable | None:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "graphinfer":
            return None
        return impls.get(target._schema.name.partition("::")[2]) if target._overloadname == "default" else None

    if not any(impl_of(n) for n in gm.graph.nodes):
        return gm
    copy = with_modules(gm, {})
    for node in copy.graph.nodes:
        if (fn := impl_of(node)) is not None:
            node.target = fn
    copy.recompile()
    return copy
