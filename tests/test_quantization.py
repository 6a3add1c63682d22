"""Quantized models through the compiler (CPU): online schemes, the quantization passes, artifacts, refusals.

Oracles: each scheme's quantized graph against the unfused graph of the same quantized model (the passes'
numeric checks); the float model with its weights rounded through the scheme (quantized, then dequantized) for
the model as a whole (weight-only: the same computation, so the same log-probabilities; w8a8: they differ by the
activations' quantization, bounded by a KL); an artifact against the engine that compiled it. How close a scheme
stays to the float model is a property of real weights, measured on SmolLM2 by `graphinfer bench accuracy`.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_cpu_default_bound

from graphinfer import LLM, SamplingParams
from graphinfer.errors import InvalidConfigError
from graphinfer.ops.quant import dequantize_weight
from graphinfer.quantization.linear import QuantizedLinear, fit_group, quantize_weight
from graphinfer.quantization.scheme import ONLINE_SCHEMES

PROMPTS = [[1, 5, 9, 3, 7, 2, 8, 11, 40, 6], [4, 4, 8, 1], list(range(2, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CPU_SCHEMES = [s for s in ONLINE_SCHEMES if s != "fp8"]


def _greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@torch.no_grad()
def _rounded_float_engine(scheme: str, **kw):
    """tiny-qwen3 in float whose projections (fused as the compiled graph has them; every scheme is per output row,
    so quantizing the fused weight equals fusing the quantized ones) hold their weights rounded through the scheme."""
    llm = LLM("tiny-qwen3", dtype="float32", seed=0, **kw)
    for name, m in llm.llm_engine.worker.graph.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            s = fit_group(ONLINE_SCHEMES[scheme], m.in_features)
            t = quantize_weight(m.weight, s)
            scale = t["weight_scale"].view(m.out_features, -1)  # w8a8 / fp8: [N], per channel
            m.weight.copy_(dequantize_weight(t["weight"], scale, t.get("weight_zero"), s.bits))
    return llm


def _first_logprobs(llm) -> list[dict]:
    """The top-20 log-probabilities of each prompt's first generated token."""
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)
    return [o.outputs[0].logprobs[0] for o in out]


def _kl(ref: dict, other: dict) -> float:
    """KL(ref || other) over the tokens both top-20 lists hold (renormalised)."""
    common = sorted(set(ref) & set(other))
    assert len(common) >= 10
    p = torch.tensor([ref[t].logprob for t in common]).log_softmax(0)
    q = torch.tensor([other[t].logprob for t in common]).log_softmax(0)
    return F.kl_div(q, p, log_target=True, reduction="sum").item()


@pytest.mark.parametrize("scheme,engine_kernels", [*((s, "suite") for s in CPU_SCHEMES), ("w8a8", "cpu-default"),
                                                   ("int4_wo", "cpu-default")], indirect=["engine_kernels"])
def test_online_scheme_compiles_fuses_and_computes_with_its_rounded_weights(scheme, engine_kernels):
    """engine_kernels "cpu-default": the quantized linears on the cpu platform's C++ kernels (ops/cpu/quant.py)."""
    ref = _rounded_float_engine(scheme, **engine_kernels)
    llm = LLM("tiny-qwen3", dtype="float32", seed=0, quantization=scheme, **engine_kernels)
    assert_cpu_default_bound(llm, engine_kernels)
    if engine_kernels:
        assert llm.llm_engine.local_core.platform.kernels.get("wo_linear") == "graphinfer.ops.cpu.quant"
    reports = {r.name: r for r in llm.llm_engine.worker.compiled.pass_reports}
    assert all(r.passed for r in reports.values()), [(r.name, r.max_abs_error) for r in reports.values()]
    assert reports["lower_quant_linears"].matches == 8  # 2 layers x (qkv, o, gate_up, down), fused first
    if ONLINE_SCHEMES[scheme].weight_only:
        assert reports["fuse_rmsnorm_quant"].matches == reports["fuse_silu_mul_quant"].matches == 0
    else:  # each layer's two norms and its SwiGLU quantize their outputs in the same op
        assert reports["fuse_rmsnorm_quant"].matches == 4 and reports["fuse_silu_mul_quant"].matches == 2
    layers = [m for m in llm.llm_engine.worker.graph.modules() if isinstance(m, QuantizedLinear)]  # fused ones included
    assert len(layers) == 8 and all(m.scheme.bits == ONLINE_SCHEMES[scheme].bits for m in layers)
    ref_lp, lp = _first_logprobs(ref), _first_logprobs(llm)
    if ONLINE_SCHEMES[scheme].weight_only:
        for a, b in zip(ref_lp, lp):
            assert list(a) == list(b)
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)
        assert _greedy(ref) == _greedy(llm)
    else:
        kls = [_kl(a, b) for a, b in zip(ref_lp, lp)]
        assert max(kls) < 0.1, kls


def test_quantized_graph_modes_match_none():
    """NONE vs the capture stand-in's decode buckets on a w8a8 model: graph capture never changes results."""
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine
    from capture_standin import OpTapePlatform

    kw = dict(dtype="float32", quantization="w8a8", max_num_seqs=4)
    none = [o.outputs[0].token_ids for o in LLM("tiny-llama", **kw).generate(PROMPTS, GREEDY, use_tqdm=False)]
    saved = llm_engine.platform_for_device
    llm_engine.platform_for_device = lambda device_type: OpTapePlatform()
    try:
        llm = LLM("tiny-llama", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4], **kw)
        full = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm_engine.platform_for_device = saved
    assert full == none


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_artifact_round_trip_keeps_the_packed_weights(scheme, tmp_path):
    from graphinfer.compiler.artifact import read_manifest

    llm = LLM("tiny-qwen3", dtype="float32", quantization=scheme)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.llm_engine.save_artifact(str(tmp_path / "art"))
    manifest = read_manifest(str(tmp_path / "art"))
    layers = manifest["quantization"]["layers"]
    assert manifest["quantization"]["method"] == scheme and len(layers) == 8
    assert any(name.endswith("qkv_proj") for name in layers)  # fused projections keep their scheme
    served = LLM(artifact=str(tmp_path / "art"))
    assert served.llm_engine.config.model_config.quantization == scheme
    packed = served.llm_engine.worker.model.model.layers[0].self_attn.o_proj
    assert isinstance(packed, QuantizedLinear) and packed.weight.dtype in (torch.int8, torch.uint8)
    assert [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_unrunnable_or_unknown_schemes_are_refused_clearly():
    with pytest.raises(InvalidConfigError, match="fp8.*needs a CUDA GPU.*w8a8"):
        LLM("tiny-llama", quantization="fp8", device="cpu")
    with pytest.raises(InvalidConfigError, match="not supported; use one of w8a8"):
        LLM("tiny-llama", quantization="int3")
    with pytest.raises(InvalidConfigError, match="gguf.*reads a pre-quantized checkpoint"):
        LLM("tiny-llama", quantization="gguf")


def test_tensor_parallel_quantizes_each_shard():
    """At tp 2 each rank quantizes its own shard after loading (vLLM's online quantization does the same): the
    column-parallel layers' rows quantize as at tp 1, a row-parallel layer's weight scales, and the activation
    scales of its input, are its shard's. So tp 2 and tp 1 are two quantizations of one model: the pass checks hold
    on every rank's graph and tp 2 stays within the bound w8a8 keeps from the float model (a misplaced shard or
    scale gives a KL of order 1)."""
    kw = dict(dtype="float32", quantization="w8a8")
    ref = _first_logprobs(LLM("tiny-qwen3", **kw))
    with LLM("tiny-qwen3", tensor_parallel_size=2, **kw) as llm:
        assert all(r.passed for r in llm.llm_engine.worker.compiled.pass_reports)
        kls = [_kl(a, b) for a, b in zip(ref, _first_logprobs(llm))]
    assert max(kls) < 0.1, kls


def test_bench_accuracy_scores_like_the_engine_samples(tmp_path):
    """`bench accuracy`'s teacher-forced scoring runs the engine's graph: its last-position log-probabilities are
    the ones generation reports, and the unquantized row is exact agreement, zero KL."""
    from graphinfer.bench.accuracy import run, score

    llm = LLM("tiny-qwen3", dtype="float32", enable_prefix_caching=False)
    first = _first_logprobs(llm)
    for prompt, lp in zip(PROMPTS, first):
        ref = F.log_softmax(score(llm, prompt)[-1], -1)
        assert [x.logprob for x in lp.values()] == pytest.approx(ref[list(lp)].tolist(), abs=1e-4)
    result = run("tiny-qwen3", schemes=["int8_wo"], dtype="float32", device="cpu", num_prompts=2, max_tokens=4,
                 output_json=str(tmp_path / "a.json"))
    none, int8 = result["runs"]
    assert (none["agreement"], none["kl"], none["positions"]) == (1.0, 0.0, 8)
    assert 0.3 < int8["weight_fraction"] < 0.6 and 0 <= int8["kl"] < 0.1 and int8["positions"] == 8


@pytest.mark.parametrize("case", ["W4A16", "W8A8"])
def test_compressed_tensors_checkpoint_loads_and_generates(case, tmp_path):
    """A checkpoint written by the compressed-tensors package itself, served quantized: weight-only W4A16 computes
    what transformers' load of the same checkpoint (decompressed to float) computes, greedy tokens included;
    W8A8 (activations quantized per token too) stays within a small KL of it."""
    from transformers import AutoModelForCausalLM

    from test_compressed_tensors import CASES, write_checkpoint

    groups, expected, arch, _ = CASES[case]
    write_checkpoint(str(tmp_path), groups, arch, torch.float32)
    llm = LLM(str(tmp_path), dtype="float32")
    layers = [m for m in llm.llm_engine.worker.graph.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 8 and {m.scheme for m in layers} == {expected}
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    for prompt, lp in zip(PROMPTS, _first_logprobs(llm)):
        with torch.inference_mode():
            ref = F.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ours = torch.tensor([x.logprob for x in lp.values()])
        if expected.weight_only:
            assert ours.tolist() == pytest.approx(ref[list(lp)].tolist(), abs=1e-3)
        else:
            top = {t: type("L", (), {"logprob": ref[t].item()}) for t in ref.topk(20).indices.tolist()}
            assert _kl(top, lp) < 0.05
    expected_tokens = _greedy(llm)  # and an artifact of it serves the same, without the checkpoint
    llm.llm_engine.save_artifact(str(tmp_path / "art"))
    assert _greedy(LLM(artifact=str(tmp_path / "art"))) == expected_tokens


def test_gguf_kept_quantized_matches_the_dequantized_model(smollm2_llm, smollm2_greedy, tmp_path, capsys,
                                                           monkeypatch):
    """The bundled SmolLM2 with quantization="gguf": its Q4_1 / Q8_0 blocks stay packed (weights under 30% of fp32,
    scales at GGUF's fp16), and its greedy tokens agree with the fp32 model's (the same GGUF dequantized at load) on
    the fixed prompts; on CPU through the cpu platform's C++ weight-only kernels with fp32 activations
    (GRAPHINFER_CPU_WO_ACTIVATIONS=fp32: the reference's results to fp32 rounding; its bf16 prefill and llama.cpp's
    int8 activations are tested per kernel in test_cpu_quant_kernels.py / test_cpu_quant_a8.py), not the suite's
    reference ops, which dequantize every weight at every step (most of the time this test took). An
    artifact of it serves the same tokens without the GGUF, on the reference ops (dequantize, then F.linear)."""
    from graphinfer.bench.accuracy import weight_bytes
    from graphinfer.platforms import get_platform
    from test_smollm2 import PROMPTS as SMOL_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in smollm2_greedy]
    cpu = not torch.cuda.is_available()
    if cpu:  # conftest's GRAPHINFER_CPU_KERNELS=reference would run the reference ops (conftest.engine_kernels)
        monkeypatch.delenv("GRAPHINFER_CPU_KERNELS", raising=False)
        monkeypatch.setenv("GRAPHINFER_CPU_WO_ACTIVATIONS", "fp32")
    try:
        llm = LLM(dtype="float32", max_model_len=1024, quantization="gguf")
        if cpu:
            assert llm.llm_engine.local_core.platform.kernels.get("wo_linear") == "graphinfer.ops.cpu.quant"
        fraction = weight_bytes(llm) / weight_bytes(smollm2_llm)
        assert fraction < 0.3
        outs = [o.outputs[0].token_ids for o in llm.generate(SMOL_PROMPTS, params, use_tqdm=False)]
    finally:
        if cpu:  # the reference ops again, process-wide (other tests call the ops directly)
            monkeypatch.setenv("GRAPHINFER_CPU_KERNELS", "reference")
            get_platform("cpu").activate("reference")
    same = sum(a == b for r, o in zip(ref, outs) for a, b in zip(r, o)) / sum(map(len, ref))
    with capsys.disabled():
        print(f"\ngguf kept quantized: weights {fraction:.1%} of fp32, greedy agreement with fp32 {same:.1%}")
    assert same >= 0.8, f"greedy agreement with fp32 {same:.1%}"
    llm.llm_engine.save_artifact(str(tmp_path / "art"))
    served = LLM(artifact=str(tmp_path / "art"))
    if cpu:
        assert not served.llm_engine.local_core.platform.kernels  # the reference ops
    first = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # the first 8 steps of two prompts suffice
    served_outs = served.generate(SMOL_PROMPTS[:2], first, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in served_outs] == [o[:8] for o in outs[:2]]
