"""Pass-developer tooling: a plugin pass registered through the `graphinfer.passes` entry point, and the
`graphinfer passes list | show | diff | verify` commands."""
import os
import subprocess
import sys

import pytest

from graphinfer.compiler import pass_tools as tools
from graphinfer.passes import DEFAULT_PASSES, available_passes, resolve_passes

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")

PLUGIN = '''
import torch
import torch.nn.functional as F
from graphinfer.passes import Pass


class SiluToSigmoidMul(Pass):
    """silu(x) -> x * sigmoid(x): a throwaway rewrite to show a plugin pass runs."""
    name = "silu_to_sigmoid_mul"
    description = "silu(x) -> x * sigmoid(x) (test plugin)"

    def apply(self, gm):
        matches = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is F.silu:
                with gm.graph.inserting_before(node):
                    sig = gm.graph.call_function(torch.sigmoid, (node.args[0],))
                    prod = gm.graph.call_function(torch.mul, (node.args[0], sig))
                node.replace_all_uses_with(prod)
                gm.graph.erase_node(node)
                matches += 1
        return matches
'''


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A throwaway installed package: module + dist-info with an entry point, as pip would leave it."""
    (tmp_path / "graphinfer_test_plugin.py").write_text(PLUGIN)
    info = tmp_path / "graphinfer_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: graphinfer-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[graphinfer.passes]\nsilu_to_sigmoid_mul = graphinfer_test_plugin:SiluToSigmoidMul\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_pass_is_discovered_listed_and_runs(plugin_path):
    info = available_passes()["silu_to_sigmoid_mul"]
    assert info.origin == "plugin (graphinfer-test-plugin 0.1)"
    assert ("silu_to_sigmoid_mul | silu(x) -> x * sigmoid(x) (test plugin) | plugin (graphinfer-test-plugin 0.1)"
            in tools.list_passes())
    text, reports = tools.verify("tiny-llama", "silu_to_sigmoid_mul", dtype="float32")
    assert reports[0].matches == 2 and reports[0].max_rel_error < 1e-6 and reports[0].passed
    # through the real console script, found via the entry point on PYTHONPATH
    env = dict(os.environ, PYTHONPATH=str(plugin_path))
    out = subprocess.run([BIN, "passes", "list"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "plugin (graphinfer-test-plugin 0.1)" in out.stdout
    # it composes with the built-ins in an engine
    from graphinfer import LLM

    llm = LLM("tiny-llama", passes="silu_to_sigmoid_mul,fuse_qkv,cleanup")
    assert [r.name for r in llm.llm_engine.worker.compiled.pass_reports] == ["silu_to_sigmoid_mul", "fuse_qkv", "cleanup"]
    assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_broken_plugin_is_a_clear_error_only_where_it_is_asked_for(tmp_path, monkeypatch):
    from graphinfer.errors import InvalidConfigError

    (tmp_path / "bad_plugin.py").write_text("NotAPass = 42\n")
    info = tmp_path / "bad_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[graphinfer.passes]\nbad = bad_plugin:NotAPass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert len(resolve_passes("default")) == len(DEFAULT_PASSES)  # the broken plugin is not even imported
    with pytest.raises(InvalidConfigError, match="bad-plugin 0.1.*is 42, not a graphinfer.passes.Pass subclass"):
        resolve_passes("default,bad")


def test_show_diff_verify():
    traced = tools.show("tiny-qwen3")
    assert "as traced (no passes)" in traced and "q_proj" in traced and "| graphinfer::rms_norm | 9 |" in traced
    after = tools.show("tiny-qwen3", after="fuse_qkv")
    assert "after canon_rms_norm -> canon_rotary -> canon_transpose -> fuse_qkv" in after and "qkv_proj" in after \
        and "self_attn.q_proj(" not in after
    d = tools.diff("tiny-qwen3", "fuse_add_rmsnorm")
    assert "canon_transpose -> fuse_qkv -> fuse_qknorm_rope -> fuse_gate_up" in d and "4 matches" in d
    assert "+ %add_rms_norm_default = graphinfer::add_rms_norm(" in d
    text, reports = tools.verify("tiny-qwen2")
    assert [r.name for r in reports] == ["canon_rms_norm", "canon_rotary", "canon_transpose", "fuse_qkv", "fuse_qknorm_rope", "fuse_gate_up", "fuse_add_rmsnorm",
                                         "fuse_allreduce_add_rmsnorm", "fuse_moe", "absorb_mla", "lower_quant_linears", "fuse_rmsnorm_quant",
                                         "fuse_silu_mul_quant", "cleanup"]
    assert all(r.max_abs_error <= 1e-5 for r in reports) and "| fuse_qkv | 2 |" in text
    assert reports.passed and reports.end_to_end.max_abs_error <= 1e-5 and "all checks passed" in text


def test_cli_passes_verify_with_onnx(tmp_path):
    import onnx

    out = subprocess.run([BIN, "passes", "verify", "tiny-qwen3", "--onnx", str(tmp_path / "g.onnx")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| fuse_qkv | 2 |" in out.stdout
    model = onnx.load(str(tmp_path / "g.onnx"))
    onnx.checker.check_model(model)
    assert any(n.domain == "graphinfer" and n.op_type == "add_rms_norm" for n in model.graph.node)


def test_cli_unknown_pass(tmp_path):
    out = subprocess.run([BIN, "passes", "diff", "tiny-llama", "--pass", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Unknown pass" in out.stderr


