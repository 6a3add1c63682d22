"""The matcher toolkit (graphinfer.passes.match), the fixes it brought (op packets matched, a sliced input in
cleanup, a weight read that fuse_add_rmsnorm must not move down, fuse_qkv with a fourth projection), and the
debugging aids: errors naming the pass, --dump-dir, diff's rewired arguments, --passes for show / diff,
pipelines of names and Pass instances."""
import operator
import os

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import graphinfer.ops  # noqa: F401
from graphinfer import LLM
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.trace import GraphinferTracer, trace_model
from graphinfer.errors import InvalidConfigError
from graphinfer.model_loader import load_model
from graphinfer.passes import DEFAULT_PASSES, Pass, PassError, PassManager, resolve_passes
from graphinfer.compiler import pass_tools as tools
from graphinfer.passes.cleanup import CleanupPass
from graphinfer.passes.fuse_add_rmsnorm import FuseAddRMSNormPass
from graphinfer.passes.fuse_qkv import FuseQKVPass
from graphinfer.passes.match import (arg, get_param, getitem_of, hoist_inputs, is_call, is_method, is_op, is_view,
                                     replace_pattern, single_use, target_name, through_views, used_only_by,
                                     walk_users)

G = torch.ops.graphinfer


def _trace(module: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(module, GraphinferTracer().trace(module))


class _Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x, r):
        h = x + r
        a = G.rms_norm(h, self.w, 1e-6)  # the packet, as a hand-written model or plugin may call it
        parts = torch.topk(a, 2, dim=-1)
        return a.view(-1).reshape(2, -1).contiguous(), parts[1], h.softmax(-1)


def test_matchers():
    gm = _trace(_Norms())
    nodes = {n.name: n for n in gm.graph.nodes}
    norm, add, topk, ids = nodes["rms_norm"], nodes["add"], nodes["topk"], nodes["getitem"]
    assert norm.target is G.rms_norm  # the packet is in the graph
    assert is_op(norm, G.rms_norm) and is_op(norm, G.rms_norm.default) and not is_op(norm, G.add_rms_norm)
    assert is_op(add, operator.add) and not is_op(None, operator.add) and not is_op(3, operator.add)
    assert is_call(nodes["softmax"], F.softmax, "softmax") and is_method(nodes["softmax"], "softmax")
    assert is_call(topk, torch.topk, "topk") and arg(topk, 1, "k") == 2 and arg(topk, 2, "dim") == -1
    assert arg(topk, 3, "largest", True) is True and getitem_of(ids, 1) is topk and getitem_of(ids, 0) is None
    assert get_param(gm, nodes["w"]) is gm.w and get_param(gm, add) is None
    assert target_name(norm) == "graphinfer::rms_norm" and target_name(add) == "add" and target_name(2) == "2"
    assert single_use(add) is False and used_only_by(add, [norm, nodes["softmax"]])
    contiguous = nodes["contiguous"]
    assert is_view(contiguous) and through_views(contiguous) is norm
    assert sorted((u.name, v.name) for u, v in walk_users(norm)) == [
        ("contiguous", "reshape"), ("output", "contiguous"), ("reshape", "view"), ("topk", "rms_norm"),
        ("view", "rms_norm")]
    assert sorted(u.name for u, _ in walk_users(norm, through=lambda n: False)) == ["topk", "view"]


def test_overload_packets_are_matched_by_every_pass():
    """A graph calling torch.ops.graphinfer.<op> (the packet) fuses like the traced one (.default)."""
    def fused(model_name, packets: bool):
        from graphinfer.compiler.compile import check_inputs
        from graphinfer.models.layers import allocate_kv_cache

        model, _ = load_model(model_name, torch.float32)
        allocate_kv_cache(model, 6, 16)
        gm = trace_model(model)
        if packets:
            for n in gm.graph.nodes:
                if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "graphinfer":
                    n.target = n.target.overloadpacket
            gm.recompile()
        return PassManager(resolve_passes("default"), check_inputs(model)).run(gm)

    for name in ("tiny-qwen3", "tiny-qwen3-moe"):
        canonical, packets = fused(name, False), fused(name, True)
        assert [(r.name, r.matches) for r in packets] == [(r.name, r.matches) for r in canonical]
        assert packets.passed and sum(r.matches for r in packets if r.name != "cleanup") > 0


def test_cleanup_merges_sliced_reads():
    class Sliced(nn.Module):
        def forward(self, x):
            return x[:, 1:3] * x[:, 1:3] + x[0, ::2].sum()

    gm = _trace(Sliced())
    [report] = PassManager([CleanupPass()], [(torch.randn(4, 6),)]).run(gm)
    assert report.passed and report.matches == 1 and gm.code.count("x[") == 2


def test_fuse_add_rmsnorm_never_moves_a_weight_read_below_its_first_use():
    class WeightUsedBeforeTheAdd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x, r):
            w = self.w
            scaled = x * w  # the weight's first use, before the residual add
            return G.rms_norm.default(scaled + r, w, 1e-6)

    class WeightReadAfterTheAdd(WeightUsedBeforeTheAdd):
        def forward(self, x, r):
            h = x + r
            return G.rms_norm.default(h, self.w * 2, 1e-6), h  # a computed weight, defined after the add

    x, r = torch.randn(3, 8), torch.randn(3, 8)
    for m in (WeightUsedBeforeTheAdd(), WeightReadAfterTheAdd()):
        gm = _trace(m)
        [report] = PassManager([FuseAddRMSNormPass()], [(x, r)]).run(gm)
        assert report.matches == 1 and report.passed and report.max_abs_error == 0
        assert "add_rms_norm" in gm.code


def test_fuse_qkv_fuses_the_triple_and_notes_a_fourth_projection():
    model, _ = load_model("tiny-llama", torch.float32)
    model.model.layers[0].self_attn.extra = nn.Linear(64, 64)

    def forward_with_extra(self, positions, hidden_states, md):  # a fourth Linear reads the q/k/v input
        out = type(self).forward(self, positions, hidden_states, md)
        return out + self.extra(hidden_states)

    attn = model.model.layers[0].self_attn
    attn.forward = forward_with_extra.__get__(attn)
    gm, reports = compile_model(model, [FuseQKVPass()])
    [r] = reports
    assert r.matches == 2 and r.passed
    assert any("also feeds ['model.layers.0.self_attn.extra'], left unfused" in d for d in r.declined)
    assert "self_attn.extra(" in gm.code and "layers_0_self_attn_q_proj" not in gm.code


def test_hoist_inputs_refuses_to_move_a_side_effect():
    class M(nn.Module):
        def forward(self, k, cache, slots):
            G.reshape_and_cache.default(k, k, cache, cache, slots)
            return k * 2

    gm = _trace(M())
    write = next(n for n in gm.graph.nodes if is_op(n, G.reshape_and_cache))
    mul = next(n for n in gm.graph.nodes if is_op(n, operator.mul))
    mul.args = (mul.args[0], write)  # nonsense on purpose: the multiply reads the write's result ...
    write.prepend(mul)               # ... before the write: fixing that would move the write up
    with pytest.raises(ValueError, match="side effects"):
        hoist_inputs(gm.graph)


def test_replace_pattern_counts_and_matches_packets():
    def pattern(x, w):
        return G.rms_norm.default(F.silu(x), w, 1e-6)

    def replacement(x, w):
        return G.rms_norm.default(x * torch.sigmoid(x), w, 1e-6)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(8))

        def forward(self, x):
            return G.rms_norm(F.silu(x), self.w, 1e-6) + G.rms_norm.default(F.silu(x + 1), self.w, 1e-6)

    gm = _trace(M())
    x = torch.randn(2, 8)
    before = gm(x)
    assert replace_pattern(gm, pattern, replacement) == 2
    gm.recompile()
    assert "silu" not in gm.code and torch.allclose(gm(x), before, atol=1e-6)


# ----- debugging -----

class _Raises(Pass):
    name = "raises"

    def apply(self, gm):
        raise KeyError("no such node")


class _BreaksLint(Pass):
    name = "breaks_lint"

    def apply(self, gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = next(n for n in gm.graph.nodes if n.op == "call_module")
        with gm.graph.inserting_before(first):
            gm.graph.call_function(torch.neg, (out.args[0],))  # uses the result before it exists
        return 1


def test_errors_inside_a_pass_name_it_and_dump_the_broken_graph(tmp_path):
    with pytest.raises(PassError, match=r"pass 'raises' failed in apply\(\): KeyError: 'no such node' at .*"
                                        r"test_pass_toolkit.py:\d+ in apply"):
        tools.verify("tiny-llama", [_Raises()])
    with pytest.raises(PassError, match=r"pass 'breaks_lint' failed in graph.lint\(\) after apply\(\)"):
        tools.verify("tiny-llama", ["fuse_qkv", _BreaksLint()], dump_dir=str(tmp_path))
    assert {"00-traced.py", "00-traced.txt", "01-fuse_qkv.py", "02-breaks_lint.failed.txt"} <= set(os.listdir(tmp_path))
    assert "neg" in (tmp_path / "02-breaks_lint.failed.txt").read_text()


def test_dump_dir_writes_every_stage(tmp_path):
    tools.verify("tiny-qwen3", "default", dump_dir=str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    assert names[0] == "00-traced.py" and f"{len(DEFAULT_PASSES):02d}-cleanup.py" in names
    assert "qkv_proj" in (tmp_path / f"{DEFAULT_PASSES.index('fuse_qkv') + 1:02d}-fuse_qkv.py").read_text()
    assert "add_rms_norm" in (tmp_path / f"{DEFAULT_PASSES.index('fuse_add_rmsnorm') + 1:02d}-fuse_add_rmsnorm.txt").read_text()


def test_diff_shows_arguments_and_rewired_nodes_show_takes_pipelines():
    d = tools.diff("tiny-qwen3", "fuse_add_rmsnorm")
    assert "canon_transpose -> fuse_qkv -> fuse_qknorm_rope -> fuse_gate_up: 4 matches" in d
    assert "+ %add_rms_norm_default = graphinfer::add_rms_norm(%model_embed_tokens, " in d
    assert "- %add = add(%model_embed_tokens, %model_layers_0_self_attn_o_proj)" in d
    assert "## rewired (kept, arguments changed)" in d and "now %model_layers_0_mlp_gate_up_proj" in d
    d = tools.diff("tiny-qwen3", "fuse_qkv", passes="fuse_gate_up,fuse_qkv")
    assert "fuse_qkv after fuse_gate_up: 2 matches" in d
    d = tools.diff("tiny-qwen3", "cleanup", passes="none")
    assert "cleanup on the traced graph" in d
    s = tools.show("tiny-llama", passes="fuse_qkv,fuse_gate_up")
    assert "after fuse_qkv -> fuse_gate_up" in s and "gate_up_proj" in s and "add_rms_norm" not in s
    s = tools.show("tiny-llama", after="fuse_gate_up", passes="fuse_gate_up,fuse_add_rmsnorm")
    assert "graph after fuse_gate_up," in s


def test_pipelines_take_names_defaults_instances_and_classes():
    names = lambda spec: [p.name for p in resolve_passes(spec)]  # noqa: E731
    assert names("default,cleanup") == [*DEFAULT_PASSES, "cleanup"]
    assert names("none") == [] and names(None) == list(DEFAULT_PASSES)
    mine = FuseQKVPass()
    assert resolve_passes(["default", mine])[-1] is mine
    assert names([FuseAddRMSNormPass, "cleanup"]) == ["fuse_add_rmsnorm", "cleanup"]
    with pytest.raises(InvalidConfigError, match="neither a pass name nor"):
        resolve_passes([42])
    with pytest.raises(InvalidConfigError, match=r"Unknown pass\(es\) \['nope'\]"):
        resolve_passes("default,nope")
    llm = LLM("tiny-llama", passes=["fuse_qkv", FuseAddRMSNormPass(), CleanupPass], num_gpu_blocks_override=32)
    reports = llm.llm_engine.worker.compiled.pass_reports
    assert [r.name for r in reports] == ["fuse_qkv", "fuse_add_rmsnorm", "cleanup"]
    assert all(r.matches > 0 and r.check is not None and r.check.passed for r in reports), reports.failures()
    assert reports.end_to_end is not None and reports.end_to_end.passed  # checked, not vacuously passed


def test_a_pass_instance_reused_reports_only_its_own_run():
    p = FuseQKVPass()
    model, _ = load_model("tiny-llama", torch.float32)
    for _ in range(2):
        gm = _trace(model)
        p.decline("stale")
        [r] = PassManager([p]).run(gm)
        assert r.declined == []
