"""Tensor parallel on CPU (gloo, real worker processes): greedy tokens at tp 2 (tp 3 for SmolLM2) identical to tp 1.

Every model family, loaded from HF safetensors checkpoints (so each rank reads its slices), runs one workload
that goes through chunked prefill (prompts longer than the step budget), prefix-cache hits (the same prompts
twice), preemption (a KV pool too small for the batch) and async scheduling (the workload again with it on),
in NONE for the dense Llama / Qwen2 families and with the recorded-op stand-in for the capturing modes for Qwen3 /
Qwen3-MoE (FULL_AND_PIECEWISE, so collectives run inside both full decode graphs and pieces, in every rank's replay).
"""
import functools

import pytest
import torch
from capture_standin import OpTapePlatform
from test_expert_load import count_tokens

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError
from graphinfer.models.parallel_layers import MoEExperts

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=28, max_num_seqs=6,
          max_num_batched_tokens=32)
PREFIX = list(range(3, 43))  # 40 tokens: 10 full blocks the second pass finds in the prefix cache
PROMPTS = [PREFIX + [50 + i] * (1 + 2 * i) for i in range(5)] + [[7, 8, 9], list(range(100, 133))]


def _params():
    return [SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]


def _run(llm: LLM) -> dict:
    """The workload twice (prefix-cache hits the second time), then again with async scheduling."""
    engine = llm.llm_engine
    preempted = engine.local_core.scheduler.num_preemptions
    first = llm.generate(PROMPTS, _params(), use_tqdm=False)
    second = llm.generate(PROMPTS, _params(), use_tqdm=False)
    engine.local_core.async_scheduling = True
    async_ = llm.generate(PROMPTS, _params(), use_tqdm=False)
    engine.local_core.async_scheduling = False
    return {"tokens": [[o.outputs[0].token_ids for o in run] for run in (first, second, async_)],
            "cached": sum(o.num_cached_tokens for o in second),
            "preemptions": engine.local_core.scheduler.num_preemptions - preempted}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """arch -> HF checkpoint dir; "llama_kv1": one KV head (replicated at tp 2) and a vocabulary of 251 rows
    (padded to 2 x 126 in the vocab-parallel embedding and LM head)."""
    def path(arch: str) -> str:
        if arch != "llama_kv1":
            return tiny_checkpoint(arch)[0]
        from transformers import LlamaConfig, LlamaForCausalLM

        from conftest import TINY
        torch.manual_seed(1)
        config = LlamaConfig(**{**TINY, "num_key_value_heads": 1, "vocab_size": 251}, tie_word_embeddings=False)
        out = str(tmp_path_factory.mktemp("tiny-llama-kv1"))
        LlamaForCausalLM(config).save_pretrained(out)
        return out

    return functools.cache(path)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """arch -> the tp-1 NONE run of the workload (computed once per family)."""
    return functools.cache(lambda arch: _run(LLM(checkpoints(arch), **KW)))


# One tp-2 engine per family / expert-parallel setting (each starts its own worker rank: the cost of a case): NONE for
# the dense Llama / Qwen2 families, the capture stand-in (FULL_AND_PIECEWISE) for Qwen3 and Qwen3-MoE, whose every
# check (tokens, prefix cache, async scheduling, the passes on every rank, the sharded shapes) is the same.
CASES = [("llama", False, "NONE"), ("qwen2", False, "NONE"), ("llama_kv1", False, "NONE"),
         ("qwen3", True, "FULL_AND_PIECEWISE"),  # ep on a dense model: a no-op
         ("qwen3_moe", False, "FULL_AND_PIECEWISE"), ("qwen3_moe", True, "FULL_AND_PIECEWISE")]


@pytest.mark.parametrize("arch,ep,mode", CASES, ids=[f"{a}-{'ep' if ep else 'tp'}-{m}" for a, ep, m in CASES])
def test_tp2_matches_tp1(arch, ep, mode, checkpoints, reference, monkeypatch):
    """tp 2 gives tp 1's greedy tokens (NONE) through chunked prefill, prefix-cache hits, preemption and async
    scheduling. ep: expert parallel (whole experts per rank, ep_dispatch / ep_combine); on a dense model a no-op.
    FULL_AND_PIECEWISE replays on the recorded-op stand-in on both ranks (rank 0 hands its platform class to the
    worker): uniform decode steps replay full graphs, mixed steps the pieces, collectives inside both (ep:
    ep_dispatch / ep_combine / all_gather replayed at each bucket's static shapes)."""
    ref = reference(arch)
    assert ref["cached"] > 0 and ref["preemptions"] > 0  # the workload reaches both paths
    kw = dict(KW)
    if mode != "NONE":
        monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
        kw.update(graph_mode=mode, capture_sizes=[1, 2, 4, 8, 32])
    replays = []
    with LLM(checkpoints(arch), tensor_parallel_size=2, enable_expert_parallel=ep, **kw) as llm:
        runner = llm.llm_engine.worker.model_runner
        if mode != "NONE":
            for graphs, method in ((runner.dispatcher.decode_graphs, "replay"), (runner.dispatcher.piecewise_graphs, "run")):
                original = getattr(graphs, method)
                monkeypatch.setattr(graphs, method, lambda *a, _o=original, _m=method, **k: replays.append(_m) or _o(*a, **k))
        seen = count_tokens(runner, monkeypatch)
        got = _run(llm)
        attn = runner.attn_layers[0]
        reports, config = llm.llm_engine.worker.compiled.pass_reports, llm.llm_engine.hf_config
        experts = [tuple(m.w2_weight.shape) for m in llm.llm_engine.worker.model.modules() if isinstance(m, MoEExperts)]
        load = llm.llm_engine.expert_load()
    assert got["tokens"] == ref["tokens"] and got["cached"] == ref["cached"]
    assert got["tokens"][0] == got["tokens"][2]  # async scheduling changed nothing either
    assert attn.num_heads == 2 and attn.num_kv_heads == 1  # rank 0's share (llama_kv1: its one KV head, replicated)
    assert reports.passed, reports.failures()  # every pass checked on every rank, collectives included
    fused = next(r for r in reports if r.name == "fuse_allreduce_add_rmsnorm")
    layers = config.num_hidden_layers
    moe_ep = ep and bool(experts)
    # Both row-parallel all-reduces of every layer fused (with expert parallel the MoE block has none); checked
    # with real all-reduces, where addition commutes exactly, so the fused graph's outputs are the unfused bits.
    assert fused.matches == 2 * layers - (len(experts) if moe_ep else 0) and fused.max_abs_error == 0.0
    if experts:  # rank 0 holds experts [0, E/2) whole with EP, else all E with half of each intermediate dim
        E, I = config.num_experts, config.moe_intermediate_size
        assert set(experts) == {(E // 2, config.hidden_size, I) if ep else
                                                               (E, config.hidden_size, I // 2)}
        moe = next(r for r in reports if r.name == "fuse_moe")
        assert moe.matches == len(experts) and moe.declined == []  # EP: the local experts fused into fused_experts
        # rank 0's expert load is the total: every rank routes the same tokens, padding excluded
        top_k = config.num_experts_per_tok
        assert load and all(sum(c) == sum(seen) * top_k for c in load.values())
    if mode != "NONE":
        assert {"replay", "run"} <= set(replays)


def test_bad_tensor_parallel_size_is_refused_with_the_numbers(smollm2_path):
    with pytest.raises(InvalidConfigError, match=r"tensor_parallel_size=2 .*num_attention_heads\) = 9.*one of \[1, 3\]"):
        LLM(smollm2_path, tensor_parallel_size=2, dtype="float32")
    assert not ps.is_initialized()  # refused before any rank started


def test_expert_count_not_divisible_by_the_ep_size_is_refused_with_the_numbers(checkpoints):
    """tiny Qwen3-MoE has 8 experts: 3 EP ranks cannot partition them (without EP, tp 3 fails on the heads)."""
    with pytest.raises(InvalidConfigError, match=r"tensor_parallel_size=3, data_parallel_size=1 \(expert parallel "
                                                 r"size 3\) does not partition this model's 8 experts.*one of "
                                                 r"\[1, 2, 4, 8\]"):
        LLM(checkpoints("qwen3_moe"), tensor_parallel_size=3, enable_expert_parallel=True, **KW)
    with pytest.raises(InvalidConfigError, match=r"data_parallel_size=3 \(expert parallel size 3\)"):
        LLM(checkpoints("qwen3_moe"), data_parallel_size=3, enable_expert_parallel=True, **KW)  # refused before start
    assert not ps.is_initialized()


@pytest.mark.slow  # 42 s (3 ranks on SmolLM2); the default suite runs tp 2 on every tiny family
def test_smollm2_tp3_matches_tp1_and_hf(smollm2_greedy, hf_smollm2):
    from test_smollm2 import PROMPTS as SMOL_PROMPTS, _hf_argmax

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids[:16] for o in smollm2_greedy]  # tp 1, the same batch: its first 16 tokens
    with LLM(dtype="float32", max_model_len=1024, tensor_parallel_size=3) as llm:
        outs = llm.generate(SMOL_PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    tokens = outs[0].outputs[0].token_ids
    assert tokens == _hf_argmax(hf_smollm2, outs[0].prompt_token_ids, tokens)


def test_ascend_capture_budget_counts_hccl_streams(monkeypatch):
    """vllm-ascend's update_aclgraph_sizes: with one HCCL group a 48-layer model (49 graphs per piecewise size)
    keeps (1800 - 40) / 3 / 49 = 11 sizes by default, (1800 - 2 * 49) / 2 / 49 = 17 with HCCL_OP_EXPANSION_MODE=AIV."""
    from graphinfer.platforms.npu import NpuPlatform

    npu = NpuPlatform(torch_npu=object())
    assert npu.capture_budget(0, 49) == 1800
    monkeypatch.delenv("HCCL_OP_EXPANSION_MODE", raising=False)
    assert npu.capture_budget(1, 49) // 49 == 11
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    assert npu.capture_budget(1, 49) // 49 == 17


def test_a_failed_step_on_rank_0_stops_the_group_instead_of_hanging(monkeypatch):
    """Rank 0 raises inside a step (after the others got it): the ranks are out of step, so the next step is
    refused with DistributedError, and shutdown ends the other rank (it may wait in a collective) at once."""
    llm = LLM("tiny-llama", tensor_parallel_size=2, **KW)
    runner = llm.llm_engine.worker.model_runner
    monkeypatch.setattr(runner, "sampler", lambda *a: (_ for _ in ()).throw(RuntimeError("sampler broke")))
    with pytest.raises(RuntimeError, match="sampler broke"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ps.DistributedError, match=r"out of step: step \d+ failed on rank 0 \(RuntimeError: sampler broke\)"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    ranks = llm.llm_engine.local_core.executor.ranks
    llm.shutdown()
    assert all(r.process.poll() is not None for r in ranks) and not ps.is_initialized()


@pytest.mark.slow  # ~13 s on 2 cores (budget); spec decode at tp 1: test_spec_decode.py
def test_tp2_speculative_decoding_matches_tp1(checkpoints, monkeypatch):
    """ngram speculative decoding at tp 2 under the stand-in (FULL_AND_PIECEWISE): uniform verification steps
    replay the verify graphs on both ranks (the worker picks them from the step's shapes alone), the rest the
    decode graphs or the pieces; the tokens are those of tp 1 without speculation. Repetitive prompts, so that
    every request has drafts in most steps."""
    prompts = [[5, 6, 7] * 6, [9, 10] * 8, [11, 12, 13, 14] * 4, [20] * 10]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(checkpoints("qwen3"), **KW).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(checkpoints("qwen3"), tensor_parallel_size=2, graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 32],
             speculative_config=spec, **KW) as llm:
        verify = llm.llm_engine.worker.model_runner.dispatcher.verify_graphs
        replays = []
        original = verify.replay
        monkeypatch.setattr(verify, "replay", lambda *a, **k: replays.append(len(a[0])) or original(*a, **k))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.spec_decode_stats()
    assert got == expected
    assert replays and stats["num_accepted_tokens"] > 0
