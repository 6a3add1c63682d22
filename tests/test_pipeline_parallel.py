"""Pipeline parallel on CPU (gloo, real worker processes): the greedy tokens of HF transformers (and of the one-rank
engine) at pp 2, and at pp 2 x tp 2, with several batches in flight.

One workload goes through chunked prefill (prompts longer than the step budget), prefix-cache hits (the same prompts
twice) and preemption (a KV pool too small for the batch): NONE for a 4-layer Llama (norm gains perturbed, so a stage
that skipped or repeated a layer or a norm would change the tokens), the recorded-op stand-in for the capturing modes
for Qwen3 and Qwen3-MoE (FULL_AND_PIECEWISE: send / recv replayed inside full decode graphs and pieces).
"""
import functools

import pytest
import torch
from capture_standin import OpTapePlatform
from hf_zoo import hf_greedy, perturb_constants

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError, InvalidRequestError
from graphinfer.models.pipeline_stage import PPMissingLayer, stage_layer_counts

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=28, max_num_seqs=6,
          max_num_batched_tokens=32)
PREFIX = list(range(3, 43))  # 40 tokens: 10 full blocks the second pass finds in the prefix cache
PROMPTS = [PREFIX + [50 + i] * (1 + 2 * i) for i in range(5)] + [[7, 8, 9], list(range(100, 133))]
MAX_TOKENS = [5 + 2 * i for i in range(len(PROMPTS))]


def _params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _run(llm: LLM) -> dict:
    """The workload twice (prefix-cache hits the second time)."""
    core = llm.llm_engine.local_core
    preempted = core.scheduler.num_preemptions
    first = llm.generate(PROMPTS, _params(), use_tqdm=False)
    second = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return {"tokens": [[o.outputs[0].token_ids for o in run] for run in (first, second)],
            "cached": sum(o.num_cached_tokens for o in second),
            "preemptions": core.scheduler.num_preemptions - preempted}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """arch -> HF checkpoint dir; "llama4": 4 layers, untied head, norm gains perturbed."""
    def path(arch: str) -> str:
        if arch != "llama4":
            return tiny_checkpoint(arch)[0]
        from transformers import LlamaConfig, LlamaForCausalLM

        from conftest import TINY
        torch.manual_seed(2)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 4}, tie_word_embeddings=False))
        perturb_constants(model)
        out = str(tmp_path_factory.mktemp("tiny-llama4"))
        model.save_pretrained(out)
        return out

    return functools.cache(path)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """arch -> the one-rank NONE run of the workload."""
    return functools.cache(lambda arch: _run(LLM(checkpoints(arch), **KW)))


# The default suite runs the Llama in NONE and Qwen3-MoE under the stand-in (~25 s and ~7 s on 2 cores); Qwen3 under
# the stand-in and pp 2 x tp 2 (4 ranks, ~40 s each) are slow.
CASES = [("llama4", 1, "NONE"), pytest.param("qwen3", 1, "FULL_AND_PIECEWISE", marks=pytest.mark.slow),
         ("qwen3_moe", 1, "FULL_AND_PIECEWISE"), pytest.param("llama4", 2, "NONE", marks=pytest.mark.slow),
         pytest.param("llama4", 2, "FULL_AND_PIECEWISE", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch,tp,mode", CASES, ids=["llama4-pp2-NONE", "qwen3-pp2-FULL_AND_PIECEWISE",
                                                     "qwen3_moe-pp2-FULL_AND_PIECEWISE", "llama4-pp2xtp2-NONE",
                                                     "llama4-pp2xtp2-FULL_AND_PIECEWISE"])
def test_pp2_matches_one_rank_and_hf(arch, tp, mode, checkpoints, reference, monkeypatch):
    """pp 2 (and pp 2 x tp 2: 4 ranks) gives the one-rank engine's greedy tokens, and HF's for the Llama, through
    chunked prefill, prefix-cache hits and preemption, with two batches in flight; each stage holds its layers only
    (and its KV cache for them); under the stand-in the decode graphs and the pieces replay on every stage."""
    ref = reference(arch)
    assert ref["cached"] > 0 and ref["preemptions"] > 0  # the workload reaches both paths
    if arch == "llama4":
        hf = hf_greedy(checkpoints(arch), PROMPTS, max(MAX_TOKENS))
        assert ref["tokens"][0] == [t[:n] for t, n in zip(hf, MAX_TOKENS)]
    kw = dict(KW)
    if mode != "NONE":
        monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
        kw.update(graph_mode=mode, capture_sizes=[1, 2, 4, 8, 32])
    replays = []
    with LLM(checkpoints(arch), pipeline_parallel_size=2, tensor_parallel_size=tp, **kw) as llm:
        core = llm.llm_engine.local_core
        runner = core.worker.model_runner
        if mode != "NONE":
            for graphs, method in ((runner.dispatcher.decode_graphs, "replay"),
                                   (runner.dispatcher.piecewise_graphs, "run")):
                original = getattr(graphs, method)
                monkeypatch.setattr(graphs, method,
                                    lambda *a, _o=original, _m=method, **k: replays.append(_m) or _o(*a, **k))
        got = _run(llm)
        busy = core.pipeline_busy()
        layers = core.worker.model.model.layers
        cache_layers = runner.kv_cache.shape[0]
        in_flight = core.max_batches_in_flight
    assert got["tokens"] == ref["tokens"]
    assert got["cached"] > 0 and got["preemptions"] > 0  # (how many: the batch queue schedules differently)
    assert in_flight == 2  # a batch per stage: the first stage ran batch k+1 while the second ran batch k
    assert len(busy) == 2 and all(b > 0 for b in busy)
    first = stage_layer_counts(len(layers), 2)[0]
    assert [isinstance(layer, PPMissingLayer) for layer in layers] == [False] * first + [True] * (len(layers) - first)
    assert cache_layers == first  # rank 0's KV cache: its stage's layers only
    if mode != "NONE":
        assert {"replay", "run"} <= set(replays)


def test_layer_partition_and_refusals(checkpoints):
    """The even split gives the first stages the extra layer; vLLM's VLLM_PP_LAYER_PARTITION-style override is
    checked against the model; what pipeline parallel does not run with yet is refused before any rank starts."""
    assert stage_layer_counts(4, 2) == [2, 2] and stage_layer_counts(5, 3) == [2, 2, 1]
    assert stage_layer_counts(4, 2, "1,3") == [1, 3]
    with pytest.raises(InvalidConfigError, match=r"pp_layer_partition='2,1'.*summing to the model's 4"):
        LLM(checkpoints("llama4"), pipeline_parallel_size=2, pp_layer_partition="2,1", **KW)
    with pytest.raises(InvalidConfigError, match=r"pipeline_parallel_size=5 exceeds the model's 4 decoder layers"):
        LLM(checkpoints("llama4"), pipeline_parallel_size=5, **KW)
    for flag, kw in (("--speculative-config", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2})),
                     ("--enable-lora", dict(enable_lora=True)), ("--data-parallel-size", dict(data_parallel_size=2)),
                     ("--async-scheduling", dict(async_scheduling=True))):
        with pytest.raises(InvalidConfigError, match=f"pipeline_parallel_size=2 does not run with {flag}"):
            LLM(checkpoints("llama4"), pipeline_parallel_size=2, **kw, **KW)
    assert not ps.is_initialized()


@pytest.mark.slow  # 13 s: the even split runs in the default suite
def test_uneven_partition_and_refused_requests(checkpoints, monkeypatch):
    """VLLM_PP_LAYER_PARTITION (vLLM's env var) puts 1 layer on the first stage and 3 on the second: HF's tokens
    still; a request for prompt logprobs is refused with the flag named."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(checkpoints("llama4"), pipeline_parallel_size=2, **KW) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
        layers = llm.llm_engine.local_core.worker.model.model.layers
        sampled = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=6,
                                                           logprobs=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        with pytest.raises(InvalidRequestError, match="prompt_logprobs is not supported with pipeline_parallel_size=2"):
            llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=1), use_tqdm=False)
    assert [isinstance(layer, PPMissingLayer) for layer in layers] == [False, True, True, True]
    assert got == hf_greedy(checkpoints("llama4"), PROMPTS[:3], 6)
    assert len(sampled.token_ids) == 6 and len(sampled.logprobs) == 6  # the sampler's other paths, on rank 0


@pytest.mark.slow  # waits out a 20 s timeout
def test_a_stalled_stage_fails_within_the_timeout_naming_rank_stage_and_step():
    """A stage that stalls (SIGSTOP) makes rank 0's wait for its rows fail within the distributed timeout, naming
    rank 0, its stage and the step; shutdown then ends the stalled rank. Nothing hangs."""
    import os
    import signal

    # 20 s: the rendezvous waits as long (room for a busy machine's start-up)
    llm = LLM("tiny-llama", pipeline_parallel_size=2, distributed_timeout=20.0, **KW)
    (stage1,) = llm.llm_engine.local_core.executor.ranks
    os.kill(stage1.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ps.DistributedError, match=r"rank 0 of 2 \(pipeline stage 0 of 2\): receive of the final "
                                                      r"hidden rows from pipeline stage 1 .*during step \d+"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        os.kill(stage1.process.pid, signal.SIGCONT)
        llm.shutdown()
    assert stage1.process.poll() is not None and not ps.is_initialized()


def test_a_dead_stage_ends_the_engine_naming_it():
    """A stage's process killed: the next step fails with an error naming that rank and its stage (RankMonitor), not
    a hang."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM("tiny-llama", pipeline_parallel_size=2, **KW)
    assert llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    (stage1,) = llm.llm_engine.local_core.executor.ranks
    stage1.process.kill()
    stage1.process.wait()
    with pytest.raises(ps.DistributedError, match=r"rank 1 \(pipeline stage 1\) \(pid \d+\) exited"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    llm.shutdown()
    assert not ps.is_initialized()


@pytest.mark.slow  # 25 s: a compile and a pp 2 engine
def test_pp2_artifact_has_a_graph_and_weights_per_stage(checkpoints, tmp_path):
    """`compile -pp 2` writes each stage's graph and each rank's weights (its layers only); serving it runs at pp 2
    (taken from the artifact) and gives the checkpoint's tokens; another pp size is refused with the recompile
    command."""
    import contextlib
    import io
    import json
    import os

    from safetensors.torch import load_file

    from graphinfer.cli import main
    from graphinfer.errors import ArtifactMismatchError

    art = str(tmp_path / "art")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["compile", checkpoints("llama4"), "-o", art, "--device", "cpu", "--dtype", "float32",
                     "-pp", "2", "--pp-layer-partition", "1,3"]) == 0
    files = sorted(json.load(open(os.path.join(art, "manifest.json")))["files"])
    assert [f for f in files if not f.startswith("tokenizer/")] == [
        "config.json", "graph-stage0-of-2.py", "graph-stage1-of-2.py", "model-rank0-of-2.safetensors",
        "model-rank1-of-2.safetensors"]
    layers = [{int(k.split(".")[2]) for k in load_file(os.path.join(art, f"model-rank{r}-of-2.safetensors"))
               if k.startswith("model.layers.")} for r in range(2)]
    assert layers == [{0}, {1, 2, 3}]
    assert "recv" in open(os.path.join(art, "graph-stage1-of-2.py")).read()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(artifact=art, **{k: v for k, v in KW.items() if k not in ("dtype",)}) as llm:
        assert llm.llm_engine.config.parallel_config.pipeline_parallel_size == 2
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert got == hf_greedy(checkpoints("llama4"), PROMPTS[:3], 6)
    with pytest.raises(ArtifactMismatchError, match=r"compiled for pipeline_parallel_size=2, but this engine runs "
                                                    r"pipeline_parallel_size=4.*graphinfer compile .* --pipeline-"
                                                    r"parallel-size 4"):
        LLM(artifact=art, pipeline_parallel_size=4, **KW)
    assert not ps.is_initialized()


@pytest.mark.slow  # ~12 s on 2 cores
def test_pp2_deepseek_v3_gives_hf_greedy_tokens(deepseek_checkpoint):
    """DeepSeek-V3 (MLA latent cache, dense first layers, routed + shared experts) cut into two stages."""
    from test_deepseek import KW as DEEPSEEK_KW
    from test_deepseek import NEW, ZOO_PROMPTS, assert_engine_matches_hf

    path = deepseek_checkpoint("deepseek_v3")
    with LLM(path, pipeline_parallel_size=2, **DEEPSEEK_KW) as llm:
        assert_engine_matches_hf(llm, path, hf_greedy(path, ZOO_PROMPTS, NEW))
        assert isinstance(llm.llm_engine.worker.model.model.layers[-1], PPMissingLayer)  # stage 0 holds the first half
