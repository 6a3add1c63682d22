"""fuse_allreduce_add_rmsnorm: on a rank's graph at tp 2 it fuses the two all-reduces of every decoder layer with
the add_rms_norm they feed, on every model family, and leaves the embedding's; it takes the all-reduce in either
argument position; it declines an all-reduce with other users; at tp 1 it finds nothing; the cpu Inductor lowering
keeps the collective a call and inlines the add + norm. Pattern tests build one rank's graph in-process
(parallel_state.layout, no process group); the numeric check (fused == unfused, bit for bit) needs real
collectives, so it is asserted in tests/test_tensor_parallel.py's tp-2 engines (gloo, two processes)."""
import operator

import pytest
import torch
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers the ops)
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.inductor import inline_pointwise_ops
from graphinfer.compiler.trace import GraphinferTracer, op_histogram
from graphinfer.distributed import parallel_state as ps
from graphinfer.model_loader import load_model
from graphinfer.passes import PassManager, resolve_passes
from graphinfer.passes.fuse_allreduce_add_rmsnorm import FuseAllReduceAddRMSNormPass

G = torch.ops.graphinfer
NAME = FuseAllReduceAddRMSNormPass.name


def _report(reports):
    return next(r for r in reports if r.name == NAME)


def _compile(preset: str, tp: int):
    """(graph, reports, num_layers) of rank 0's model under the default passes, unchecked (no process group)."""
    with ps.layout(0, tp):
        model, config = load_model(preset, torch.float32)
        gm, reports = compile_model(model, resolve_passes("default"), check=False)
    return gm, reports, config.num_hidden_layers


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_fuses_two_per_layer_at_tp2(preset):
    gm, reports, layers = _compile(preset, 2)
    r = _report(reports)
    assert r.matches == 2 * layers and r.declined == []
    hist = op_histogram(gm)
    assert hist["graphinfer::all_reduce_add_rms_norm"] == 2 * layers and "graphinfer::add_rms_norm" not in hist
    # Left: the vocab-parallel embedding's all-reduce, read by the first rms_norm and the first residual add.
    [embed] = [n for n in gm.graph.nodes if n.target is G.all_reduce.default]
    assert {n.target for n in embed.users} == {G.rms_norm.default, G.all_reduce_add_rms_norm.default}
    if preset == "tiny-qwen3-moe":  # fuse_moe runs after this pass and still matches; its output is reduced
        assert hist["graphinfer::fused_moe"] == layers
        assert all(next(iter(n.users)).target is G.all_reduce_add_rms_norm.default
                   for n in gm.graph.nodes if n.target is G.fused_moe.default)


def test_tp1_graph_has_nothing_to_fuse():
    gm, reports, _ = _compile("tiny-llama", 1)
    assert _report(reports).matches == 0 and _report(reports).declined == []
    hist = op_histogram(gm)
    assert "graphinfer::all_reduce" not in hist and "graphinfer::all_reduce_add_rms_norm" not in hist


class _Block(nn.Module):
    """all_reduce(x) added to a residual (in either order) and RMSNormed; optionally the reduced sum is also
    returned (a second user)."""

    def __init__(self, reduced_first: bool, leak: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8))
        self.reduced_first, self.leak = reduced_first, leak

    def forward(self, x, residual):
        h = G.all_reduce(x, "tp")
        a, b = (h, residual) if self.reduced_first else (residual, h)
        out = G.add_rms_norm(a, b, self.weight, 1e-6)
        return (out[0], out[1], h) if self.leak else (out[0], out[1])


def _trace(module: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(module, GraphinferTracer().trace(module))


@pytest.mark.parametrize("reduced_first", [False, True])
def test_either_argument_order(reduced_first):
    gm = _trace(_Block(reduced_first))
    [report] = PassManager([FuseAllReduceAddRMSNormPass()]).run(gm)
    assert report.matches == 1
    [fused] = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is G.all_reduce_add_rms_norm.default]
    x, residual, weight = (n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr"))
    assert fused.args == (x, residual, weight, 1e-6, "tp")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert [(o.args[0], o.args[1]) for o in out.args[0]] == [(fused, 0), (fused, 1)]
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [G.all_reduce_add_rms_norm.default, operator.getitem, operator.getitem]  # the pair is gone


def test_cpu_inductor_lowering_inlines_the_add_and_norm():
    gm = _trace(_Block(reduced_first=False))
    PassManager([FuseAllReduceAddRMSNormPass()]).run(gm)
    calls = [n for n in inline_pointwise_ops(gm).graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [G.all_reduce.default, G.add_rms_norm.default.reference, operator.getitem,
                                         operator.getitem]
    assert calls[1].args[0] is calls[0] and calls[0].args[1] == "tp"


class _Twice(nn.Module):
    """One all-reduce added to itself."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8))

    def forward(self, x):
        h = G.all_reduce(x, "tp")
        out = G.add_rms_norm(h, h, self.weight, 1e-6)
        return out[0], out[1]


@pytest.mark.parametrize("module, readers", [(lambda: _Block(reduced_first=False, leak=True), "['output']"),
                                             (_Twice, "['both addends']")])
def test_declines_an_all_reduce_with_other_users(module, readers):
    gm = _trace(module())
    before = str(gm.graph)
    [report] = PassManager([FuseAllReduceAddRMSNormPass()]).run(gm)
    assert report.matches == 0 and str(gm.graph) == before
    assert report.declined == [f"add_rms_norm: the all-reduce it adds is also read by {readers}; left unfused"]
