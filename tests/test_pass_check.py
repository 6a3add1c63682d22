"""The numeric check as a gate: per pass and end to end, NaN/inf-aware, over pytree outputs, dtype-aware
tolerances; `passes verify` exits non-zero and `compile` refuses a failing artifact; the presets expose
wrong passes (random norm gains, models that do not just repeat a token)."""
import json
import logging
import math
import operator
import os

import pytest
import torch
from torch import fx, nn

import graphinfer.ops  # noqa: F401
from graphinfer import LLM, SamplingParams
from graphinfer.cli import main
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.trace import GraphinferTracer
from graphinfer.model_loader import load_model
from graphinfer.compiler import pass_tools as tools
from graphinfer.passes import Pass, PassManager, resolve_passes
from graphinfer.passes.check import compare, default_tolerances
from graphinfer.passes.match import hoist_inputs, is_op
from plugin_utils import make_dist

G = torch.ops.graphinfer

# A deliberately wrong pass: Qwen3's q_norm and k_norm trade weights (same shape, so it runs).
WRONG_PLUGIN = '''
import torch
from graphinfer.passes import Pass
from graphinfer.passes.match import hoist_inputs, is_op


class SwapQKNorm(Pass):
    name = "swap_qk_norm"
    description = "wrong on purpose: q_norm and k_norm trade weights"

    def apply(self, gm):
        norms = [n for n in gm.graph.nodes if is_op(n, torch.ops.graphinfer.rms_norm)
                 and n.args[1].target.endswith(("q_norm.weight", "k_norm.weight"))]
        for q, k in zip(norms[::2], norms[1::2]):
            q.args, k.args = (q.args[0], k.args[1], q.args[2]), (k.args[0], q.args[1], k.args[2])
        hoist_inputs(gm.graph)
        # After the default pipeline the norms are inside qk_norm_rope(_cache) (args 4 and 5: q_weight, k_weight).
        fused = [n for n in gm.graph.nodes
                 if is_op(n, torch.ops.graphinfer.qk_norm_rope, torch.ops.graphinfer.qk_norm_rope_cache)]
        for n in fused:
            n.args = (*n.args[:4], n.args[5], n.args[4], *n.args[6:])
        return len(norms) // 2 + len(fused)
'''


@pytest.fixture
def wrong_plugin(tmp_path, monkeypatch):
    make_dist(tmp_path, "graphinfer-wrong-pass", {"graphinfer_wrong_pass": WRONG_PLUGIN},
              {"swap_qk_norm": "graphinfer_wrong_pass:SwapQKNorm"})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _swap_qk_norm():
    [p] = resolve_passes("swap_qk_norm")
    return p


# ----- compare(): the rules -----

def test_compare_keeps_a_nan_in_a_later_step_and_agreeing_nonfinite_values():
    a = torch.tensor([1.0, 2.0, float("nan"), float("inf")])
    ok = compare([a, a], [a.clone(), a.clone()])
    assert ok.passed and ok.max_abs_error == 0 and ok.nonfinite == 0  # both NaN, same inf: agree
    bad_step2 = a.clone()
    bad_step2[0] = float("nan")
    r = compare([a, a], [a.clone(), bad_step2])  # the first step is fine, the second has a NaN
    assert not r.passed and r.nonfinite == 1 and math.isnan(r.max_abs_error)
    assert "NaN/inf" in r.why()
    flipped = a.clone()
    flipped[3] = -float("inf")
    assert compare([a], [flipped]).nonfinite == 1


def test_compare_walks_pytrees_and_reports_mismatches():
    x = torch.randn(3, 4)
    ref = [{"h": x, "pair": (x * 2, 7)}]
    assert compare(ref, [{"h": x.clone(), "pair": (x * 2, 7)}]).passed
    r = compare(ref, [{"h": x + 1, "pair": (x * 2, 7)}])
    assert not r.passed and r.max_abs_error == pytest.approx(1.0)
    assert "output 2: 7 -> 8" in compare(ref, [{"h": x, "pair": (x * 2, 8)}]).mismatch
    assert "structure changed" in compare(ref, [(x, x * 2, 7)]).mismatch
    assert "torch.float32[3, 4] -> torch.float32[4, 3]" in compare([x], [x.t()]).mismatch
    assert "-> torch.bfloat16" in compare([x], [x.bfloat16()]).mismatch


def test_tolerances_depend_on_dtype_and_can_be_set():
    assert default_tolerances(torch.float32) == (1e-4, 1e-4)
    assert default_tolerances(torch.bfloat16) == (1e-2, 5e-2)
    x = torch.randn(64, 64) * 10
    noisy = x + 1e-3 * x.abs().max()  # 1e-3 relative: fine for bf16, not for fp32
    assert not compare([x], [noisy]).passed
    assert compare([x.bfloat16()], [noisy.bfloat16()]).passed
    assert compare([x], [noisy], rtol=2e-3).passed and compare([x], [noisy], atol=1.0).passed


# ----- the manager: per pass, end to end, tuples, NaN -----

class _TwoOutputs(nn.Module):
    def forward(self, x, scale):
        h = x * scale
        return h.relu(), (h + 1, {"sum": h.sum()})


class _ScaleByNanLater(Pass):
    """Multiplies the first output by NaN where scale > 1: only the second check step sees it."""
    name = "nan_later"

    def apply(self, gm):
        relu = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "relu")
        scale = next(n for n in gm.graph.nodes if n.target == "scale")
        with gm.graph.inserting_before(relu.next):
            later = gm.graph.call_function(operator.gt, (scale, 1.0))
            bad = gm.graph.call_function(torch.where, (later, float("nan"), 1.0))
            out = gm.graph.call_function(torch.mul, (relu, bad))
        relu.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
        return 1


class _Identity(Pass):
    name = "identity"

    def apply(self, gm):
        return 0


def test_manager_checks_tuple_outputs_and_catches_a_nan_in_the_second_step():
    gm = fx.GraphModule(_TwoOutputs(), GraphinferTracer().trace(_TwoOutputs()))
    x = torch.randn(4, 8)
    steps = [(x, torch.tensor(1.0)), (x, torch.tensor(2.0))]
    reports = PassManager([_Identity(), _ScaleByNanLater(), _Identity()], steps).run(gm)
    assert [r.passed for r in reports] == [True, False, True]
    bad = reports[1]
    assert bad.nonfinite > 0 and math.isnan(bad.max_abs_error)
    assert reports.end_to_end is not None and not reports.end_to_end.passed
    assert not reports.passed and any(f.startswith("nan_later:") for f in reports.failures())
    assert any(f.startswith("end-to-end") for f in reports.failures())


def test_the_q_k_norm_weight_swap_is_caught_on_the_presets(wrong_plugin):
    for preset in ("tiny-qwen3", "tiny-qwen3-moe"):
        text, reports = tools.verify(preset, "default,swap_qk_norm")
        swap = reports[-1]
        assert swap.name == "swap_qk_norm" and swap.matches == 2 and swap.passed is False, text
        assert swap.max_rel_error > 1e-2 and not reports.end_to_end.passed
        assert all(r.passed for r in reports[:-1])
    # With unit norm gains (the old presets) the same wrong pass is invisible:
    model, _ = load_model("tiny-qwen3", torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    _, reports = compile_model(model, [_swap_qk_norm()])
    assert reports[0].max_abs_error == 0 and reports.passed


def test_verify_cli_exits_non_zero_on_a_failing_pass(wrong_plugin, capsys):
    rc = main(["passes", "verify", "tiny-qwen3", "--passes", "default,swap_qk_norm"])
    out = capsys.readouterr()
    assert rc == 1 and "CHECK FAILED" in out.out and "| swap_qk_norm | 2 |" in out.out
    assert "numeric check failed" in out.err and "swap_qk_norm: max abs error" in out.err
    assert "end-to-end (fused vs unfused)" in out.err
    # Tolerances are options: loose enough, the same pipeline passes.
    assert main(["passes", "verify", "tiny-qwen3", "--passes", "default,swap_qk_norm", "--rtol", "10"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_compile_refuses_a_failing_artifact_unless_overridden(wrong_plugin, tmp_path, capsys):
    art = str(tmp_path / "art")
    rc = main(["compile", "tiny-qwen3", "--dtype", "float32", "--passes", "default,swap_qk_norm", "-o", art])
    err = capsys.readouterr().err
    assert rc == 2 and "no artifact was written" in err and "swap_qk_norm: max abs error" in err
    assert not os.path.exists(os.path.join(art, "manifest.json"))
    rc = main(["compile", "tiny-qwen3", "--dtype", "float32", "--passes", "default,swap_qk_norm", "-o", art, "--allow-check-failure"])
    out = capsys.readouterr()
    assert rc == 0 and "written anyway" in out.err
    manifest = json.load(open(os.path.join(art, "manifest.json")))
    assert manifest["check"]["overridden"] is True and manifest["check"]["passed"] is False
    assert any(f.startswith("swap_qk_norm") for f in manifest["check"]["failures"])
    assert manifest["end_to_end_check"]["passed"] is False
    assert [p["passed"] for p in manifest["passes"]][-1] is False
    assert "numeric check FAILED, artifact written anyway" in open(os.path.join(art, "report.txt")).read()
    # ... and tolerances loose enough make it a passing artifact.
    assert main(["compile", "tiny-qwen3", "--dtype", "float32", "--passes", "default,swap_qk_norm", "-o", art, "--rtol", "10"]) == 0
    manifest = json.load(open(os.path.join(art, "manifest.json")))
    assert manifest["check"] == {"passed": True, "failures": [], "atol": 1e-4, "rtol": 10.0, "overridden": False}


def test_llm_declines_a_pass_that_fails_its_check(wrong_plugin, caplog):
    """A failed check is not served silently: the graph is compiled without the pass, which its report records as
    declined (issue 55); keep_failed_passes=True runs it anyway, loudly, as before."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [3, 14, 15, 92, 65]}]
    with caplog.at_level(logging.WARNING, logger="graphinfer.compiler.pipeline"):
        llm = LLM("tiny-qwen3", passes="default,swap_qk_norm", num_gpu_blocks_override=64)
    reports = llm.llm_engine.worker.compiled.pass_reports
    swap = reports[-1]
    assert reports.passed and swap.name == "swap_qk_norm" and swap.matches == 0 and swap.passed is None
    assert swap.declined and "numeric check failed" in swap.declined[0] and "max abs error" in swap.declined[0]
    assert "pass swap_qk_norm declined: its numeric check failed" in caplog.text
    assert "beyond the check's tolerances" not in caplog.text
    got = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    want = LLM("tiny-qwen3", num_gpu_blocks_override=64).generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want  # what the default passes alone give
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="graphinfer.compiler.pipeline"):
        llm = LLM("tiny-qwen3", passes="default,swap_qk_norm", num_gpu_blocks_override=64, keep_failed_passes=True)
    assert not llm.llm_engine.worker.compiled.pass_reports.passed
    assert "swap_qk_norm: max abs error" in caplog.text and "declined" not in caplog.text


def test_end_to_end_and_bf16_tolerances_in_verify():
    text, reports = tools.verify("tiny-qwen3", "default", dtype="bfloat16")
    e2e = reports.end_to_end
    assert reports.passed and e2e.dtype == "bfloat16" and (e2e.atol, e2e.rtol) == (1e-2, 5e-2)
    assert "| end-to-end (fused vs unfused) |" in text and "(bfloat16 outputs)" in text


# ----- presets that expose bugs -----

class _ZeroAttention(Pass):
    """Wrong on purpose: every attention output becomes zeros."""
    name = "zero_attention"

    def apply(self, gm):
        n = 0
        for node in list(gm.graph.nodes):
            if is_op(node, G.paged_attention):
                with gm.graph.inserting_after(node):
                    zero = gm.graph.call_function(torch.zeros_like, (node,))
                node.replace_all_uses_with(zero, delete_user_cb=lambda user: user is not zero)
                n += 1
        return n


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [100, 7, 300, 9], [42], [17, 18, 19, 20, 21, 22, 23]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_presets_generate_from_their_context(preset):
    llm = LLM(preset, passes="none", num_gpu_blocks_override=64)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert len({tuple(t) for t in tokens}) == len(PROMPTS), tokens  # different prompts, different outputs
    assert all(len(set(t)) > 1 for t in tokens), tokens  # not one token repeated
    assert all(t[0] != p[-1] for t, p in zip(tokens, PROMPTS)), tokens  # not an echo of the last token
    # A pass that breaks attention changes the greedy tokens (and fails the check; kept: LLM would decline it).
    broken = LLM(preset, passes=[_ZeroAttention()], num_gpu_blocks_override=64, keep_failed_passes=True)
    assert not broken.llm_engine.worker.compiled.pass_reports.passed
    assert [o.outputs[0].token_ids for o in broken.generate(PROMPTS, GREEDY, use_tqdm=False)] != tokens


def test_preset_norm_gains_are_not_ones_and_artifacts_of_old_weights_are_refused():
    model, _ = load_model("tiny-qwen3", torch.float32)
    gains = [p.detach() for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert gains and all(not torch.equal(g, torch.ones_like(g)) for g in gains)
    assert all(0.5 <= float(g.min()) and float(g.max()) <= 1.5 for g in gains)
    from graphinfer.compiler.fingerprint import model_fingerprint
    from graphinfer.models.presets import preset_config

    import hashlib

    fp = model_fingerprint("tiny-qwen3", preset_config("tiny-qwen3"), 0)
    assert fp["weights_sha256"] != hashlib.sha256(b"tiny-qwen3\x000").hexdigest()  # the old scheme's digest


def test_hoisting_keeps_the_wrong_pass_runnable():
    """The docs' wrong pass relies on hoist_inputs: without it the swapped read is used before it is defined."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.rand(4)), nn.Parameter(torch.rand(4))

        def forward(self, x):
            return G.rms_norm.default(x, self.a, 1e-6) + G.rms_norm.default(x * 2, self.b, 1e-6)

    gm = fx.GraphModule(M(), GraphinferTracer().trace(M()))
    first, second = [n for n in gm.graph.nodes if is_op(n, G.rms_norm)]
    first.args, second.args = (first.args[0], second.args[1], 1e-6), (second.args[0], first.args[1], 1e-6)
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        gm.graph.lint()
    assert hoist_inputs(gm.graph) == 1
    gm.graph.lint()
