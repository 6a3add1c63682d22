"""Fusion passes: match counts, fused vs unfused (the oracle) logits and tokens, declines, cleanup."""
import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers the ops)
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.trace import GraphinferTracer, op_histogram
from graphinfer.passes import PassManager, resolve_passes
from graphinfer.passes.cleanup import CleanupPass
from graphinfer.passes.fuse_gate_up import FuseGateUpPass
from graphinfer.passes.fuse_qkv import FuseQKVPass


class _RecordingSampler:
    def __init__(self, sampler):
        self.sampler, self.logits = sampler, []

    def __call__(self, logits, rows):
        self.logits.append(logits.clone())
        return self.sampler(logits, rows)


def _run(llm, prompts, max_tokens=12):
    """Greedy tokens and every step's logits, from the whole forward: an unfused graph's tail is not cut to the sampled
    rows (its decomposed norms are not registered row-wise ops), and a last layer run on fewer rows rounds its GEMMs
    differently (compiler/sampled_rows.py; tests/test_sampled_rows.py compares the two)."""
    runner = llm.llm_engine.worker.model_runner
    rows, runner.graph_rows = runner.graph_rows, None
    runner.sampler = rec = _RecordingSampler(runner.sampler)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        runner.sampler, runner.graph_rows = rec.sampler, rows
    return [o.outputs[0].token_ids for o in outs], rec.logits


def _matches(llm) -> dict[str, int]:
    return {r.name: r.matches for r in llm.llm_engine.worker.compiled.pass_reports}


def _assert_fused_equals_unfused(fused, unfused, prompts):
    tokens_f, logits_f = _run(fused, prompts)
    tokens_u, logits_u = _run(unfused, prompts)
    assert tokens_f == tokens_u
    err = max((a - b).abs().max().item() for a, b in zip(logits_f, logits_u))
    assert err <= 1e-5, f"max |fused - unfused logit| = {err}"
    for r in fused.llm_engine.worker.compiled.pass_reports:
        assert r.max_abs_error is not None and r.max_abs_error <= 1e-5, r


def test_smollm2_fusions(smollm2_llm):
    matches = _matches(smollm2_llm)  # the session LLM runs the default pipeline
    assert matches["fuse_qkv"] == 30 and matches["fuse_gate_up"] == 30 and matches["fuse_add_rmsnorm"] >= 59
    hist = op_histogram(smollm2_llm.llm_engine.worker.graph)
    assert hist["graphinfer::add_rms_norm"] == 60 and hist["graphinfer::silu_and_mul"] == 30 and "silu" not in hist
    unfused = LLM(dtype="float32", max_model_len=1024, passes="none")
    assert unfused.llm_engine.worker.compiled.pass_reports == []
    prompts = ["The capital of France is", "Write a poem about the sea.", "1, 2, 3, 4,"]
    _assert_fused_equals_unfused(smollm2_llm, unfused, prompts)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
def test_tiny_model_fusions(arch, tiny_checkpoint):
    path, hf = tiny_checkpoint(arch)
    layers = hf.config.num_hidden_layers
    fused, unfused = LLM(path, passes="default"), LLM(path, passes="none")
    matches = _matches(fused)
    assert (matches["fuse_qkv"], matches["fuse_gate_up"], matches["fuse_add_rmsnorm"]) == (layers, layers, 2 * layers)
    qkv = fused.llm_engine.worker.graph.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert (qkv.bias is not None) == (arch == "qwen2")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 30, 3)]
    _assert_fused_equals_unfused(fused, unfused, prompts)


def _trace(module: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(module, GraphinferTracer().trace(module))


def test_fuse_qkv_declines_projections_that_are_not_qkv():
    class ThreeHeads(nn.Module):  # three projections of one input, none feeding attention
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).sum() + self.c(x).sum()

    gm = _trace(ThreeHeads())
    p = FuseQKVPass()
    assert PassManager([p]).run(gm)[0].matches == 0
    assert "not a query/key/value triple" in p.declined[0]


def test_fuse_gate_up_declines_when_outputs_are_reused():
    class LeakyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            g = self.gate(x)
            return self.down(F.silu(g) * self.up(x)) + g.sum()

    gm = _trace(LeakyMLP())
    x = torch.randn(3, 8)
    [report] = PassManager([FuseGateUpPass()], [(x,)]).run(gm)
    assert report.matches == 0 and "used elsewhere" in report.declined[0]

    class MLP(LeakyMLP):
        def forward(self, x):
            return self.down(self.up(x) * F.silu(self.gate(x)))  # operands swapped: still matched

    gm = _trace(MLP())
    [report] = PassManager([FuseGateUpPass()], [(x,)]).run(gm)
    assert report.matches == 1 and report.max_abs_error < 1e-6
    assert "silu_and_mul" in gm.code and "self.gate(" not in gm.code and "self.up(" not in gm.code


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_fuse_gate_up_takes_gelu_to_gelu_and_mul(approximate):
    """GeGLU as Gemma's MLP spells it (F.gelu(approximate="tanh") is what TorchDynamo captures of gelu_pytorch_tanh)."""
    class GeGLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 24), nn.Linear(8, 24), nn.Linear(24, 8)

        def forward(self, x):
            # * 0.5: a multiply by a constant (Granite's multipliers) is no match and no error
            return self.down_proj(F.gelu(self.gate_proj(x), approximate=approximate) * self.up_proj(x)) * 0.5

    torch.manual_seed(0)
    mlp, x = GeGLU(), torch.randn(5, 8) * 3
    gm = _trace(mlp)
    [report] = PassManager([FuseGateUpPass()], [(x,)]).run(gm)
    assert report.matches == 1 and report.max_abs_error < 1e-6
    [act] = [n for n in gm.graph.nodes if n.target is torch.ops.graphinfer.gelu_and_mul.default]
    assert act.args[1] == approximate and act.args[0].target == "gate_up_proj"
    assert not any(n.target is F.gelu for n in gm.graph.nodes) and "self.gate_proj(" not in gm.code
    torch.testing.assert_close(gm(x), mlp(x), atol=1e-6, rtol=1e-6)  # the unfused module itself


def test_cleanup_keeps_cache_writes_and_drops_dead_code():
    class M(nn.Module):
        def forward(self, k, cache, slots):
            n = k.shape[0]
            unused = k * 2  # noqa: F841  dead
            torch.ops.graphinfer.reshape_and_cache.default(k, k, cache, cache, slots)  # result unused, but it mutates
            return k.view(n, -1).view(n, -1).reshape(n, 2, -1) + k.shape[0]

    gm = _trace(M())
    k, cache, slots = torch.randn(3, 2, 4), torch.zeros(4, 2, 2, 4), torch.tensor([0, 5, -1])
    [report] = PassManager([CleanupPass()], [(k, cache, slots)]).run(gm)
    assert report.max_abs_error == 0
    hist = op_histogram(gm)
    assert hist["graphinfer::reshape_and_cache"] == 1 and "mul" not in hist
    assert hist.get("view", 0) + hist.get("reshape", 0) == 1  # view(view(x)) and the reshape collapse into one
    assert hist["getattr"] == 1  # k.shape read once


def test_unknown_pass_name_is_a_clear_error():
    from graphinfer.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="Unknown pass.*Available: canon_rms_norm, .*fuse_qkv"):
        resolve_passes("fuse_qkv,fuse_everything")


def test_full_decode_only_is_refused_on_cpu_with_the_reference_ops():
    from graphinfer.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="cpu platform runs NONE with"):  # (the suite's reference kernels)
        LLM("tiny-llama", graph_mode="FULL_DECODE_ONLY")
