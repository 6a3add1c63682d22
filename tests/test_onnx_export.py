"""export_onnx: a checker-valid ONNX view of a traced graph, one ONNX node per fx compute node, no weight data."""
import operator
from collections import Counter

import onnx
import pytest
import torch
from onnx import TensorProto
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers torch.ops.graphinfer.*)
from graphinfer.compiler.onnx_export import export_onnx
from graphinfer.compiler.trace import GraphinferTracer, node_target_name, trace_model
from graphinfer.model_loader import load_model


def _is_multi_output(n: fx.Node) -> bool:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return len(t._schema.returns) > 1
    return n.op == "call_method" and t == "split"


def _is_wiring(n: fx.Node) -> bool:
    """getitem on a tuple-producing node, or md.<field>: edges in ONNX, not nodes."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return _is_multi_output(n.args[0])
    return n.target is getattr and n.args[0].op == "placeholder"


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _export_and_check(gm: fx.GraphModule, path) -> onnx.ModelProto:
    model = export_onnx(gm, str(path))
    loaded = onnx.load(str(path))
    onnx.checker.check_model(loaded)
    assert loaded == model
    assert len(model.graph.initializer) == 0  # weights are typed inputs, never data
    assert {o.domain for o in model.opset_import} >= {"", "graphinfer"}

    calls = ("call_module", "call_function", "call_method")
    compute = [n for n in gm.graph.nodes if n.op in calls and not _is_wiring(n)]
    assert [n.name for n in model.graph.node] == [n.name for n in compute]  # one each, in graph order

    by_name = {n.name: n for n in model.graph.node}
    for g in gm.graph.nodes:  # getitem k of a multi-output node: every consumer reads the producer's output k
        if g.op == "call_function" and g.target is operator.getitem and _is_wiring(g):
            out = by_name[g.args[0].name].output[g.args[1]]
            for user in g.users:
                if user.op != "output":
                    assert out in by_name[user.name].input, (g, user)
    return model


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_export_traced_model(preset, tmp_path):
    model, _ = load_model(preset, torch.float32)
    gm = trace_model(model)
    onnx_model = _export_and_check(gm, tmp_path / "g.onnx")

    fx_ops = Counter(node_target_name(n).split("::")[1] for n in gm.graph.nodes
                     if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "graphinfer")
    onnx_ops = Counter(n.op_type for n in onnx_model.graph.node if n.domain == "graphinfer")
    assert onnx_ops == fx_ops
    assert {"rms_norm", "rotary_embedding", "paged_attention", "reshape_and_cache"} <= set(fx_ops)

    kinds = Counter((n.domain, n.op_type) for n in onnx_model.graph.node)
    linears = sum(isinstance(gm.get_submodule(n.target), nn.Linear) for n in gm.graph.nodes if n.op == "call_module")
    assert kinds["", "Gemm"] == linears and kinds["", "Gather"] == 1

    inputs = {i.name: i for i in onnx_model.graph.input}
    for name in ("input_ids", "positions", "md.slot_mapping"):
        assert inputs[name].type.tensor_type.elem_type == TensorProto.INT64 and _dims(inputs[name]) == ["T"]
    assert _dims(inputs["md.block_tables"])[0] == "B"
    emb = inputs["model.embed_tokens.weight"]
    assert _dims(emb) == list(model.model.embed_tokens.weight.shape)
    assert emb.type.tensor_type.elem_type == TensorProto.FLOAT

    rope = next(n for n in onnx_model.graph.node if n.op_type == "rotary_embedding")
    assert len(rope.output) == 2 and {a.name for a in rope.attribute} == {"head_size", "is_neox"}
    cache_write = next(n for n in onnx_model.graph.node if n.op_type == "reshape_and_cache")
    assert len(cache_write.output) == 0 and "md.slot_mapping" in cache_write.input


class _FusedBlock(nn.Module):
    """What the fusion passes produce: one qkv Linear + split, add_rms_norm's two outputs, silu_and_mul."""

    def __init__(self, hidden=16, q=8, kv=4, inter=24):
        super().__init__()
        self.sizes = [q, kv, kv]
        self.qkv_proj = nn.Linear(hidden, q + 2 * kv, bias=True)
        self.o_proj = nn.Linear(q, hidden, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, residual):
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        attn = self.o_proj(q * k.sum(-1, keepdim=True) + v.mean())
        h, residual = torch.ops.graphinfer.add_rms_norm.default(attn, residual, self.norm_weight, 1e-6)
        mlp = self.down_proj(torch.ops.graphinfer.silu_and_mul.default(self.gate_up_proj(h)))
        return mlp + residual


def test_export_fused_graph(tmp_path):
    m = _FusedBlock()
    gm = fx.GraphModule(m, GraphinferTracer().trace(m))
    x = torch.randn(3, 16)
    torch.testing.assert_close(gm(x, x), m(x, x))  # the hand-built graph is a real one
    onnx_model = _export_and_check(gm, tmp_path / "fused.onnx")

    nodes = {n.op_type: n for n in onnx_model.graph.node}
    split, norm = nodes["Split"], nodes["add_rms_norm"]
    assert nodes["Gemm"].domain == "" and split.domain == "torch" and norm.domain == "graphinfer"
    assert len(split.output) == 3 and len(norm.output) == 2
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute}
    assert attrs == {"split": [8, 4, 4], "axis": -1}
    assert {a.name: onnx.helper.get_attribute_value(a) for a in norm.attribute}["eps"] == pytest.approx(1e-6)

    by_name = {n.name: n for n in onnx_model.graph.node}
    qkv = by_name["qkv_proj"]
    assert qkv.input == ["x", "qkv_proj.weight", "qkv_proj.bias"] and qkv.attribute[0].name == "transB"
    gate_up = by_name["gate_up_proj"]
    assert list(gate_up.input)[0] == norm.output[0]  # add_rms_norm[0] (normed) feeds the MLP
    final_add = onnx_model.graph.node[-1]
    assert final_add.op_type == "Add" and final_add.input[1] == norm.output[1]  # [1] (residual) skips it
    assert nodes["silu_and_mul"].domain == "graphinfer" and nodes["silu_and_mul"].input == gate_up.output
    assert [o.name for o in onnx_model.graph.output] == [final_add.output[0]]
    inputs = {i.name: _dims(i) for i in onnx_model.graph.input}
    assert inputs["qkv_proj.weight"] == [16, 16] and inputs["norm_weight"] == [16]
