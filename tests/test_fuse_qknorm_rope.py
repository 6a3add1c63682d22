"""fuse_qknorm_rope: matches once per layer on Qwen3 dense and MoE (presets with random, non-unit q/k norm gains,
and a checkpoint saved by transformers), fused == unfused, artifacts round-trip, and declines what it cannot
express, with reasons.
The kernel itself is tested in test_triton_qk_norm_rope.py, and inside whole models in test_triton_model.py."""
import pytest
import torch
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers the ops)
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.trace import GraphinferTracer, op_histogram
from graphinfer.models.loader import load_model
from graphinfer.passes import PassManager, resolve_passes
from graphinfer.passes.fuse_qknorm_rope import FuseQKNormRopePass

G = torch.ops.graphinfer


def _report(reports):
    return next(r for r in reports if r.name == "fuse_qknorm_rope")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_presets_match_once_per_layer(preset, dtype):
    model, config = load_model(preset, dtype)
    q_gain = model.model.layers[0].self_attn.q_norm.weight
    assert not torch.all(q_gain == 1) and not torch.equal(q_gain, model.model.layers[0].self_attn.k_norm.weight)
    gm, reports = compile_model(model, resolve_passes("default"))
    r = _report(reports)
    layers = config.num_hidden_layers
    assert r.matches == layers and r.declined == [] and reports.passed, reports.failures()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert r.max_abs_error <= tol and reports.end_to_end.max_abs_error <= tol
    hist = op_histogram(gm)
    assert hist["graphinfer::qk_norm_rope"] == layers and "graphinfer::rotary_embedding" not in hist
    assert hist["graphinfer::rms_norm"] == 1  # the final norm; q/k norms are fused, the others are add_rms_norm


def test_qwen3_checkpoint_from_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config
    from graphinfer.models.presets import init_random_weights
    from test_passes import _assert_fused_equals_unfused, _matches

    hf = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3")).eval()
    init_random_weights(hf, seed=3)  # non-unit q/k norm gains: HF initialises them to ones
    hf.save_pretrained(tmp_path)
    fused, unfused = LLM(str(tmp_path), passes="default"), LLM(str(tmp_path), passes="none")
    layers = hf.config.num_hidden_layers
    assert _matches(fused)["fuse_qknorm_rope"] == layers
    assert op_histogram(fused.llm_engine.graph)["graphinfer::qk_norm_rope"] == layers
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 30, 3)]
    _assert_fused_equals_unfused(fused, unfused, prompts)
    # An artifact's graph.py calls the op; loading it gives the same tokens without re-running the passes.
    art = str(tmp_path / "art")
    fused.llm_engine.save_artifact(art)
    assert "torch.ops.graphinfer.qk_norm_rope.default(" in open(f"{art}/graph.py").read()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
              for llm in (fused, LLM(artifact=art))]
    assert tokens[0] == tokens[1]


def test_declines_different_q_and_k_eps():
    model, config = load_model("tiny-qwen3", torch.float32)
    model.model.layers[0].self_attn.k_norm.eps = 1e-5
    gm, reports = compile_model(model, resolve_passes("default"))
    r = _report(reports)
    assert r.matches == config.num_hidden_layers - 1 and reports.passed
    assert len(r.declined) == 1 and "q and k norms use different eps (1e-06 vs 1e-05)" in r.declined[0]
    hist = op_histogram(gm)
    assert hist["graphinfer::qk_norm_rope"] == 1 and hist["graphinfer::rotary_embedding"] == 1


class Prologue(nn.Module):
    """Qwen3's attention prologue as it looks after fuse_qkv (4 q heads, 2 kv heads of 32), or a variant of it."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        g = torch.Generator().manual_seed(0)
        self.q_w = nn.Parameter(0.5 + torch.rand(32, generator=g))
        self.k_w = nn.Parameter(1.5 + torch.rand(32, generator=g))
        self.q_w_flat = nn.Parameter(0.5 + torch.rand(128, generator=g))
        freqs = torch.outer(torch.arange(64).float(), 1.0 / 1e4 ** (torch.arange(0, 32, 2).float() / 32))
        self.register_buffer("cache", torch.cat((freqs.cos(), freqs.sin()), -1))

    def forward(self, positions, qkv):
        T, variant = qkv.shape[0], self.variant
        q, k, v = qkv.split([128, 64, 64], dim=-1)
        if variant == "whole_q":  # one norm over all q heads (not Qwen3's per-head norm)
            q = G.rms_norm.default(q, self.q_w_flat, 1e-6)
        elif variant != "plain":
            q = G.rms_norm.default(q.view(T, 4, 32), self.q_w, 1e-6).view(T, -1)
        normed_q = q
        if variant not in ("plain", "only_q"):
            k = G.rms_norm.default(k.view(T, 2, 32), self.k_w, 1e-6)
            if variant != "heads_layout":  # heads_layout: rotary takes k as [T, 2, 32]
                k = k.view(T, -1)
        q, k = G.rotary_embedding.default(positions, q, k, 32, self.cache, variant != "gptj")
        return (q, k, v, normed_q) if variant == "q_reused" else (q, k, v)


def _run(variant: str):
    module = Prologue(variant)
    gm = fx.GraphModule(module, GraphinferTracer().trace(module))
    g = torch.Generator().manual_seed(1)
    inputs = [(torch.randint(0, 64, (n,), generator=g), torch.randn(n, 256, generator=g) * 3) for n in (5, 1)]
    p = FuseQKNormRopePass()
    [report] = PassManager([p], inputs).run(gm)
    assert report.passed and report.mismatch == "", report  # shapes and values as before the pass
    return report, op_histogram(gm)


@pytest.mark.parametrize("variant", ["qwen3", "gptj", "heads_layout"])
def test_matches_neox_gptj_and_a_heads_layout(variant):
    report, hist = _run(variant)
    assert report.matches == 1 and report.declined == [] and report.max_abs_error <= 1e-5
    assert hist["graphinfer::qk_norm_rope"] == 1 and set(hist).isdisjoint({"graphinfer::rms_norm", "split"})


@pytest.mark.parametrize("variant,reason", [
    ("whole_q", "q is not normalised per head of 32"),
    ("only_q", "only the query is RMSNormed before rotary"),
    ("q_reused", "(q) is also used outside the norm + rotary chain"),
    ("plain", None),  # no q/k norm at all (Llama, Qwen2): no candidate, nothing to report
])
def test_declines_with_reasons(variant, reason):
    report, hist = _run(variant)
    assert report.matches == 0 and "graphinfer::qk_norm_rope" not in hist
    assert report.declined == [] if reason is None else reason in report.declined[0], report.declined
