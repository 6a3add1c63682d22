"""compiler/bind_ops.py: the runner's copy of an eager graph calls the platform's op functions directly."""
import torch
from torch import fx, nn

from graphinfer.compiler.bind_ops import bind_op_impls
from graphinfer.compiler.trace import GraphinferTracer
from graphinfer.ops.activation import silu_and_mul
from graphinfer.ops.norm import rms_norm


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return rms_norm(silu_and_mul(x), self.weight, 1e-6)  # the ops' default overloads, as models call them


def test_bound_graph_calls_the_impls_and_the_original_keeps_its_ops():
    model = Block()
    gm = fx.GraphModule(model, GraphinferTracer().trace(model))
    calls = []

    def rms_norm_impl(x, weight, eps):
        calls.append("rms_norm")
        return rms_norm.reference(x, weight, eps)

    bound = bind_op_impls(gm, {"rms_norm": rms_norm_impl})  # silu_and_mul: no impl given, stays an op
    x = torch.randn(3, 64)
    torch.testing.assert_close(bound(x), gm(x))
    assert calls == ["rms_norm"]
    targets = {n.target for n in bound.graph.nodes if n.op == "call_function"}
    assert rms_norm_impl in targets and silu_and_mul in targets and rms_norm not in targets
    assert rms_norm in {n.target for n in gm.graph.nodes}  # the engine's graph untouched
    assert bind_op_impls(gm, {}) is gm



class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(Block())
        self.inner[0].register_buffer("cache", torch.zeros(32))

    def forward(self, x):
        block = self.inner[0]
        return rms_norm(silu_and_mul(x), block.weight, 1e-6) + block.cache


def test_bound_graph_reads_nested_weights_as_its_own_attributes_and_follows_rebound_buffers():
    from graphinfer.compiler.trace import rebind_buffers

    model = Outer()
    gm = fx.GraphModule(model, GraphinferTracer().trace(model))
    bound = bind_op_impls(gm, {"rms_norm": rms_norm.reference})
    reads = [n.target for n in bound.graph.nodes if n.op == "get_attr"]
    assert reads and all("." not in t for t in reads)  # no walk through nn.Module.__getattr__ per call
    x = torch.randn(3, 64)
    torch.testing.assert_close(bound(x), gm(x))
    with torch.no_grad():
        model.inner[0].weight.mul_(2)  # in place (a weight update, EPLB's moves): the same tensor
    torch.testing.assert_close(bound(x), model(x))
    model.inner[0].cache = torch.ones(32)  # re-allocated (the KV cache after profiling): rebound by path
    rebind_buffers(model, bound)
    torch.testing.assert_close(bound(x), model(x))
