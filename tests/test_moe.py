"""Qwen3-MoE: the MoE ops against a per-token loop, the model against HF transformers (fp32, unfused and
fused), weight loading from both expert layouts, and the fuse_moe pass's matches and declines."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from conftest import assert_cpu_default_bound
from torch import fx, nn

import graphinfer.ops  # noqa: F401  (registers the ops)
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.trace import GraphinferTracer, op_histogram
from graphinfer.model_loader import load_model
from graphinfer.ops import moe
from graphinfer.passes import PassManager
from graphinfer.compiler import pass_tools as tools
from graphinfer.passes.fuse_moe import FuseMoEPass
from test_model_parity import _RecordingSampler  # records the logits the sampler sees

OPS = torch.ops.graphinfer


# ----- ops -----

def _loop_reference(hidden, router_logits, w13, w2, top_k, renormalize):
    """Token by token, expert by expert: what every MoE op chain must add up to."""
    I = w2.shape[2]
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(router_logits[t].float(), -1)
        w, ids = torch.topk(probs, top_k)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w.to(hidden.dtype), ids.tolist()):
            x = hidden[t]
            y = (F.silu(w13[e, :I] @ x) * (w13[e, I:] @ x)) @ w2[e].T
            out[t] += weight * y
    return out


def _moe_inputs(T, E=8, H=16, I=8, seed=0, skip_experts=()):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(skip_experts)] = -1e4  # these experts get no tokens
    return hidden, logits, torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3


@pytest.mark.parametrize("T", [0, 1, 7, 33])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_ops_match_per_token_loop(T, renormalize):
    hidden, logits, w13, w2 = _moe_inputs(T, skip_experts=(0, 5))
    ref = _loop_reference(hidden, logits, w13, w2, 2, renormalize)
    fused = OPS.fused_moe(hidden, logits, w13, w2, 2, renormalize)
    assert fused.shape == (T, 16) and torch.allclose(fused, ref, atol=1e-5)

    weights, ids = moe._route(logits, 2, renormalize, hidden.dtype)
    sorted_hidden, offsets, inverse_perm = OPS.moe_dispatch(hidden, ids.int(), 8)
    assert sorted_hidden.shape == (2 * T, 16) and inverse_perm.shape == (2 * T,) and offsets.shape == (9,)
    assert offsets[0] == 0 and offsets[-1] == 2 * T and offsets[1] == offsets[0] and offsets[6] == offsets[5]
    assert torch.equal(sorted_hidden[inverse_perm], hidden.repeat_interleave(2, dim=0))  # flat t*K+k -> its token
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert torch.equal(offsets.diff(), counts)
    expert_out = OPS.moe_grouped_mlp(sorted_hidden, offsets, w13, w2)
    # the capture-safe (device) variant of the reference computes the same rows
    assert torch.allclose(moe._grouped_mlp(sorted_hidden, offsets, w13, w2, sync_free=True), expert_out, atol=1e-6)
    out = OPS.moe_combine(expert_out, inverse_perm, weights)
    assert torch.equal(out, fused)  # fused_moe's reference is the same arithmetic as the chain


def test_device_reference_reads_nothing_on_the_host():
    """Symbolic tracing fails on any data-dependent shape or host read (.tolist(), .item(), bincount), as
    device-graph capture would; the capture-safe reference used off CPU must trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def chain(sync_free):
        def run(hidden, logits, w13, w2):
            weights, ids = moe._route(logits, 2, True, hidden.dtype)
            rows, offsets, inverse_perm = moe._dispatch(hidden, ids, w13.shape[0])
            return moe._combine(moe._grouped_mlp(rows, offsets, w13, w2, sync_free), inverse_perm, weights)
        return run

    args = _moe_inputs(5)
    gm = make_fx(chain(sync_free=True), tracing_mode="symbolic")(*args)
    assert torch.allclose(gm(*_moe_inputs(9, seed=1)), _loop_reference(*_moe_inputs(9, seed=1), 2, True), atol=1e-5)
    with pytest.raises(Exception, match="data-dependent|DataDependent"):  # the CPU path reads offsets on the host
        make_fx(chain(sync_free=False), tracing_mode="symbolic")(*args)


def test_moe_dispatch_is_stable_and_fake_shapes_are_static():
    hidden = torch.arange(4.0).unsqueeze(1).expand(4, 3)
    ids = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 1]])
    sorted_hidden, offsets, inverse_perm = OPS.moe_dispatch(hidden, ids, 4)
    assert sorted_hidden[:, 0].tolist() == [0, 1, 3, 2, 3, 0, 1, 2]  # expert 0: tokens 0, 1, 3 in order, ...
    assert offsets.tolist() == [0, 3, 5, 8, 8]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, ids = torch.empty(5, 16), torch.empty(5, 2, dtype=torch.int64)
        s, o, inv = OPS.moe_dispatch(h, ids, 8)
        y = OPS.moe_grouped_mlp(s, o, torch.empty(8, 12, 16), torch.empty(8, 16, 6))  # E=8, I=6
        assert (s.shape, o.shape, inv.shape, y.shape) == ((10, 16), (9,), (10,), (10, 16))
        assert OPS.moe_combine(y, inv, torch.empty(5, 2)).shape == (5, 16)
        w13, w2 = torch.empty(8, 12, 16), torch.empty(8, 16, 6)
        assert OPS.fused_moe(h, torch.empty(5, 8), w13, w2, 2, True).shape == (5, 16)


# ----- model vs HF -----

def _moe_layers(hf) -> int:
    return sum(hasattr(layer.mlp, "experts") for layer in hf.model.layers)


@pytest.mark.parametrize("arch,engine_kernels", [("qwen3_moe", "suite"), ("qwen3_moe_nonorm", "suite"),
                                                 ("qwen3_moe", "cpu-default")], indirect=["engine_kernels"])
def test_logits_and_tokens_match_hf_unfused_and_fused(arch, tiny_checkpoint, engine_kernels):
    path, hf = tiny_checkpoint(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 11, 40)]
    with torch.no_grad():
        ref_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):]
                      .tolist() for p in prompts]
    ref_logits = {}
    for passes in ("none", "default"):
        llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=256, passes=passes,
                  **engine_kernels)
        assert_cpu_default_bound(llm, engine_kernels)
        runner = llm.llm_engine.worker.model_runner
        runner.sampler = rec = _RecordingSampler(runner.sampler)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref_tokens
        assert len(rec.records) == 4 * 6  # chunked prefills sharing steps with decodes, then decode steps
        worst = 0.0
        with torch.no_grad():
            for token_ids, logits in rec.records:
                key = tuple(token_ids)
                if key not in ref_logits:
                    ref_logits[key] = hf(torch.tensor([token_ids])).logits[0, -1]
                worst = max(worst, (logits - ref_logits[key]).abs().max().item())
        assert worst <= 1e-4, f"passes={passes}: max |logit - HF| = {worst}"
        hist = op_histogram(llm.llm_engine.worker.graph)
        if passes == "default":
            reports = {r.name: r for r in llm.llm_engine.worker.compiled.pass_reports}
            assert reports["fuse_moe"].matches == _moe_layers(hf) and reports["fuse_moe"].declined == []
            assert all(r.max_abs_error <= 1e-5 for r in reports.values())
            assert hist["graphinfer::fused_moe"] == _moe_layers(hf) and "graphinfer::moe_dispatch" not in hist
            # The routing stays only for the expert-load count (runtime/expert_load.py): fused_moe routes inside.
            n = _moe_layers(hf)
            assert hist["softmax"] == hist["topk"] == hist["graphinfer::moe_count_experts"] == n
        else:
            assert hist["graphinfer::moe_dispatch"] == _moe_layers(hf) and "graphinfer::fused_moe" not in hist


def test_dense_and_sparse_layers_follow_hf():
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config
    from graphinfer.models.qwen3_moe import Qwen3MoeForCausalLM

    config = tiny_hf_config("qwen3_moe_nonorm")
    config.num_hidden_layers, config.decoder_sparse_step, config.mlp_only_layers = 5, 2, [3]
    with torch.device("meta"):
        ours, hf = Qwen3MoeForCausalLM(config), AutoModelForCausalLM.from_config(config)
    kinds = [hasattr(layer.mlp, "experts") for layer in ours.model.layers]
    assert kinds == [hasattr(layer.mlp, "experts") for layer in hf.model.layers] == [False, True, False, False, False]


def test_pass_verify_on_checkpoint_and_preset(tiny_checkpoint):
    path, hf = tiny_checkpoint("qwen3_moe")
    text, reports = tools.verify(path)
    assert [r.name for r in reports][-6:] == ["fuse_moe", "absorb_mla", "lower_quant_linears", "fuse_rmsnorm_quant",
                                              "fuse_silu_mul_quant", "cleanup"]
    assert f"| fuse_moe | {_moe_layers(hf)} |" in text and all(r.max_abs_error <= 1e-5 for r in reports)
    text, reports = tools.verify("tiny-qwen3-moe")
    assert {r.name: r.matches for r in reports}["fuse_moe"] == 2  # both preset layers are sparse


# ----- loading both expert layouts -----

def _write_checkpoint(dst, hf, tensors: dict[str, torch.Tensor], shards: int = 1):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf.config.to_dict(), f)
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(dst, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's in-memory 3-D expert tensors split the way hub checkpoints store them."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            for e, w in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def test_per_expert_and_stacked_checkpoints_load_the_same_weights(tiny_checkpoint, tmp_path):
    path, hf = tiny_checkpoint("qwen3_moe_nonorm")
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers keeps experts stacked in memory
    reference, _ = load_model(path, torch.float32)  # save_pretrained's per-expert layout
    per_expert = _per_expert(state)
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in per_expert
    _write_checkpoint(tmp_path / "hub", hf, per_expert, shards=3)  # a layer's experts spread over shards
    _write_checkpoint(tmp_path / "stacked", hf, state)
    expected = reference.state_dict()
    experts = "model.layers.0.mlp.experts"
    assert torch.equal(expected[f"{experts}.w13_weight"], state[f"{experts}.gate_up_proj"])
    for layout in ("hub", "stacked"):
        model, _ = load_model(str(tmp_path / layout), torch.float32)
        got = model.state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), layout

    prompt = list(range(7, 30))
    out = LLM(str(tmp_path / "hub")).generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                              use_tqdm=False)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()

    from graphinfer.errors import ModelNotFoundError

    del per_expert["model.layers.1.mlp.experts.3.up_proj.weight"]
    _write_checkpoint(tmp_path / "partial", hf, per_expert)
    with pytest.raises(ModelNotFoundError, match="lacks 1 tensors.*layers.1.mlp.experts.w13_weight"):
        load_model(str(tmp_path / "partial"), torch.float32)


# ----- fuse_moe on hand-written variants -----

class _MoE(nn.Module):
    """A MoE block like Qwen3-MoE's; subclasses change one thing in the routing."""

    def __init__(self, E=4, H=8, I=6, top_k=2):
        super().__init__()
        self.top_k, self.num_experts = top_k, E
        self.gate = nn.Linear(H, E, bias=False)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.3)

    def scores(self, logits):
        return F.softmax(logits, dim=-1, dtype=torch.float)

    def weights(self, w, logits):
        return (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype)

    def experts(self, x, ids, w):
        rows, offsets, inv = OPS.moe_dispatch.default(x, ids, self.num_experts)
        return OPS.moe_combine.default(OPS.moe_grouped_mlp.default(rows, offsets, self.w13, self.w2), inv, w)

    def forward(self, x):
        logits = self.gate(x)
        w, ids = torch.topk(self.scores(logits), self.top_k, dim=-1)
        return self.experts(x, ids, self.weights(w, logits))


def _run_fuse_moe(module):
    torch.manual_seed(0)
    gm = fx.GraphModule(module, GraphinferTracer().trace(module))
    p = FuseMoEPass()
    [report] = PassManager([p], [(torch.randn(5, 8),)]).run(gm)
    assert gm(torch.randn(0, 8)).shape == (0, 8)  # no tokens: still runs, fused or not
    return gm, report


def test_fuse_moe_matches_method_style_routing_and_keeps_shared_experts():
    class MethodStyle(_MoE):  # .float().softmax(-1), .topk(k), no renormalisation, cast to x's dtype
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x):
            w, ids = self.gate(x).float().softmax(-1).topk(self.top_k)
            return self.experts(x, ids, w.to(x.dtype)) + self.shared(x)  # a shared expert beside the routed ones

    gm, report = _run_fuse_moe(MethodStyle())
    assert report.matches == 1 and report.max_abs_error == 0 and report.declined == []
    hist = op_histogram(gm)
    assert hist["graphinfer::fused_moe"] == 1 and not {"graphinfer::moe_dispatch", "softmax", "float", "to"} & set(hist)
    fused = next(n for n in gm.graph.nodes if n.target is OPS.fused_moe.default)
    assert fused.args[4:] == (2, False) and "self.shared(" in gm.code


class _Sigmoid(_MoE):
    def scores(self, logits):
        return torch.sigmoid(logits)


class _Scaled(_MoE):
    def weights(self, w, logits):
        return super().weights(w, logits) * 2.5  # a routed scaling factor


class _Bf16Softmax(_MoE):
    def scores(self, logits):
        return F.softmax(logits, dim=-1)


class _LeakyRouting(_MoE):
    def forward(self, x):
        logits = self.gate(x)
        w, ids = torch.topk(self.scores(logits), self.top_k, dim=-1)
        return self.experts(x, ids, self.weights(w, logits)) + ids.sum()  # the expert ids are used elsewhere


class _GroupedTopK(_MoE):
    def scores(self, logits):  # keep the best group of two experts, mask the others (DeepSeek-style)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        best = probs.view(-1, 2, 2).amax(-1).argmax(-1, keepdim=True)
        return probs.masked_fill(torch.arange(4).view(1, 4) // 2 != best, 0.0)


class _SharedAppended(_MoE):
    def forward(self, x):  # an always-on expert 3 appended to every token's routed ones
        logits = self.gate(x)
        w, ids = torch.topk(self.scores(logits), self.top_k, dim=-1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], 3)], dim=-1)
        w = torch.cat([self.weights(w, logits), torch.ones_like(w[:, :1])], dim=-1)
        return self.experts(x, ids, w)


@pytest.mark.parametrize("module, reason", [
    (_Sigmoid, "router scores come from sigmoid, not softmax"),
    (_Scaled, "routing weights pass through mul"),
    (_Bf16Softmax, "softmax is not computed in fp32"),
    (_LeakyRouting, "a routing value is used outside the MoE chain"),
    (_GroupedTopK, "router scores come from masked_fill, not softmax"),
    (_SharedAppended, "expert ids come from cat, not the router's top-k"),
])
def test_fuse_moe_fuses_only_the_experts_where_fused_moe_cannot_route(module, reason):
    """Routing fused_moe does not express stays as torch ops; the dispatch / grouped MLP / combine chain after it
    still becomes one fused_experts, with the ids and weights as the routing gives them (the report says why)."""
    gm, report = _run_fuse_moe(module())
    assert report.matches == 1 and len(report.declined) == 1 and reason in report.declined[0], report.declined
    assert report.max_abs_error == 0 and "fused_moe" not in gm.code and "fused_experts" in gm.code
    assert "moe_dispatch" not in gm.code


def test_expert_parallel_rank_reads_only_its_experts():
    """EP rank 1 of 2 (a layout, no group): per-expert tensors of rank 0's experts are never read, stacked ones are
    sliced on the expert dim; both give experts [4, 8) whole (no intermediate split)."""
    from torch import nn

    from graphinfer.distributed import parallel_state as ps
    from graphinfer.models.checkpoint_tensor import InMemoryTensor
    from graphinfer.models.loader import load_weights
    from graphinfer.models.parallel_layers import MoEExperts

    class Unreadable(InMemoryTensor):
        def read(self, *a, **k):
            raise AssertionError("read another EP rank's expert")

    E, H, I = 8, 4, 6
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with ps.layout(1, 2, expert_parallel=True):
        per_expert, stacked = (nn.ModuleDict({"mlp": nn.ModuleDict({"experts": MoEExperts(E, H, I)})}) for _ in "ab")
    assert per_expert.mlp.experts.w13_weight.shape == (E // 2, 2 * I, H)
    tensors = []
    for e in range(E):
        kind = InMemoryTensor if e >= E // 2 else Unreadable
        tensors += [(f"mlp.experts.{e}.gate_proj.weight", kind(gate_up[e, :I])),
                    (f"mlp.experts.{e}.up_proj.weight", kind(gate_up[e, I:])),
                    (f"mlp.experts.{e}.down_proj.weight", kind(down[e]))]
    load_weights(per_expert, tensors, tied=False)
    load_weights(stacked, [("mlp.experts.gate_up_proj", gate_up), ("mlp.experts.down_proj", down)], tied=False)
    for m in (per_expert, stacked):
        assert torch.equal(m.mlp.experts.w13_weight, gate_up[E // 2:]) and torch.equal(m.mlp.experts.w2_weight, down[E // 2:])
