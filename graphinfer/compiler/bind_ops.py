"""A lowering step for graphs that run eagerly from Python (the cpu default): graphinfer op nodes call the
platform's implementation functions directly instead of through the op.

A graphinfer:: op whose platform kernel is a Python function (platforms' op_impls: they check their inputs, then
call C++ or fall back to the reference) pays the dispatcher's trip into Python on every call: at batch 1 on the
2-core AVX2 dev VM, add_rms_norm costs 10.6 us through the op against 6.6 us calling the function (4.8 us of it the
C++ kernel; tools/cpu_gemv_bench.py's "call_us"), and a SmolLM2 step makes 181 such calls.
The runner's copy of the graph calls the same functions with the same arguments, so results are unchanged; the
engine's graph (artifacts, passes, tooling) keeps its op nodes.

The copy also reads its weights and caches as flat attributes of its own (hoist_attrs): a get_attr of
"model.layers.3.mlp.down_proj.weight" otherwise walks five modules through nn.Module.__getattr__ on every call, ~2,800
such lookups a SmolLM2 decode step (a GGUF step at batch 1 on the 2-vCPU EPYC VM fell from 11.8 to 8.9 ms).
"""
from collections.abc import Callable

from torch import fx

from graphinfer.compiler.trace import HOISTED, with_modules


def bind_op_impls(gm: fx.GraphModule, impls: dict[str, Callable], in_place: bool = False) -> fx.GraphModule:
    """A copy of gm (gm untouched; in_place: gm itself, a copy the caller made) whose graphinfer::<name>.default nodes
    call impls[name] where impls has one."""
    def impl_of(node: fx.Node) -> Callable | None:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "graphinfer":
            return None
        return impls.get(target._schema.name.partition("::")[2]) if target._overloadname == "default" else None

    if not any(impl_of(n) for n in gm.graph.nodes):
        return gm
    copy = gm if in_place else with_modules(gm, {})
    for node in copy.graph.nodes:
        if (fn := impl_of(node)) is not None:
            node.target = fn
    hoist_attrs(copy)
    copy.recompile()
    return copy


def hoist_attrs(gm: fx.GraphModule) -> None:
    """gm's get_attr nodes of nested paths read a plain instance attribute holding the same tensor (found without
    nn.Module.__getattr__). compiler.trace.rebind_buffers knows them, so a re-allocated cache still reaches the
    graph; in-place updates (weights, EPLB's moves, LoRA slots) need nothing: it is the same tensor."""
    hoisted = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "." in node.target:
            flat = "_h_" + node.target.replace(".", "_")
            value = gm
            for name in node.target.split("."):
                value = getattr(value, name)
            gm.__dict__[flat] = value
            hoisted[flat] = node.target
            node.target = flat
    gm.__dict__[HOISTED] = hoisted
