"""fuse_qknorm_rope: matches once per layer on Qwen3 dense and MoE (presets with random, non-unit q/k norm gains,
and a checkpoint saved by transformers), folding the KV-cache write in (qk_norm_rope_cache); fused == unfused,
outputs and KV-cache contents (padded rows included); artifacts round-trip; declines what it cannot express, with
reasons.
The kernel itself is tested in test_triton_qk_norm_rope.py, and inside whole models in test_triton_model.py."""
import pytest
import torch
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers the ops)
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.compile import check_inputs, compile_model
from graphinfer.compiler.trace import GraphinferTracer, node_target_name, op_histogram, trace_model
from graphinfer.model_loader import load_model
from graphinfer.models.layers import AttentionMetadata, PagedAttention
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
    assert hist["graphinfer::qk_norm_rope_cache"] == layers
    assert set(hist).isdisjoint({"graphinfer::rotary_embedding", "graphinfer::qk_norm_rope",
                                 "graphinfer::reshape_and_cache"})
    assert hist["graphinfer::rms_norm"] == 1  # the final norm; q/k norms are fused, the others are add_rms_norm


def _steps(model) -> list[tuple]:
    """check_inputs' prefill and mixed steps, then a decode step padded by one row (slot -1, context 0)."""
    steps = check_inputs(model)
    md = steps[-1][2]
    positions = torch.tensor([6, 23, 10, 0])  # after those steps the three sequences hold 6, 23 and 10 tokens
    bs = next(m for m in model.modules() if isinstance(m, PagedAttention)).k_cache.shape[1]
    tables = torch.cat((md.block_tables, torch.zeros_like(md.block_tables[:1])))
    slots = (tables[:3, :].gather(1, (positions[:3] // bs)[:, None].int())[:, 0].long() * bs + positions[:3] % bs)
    md = AttentionMetadata(torch.cat((slots, torch.tensor([-1]))), tables, torch.arange(5, dtype=torch.int32),
                           torch.tensor([7, 24, 11, 0], dtype=torch.int32))
    return steps + [(torch.tensor([1, 2, 3, 0]), positions, md)]


@torch.inference_mode()
def _outputs_and_caches(gm, model, steps) -> tuple[list, list]:
    attn = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for m in attn:
        m.k_cache.zero_(), m.v_cache.zero_()
    outs = [gm(*step).clone() for step in steps]
    return outs, [c.clone() for m in attn for c in (m.k_cache, m.v_cache)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_cache_contents_equal_unfused(preset, dtype):
    model, _ = load_model(preset, dtype)
    fused, _ = compile_model(model, resolve_passes("default"))
    steps = _steps(model)
    (out_f, caches_f), (out_u, caches_u) = (_outputs_and_caches(g, model, steps) for g in (fused, trace_model(model)))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for a, b in zip(out_f + caches_f, out_u + caches_u):
        torch.testing.assert_close(a, b, **tol)
    assert any(c.abs().sum() > 0 for c in caches_f)  # the steps did write
    assert all(c.view(-1, *c.shape[2:])[-1].abs().sum() == 0 for c in caches_f)  # slot -1 wrote nothing (not slot n-1)


def _launches(gm) -> int:
    """Kernel launches per step, as the graph says: graphinfer ops and modules (linears); views launch nothing."""
    return sum(n.op == "call_module" or (n.op == "call_function" and node_target_name(n).startswith("graphinfer::"))
               for n in gm.graph.nodes)


def test_folding_the_cache_write_saves_a_launch_per_layer(monkeypatch):
    model, config = load_model("tiny-qwen3", torch.float32)
    folded, _ = compile_model(model, resolve_passes("default"))
    monkeypatch.setattr(FuseQKNormRopePass, "_fold_cache_write", lambda self, g, fused: None)
    unfolded, _ = compile_model(model, resolve_passes("default"))
    assert op_histogram(unfolded)["graphinfer::reshape_and_cache"] == config.num_hidden_layers
    assert _launches(folded) == _launches(unfolded) - config.num_hidden_layers


def test_qwen3_checkpoint_from_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config
    from graphinfer.models.presets import init_random_weights
    from test_passes import _assert_fused_equals_unfused, _matches

    hf = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3")).eval()
    init_random_weights(hf, seed=3)  # non-unit q/k norm gains: HF initialises them to ones
    hf.save_pretrained(tmp_path)
    kv = dict(kv_cache_memory_bytes=1 << 28)  # on a GPU, not 90 % of it: the GPU tests share one over xdist workers
    fused, unfused = LLM(str(tmp_path), passes="default", **kv), LLM(str(tmp_path), passes="none", **kv)
    layers = hf.config.num_hidden_layers
    assert _matches(fused)["fuse_qknorm_rope"] == layers
    assert op_histogram(fused.llm_engine.worker.graph)["graphinfer::qk_norm_rope_cache"] == layers
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 30, 3)]
    _assert_fused_equals_unfused(fused, unfused, prompts)
    # An artifact's graph.py calls the op; loading it gives the same tokens without re-running the passes.
    art = str(tmp_path / "art")
    fused.llm_engine.save_artifact(art)
    assert "torch.ops.graphinfer.qk_norm_rope_cache.default(" in open(f"{art}/graph.py").read()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
              for llm in (fused, LLM(artifact=art, **kv))]
    assert tokens[0] == tokens[1]


def test_declines_different_q_and_k_eps():
    model, config = load_model("tiny-qwen3", torch.float32)
    model.model.layers[0].self_attn.k_norm.eps = 1e-5
    gm, reports = compile_model(model, resolve_passes("default"))
    r = _report(reports)
    assert r.matches == config.num_hidden_layers - 1 and reports.passed
    assert len(r.declined) == 1 and "q and k norms use different eps (1e-06 vs 1e-05)" in r.declined[0]
    hist = op_histogram(gm)
    assert hist["graphinfer::qk_norm_rope_cache"] == 1 and hist["graphinfer::rotary_embedding"] == 1
    assert hist["graphinfer::reshape_and_cache"] == 1  # the unfused layer's


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
        self.register_buffer("key_cache", torch.zeros(2, 8, 2, 32))  # paged KV caches: 2 blocks of 8
        self.register_buffer("value_cache", torch.zeros(2, 8, 2, 32))

    def forward(self, positions, qkv, slots):
        if not self.variant.startswith("cache"):
            return self._prologue(positions, qkv, self.variant)
        # The prologue, then the KV-cache write; the caches are outputs, so the pass's check compares them.
        q, k, v = self._prologue(positions, qkv, "qwen3")
        heads = (qkv.shape[0], 2, 32)
        # a read of the cache before the write (output: a slot no step writes, so each run of the steps sees the same)
        seen = G.rms_norm.default(self.key_cache, self.k_w, 1e-6)[0, 0] if self.variant == "cache_read_before_write" \
            else None
        G.reshape_and_cache.default(k.view(heads), v.view(heads), self.key_cache, self.value_cache, slots)
        extra = (k,) if self.variant == "cache_k_reused" else (seen,) if seen is not None else ()
        return (q, self.key_cache, self.value_cache, *extra)

    def _prologue(self, positions, qkv, variant):
        T = qkv.shape[0]
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
    # -1: a padded row, nothing written. The second step rewrites a slot of the first: each run of the steps then
    # leaves the caches as the run before it found them, so the runs before and after the pass compare alike.
    slots = [torch.tensor([3, -1, 9, 8, 15]), torch.tensor([8])]
    inputs = [(torch.randint(0, 64, (len(s),), generator=g), torch.randn(len(s), 256, generator=g) * 3, s)
              for s in slots]
    p = FuseQKNormRopePass()
    [report] = PassManager([p], inputs).run(gm)
    assert report.passed and report.mismatch == "", report  # shapes and values as before the pass
    return report, op_histogram(gm)


_NOT_ONLY_CACHED = "its k and v are not just the key and value of one reshape_and_cache"


@pytest.mark.parametrize("variant", ["qwen3", "gptj", "heads_layout"])
def test_matches_neox_gptj_and_a_heads_layout(variant):
    report, hist = _run(variant)
    assert report.matches == 1 and report.max_abs_error <= 1e-5
    assert [_NOT_ONLY_CACHED in r for r in report.declined] == [True]  # k and v are outputs: no cache write to fold
    assert hist["graphinfer::qk_norm_rope"] == 1 and set(hist).isdisjoint({"graphinfer::rms_norm", "split"})


def test_folds_the_cache_write():
    report, hist = _run("cache")  # the check compares the caches (outputs) too, padded row included
    assert report.matches == 1 and report.declined == [] and report.max_abs_error <= 1e-5
    assert hist["graphinfer::qk_norm_rope_cache"] == 1
    assert set(hist).isdisjoint({"graphinfer::qk_norm_rope", "graphinfer::reshape_and_cache", "graphinfer::rms_norm"})


@pytest.mark.parametrize("variant,reason", [
    ("cache_k_reused", _NOT_ONLY_CACHED + " (used by: output, reshape_and_cache"),
    ("cache_read_before_write", "the KV-cache write reshape_and_cache_default cannot move up into it: rms_norm"),
])
def test_keeps_the_cache_write_with_reasons(variant, reason):
    report, hist = _run(variant)
    assert report.matches == 1 and report.max_abs_error <= 1e-5
    assert hist["graphinfer::qk_norm_rope"] == 1 and hist["graphinfer::reshape_and_cache"] == 1
    assert len(report.declined) == 1 and reason in report.declined[0], report.declined


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
