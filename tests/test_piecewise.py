"""PIECEWISE and FULL_AND_PIECEWISE: the split at attention, and the same greedy tokens as NONE.

Without a GPU the pieces are captured and replayed through test_capture's OpTapePlatform (a CPU stand-in
for device graphs that records the ops issued while capturing and re-runs them on the same tensors). With
a GPU, tests/test_capture.py's CUDA test runs the same modes with real CUDA graphs.
"""
import logging

import pytest
import torch

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.compiler.compile import check_inputs
from graphinfer.runtime.worker.graph_dispatcher import fit_graph_budget
from graphinfer.compiler.split import DEFAULT_SPLITTING_OPS, split_graph
from graphinfer.compiler.trace import node_target_name
from graphinfer.errors import InvalidConfigError
from capture_standin import OpTapePlatform
from test_capture import PROMPTS

SIZES = [1, 2, 4, 8, 16]  # max_num_batched_tokens 24 below: 17..24-token steps run eagerly


@pytest.fixture
def tape(monkeypatch):
    """Engines built after this run on the cpu platform plus the device-graph stand-in."""
    platform = OpTapePlatform()
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: platform)
    return platform


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(n=len(PROMPTS)):
    return [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(n)]


def _record_steps(llm) -> dict:
    """Counts what ran each step: piecewise replays (by real token count, with their query lengths), eager steps."""
    runner = llm.llm_engine.worker.model_runner
    seen = {"piecewise": [], "eager": 0}
    run, graph, rows = runner.dispatcher.piecewise_graphs.run, runner.graph, runner.graph_rows

    def piecewise(input_ids, positions, slots, tables, qsl, seq_lens, fill_pending=None):
        seen["piecewise"].append((len(input_ids), torch.diff(qsl).tolist()))
        return run(input_ids, positions, slots, tables, qsl, seq_lens, fill_pending)

    def eager(forward):
        def run_eagerly(*args):
            seen["eager"] += 1
            return forward(*args)
        return run_eagerly

    # an eager step runs the graph, or its sampled-rows copy (compiler/sampled_rows.py) where rows go unsampled
    runner.dispatcher.piecewise_graphs.run, runner.graph = piecewise, eager(graph)
    runner.graph_rows = rows and eager(rows)
    return seen


# ----- the split -----

def test_split_has_one_attention_per_layer_and_none_inside_pieces():
    llm = LLM("tiny-qwen3", device="cpu", max_num_seqs=4, num_gpu_blocks_override=8)  # NONE on cpu: the fused graph, uncaptured
    gm, model = llm.llm_engine.worker.graph, llm.llm_engine.worker.model
    split = split_graph(gm)
    layers = model.config.num_hidden_layers
    top = [node_target_name(n) for n in split.module.graph.nodes if n.op == "call_function"]
    assert top.count("graphinfer::paged_attention") == layers == split.info.num_splits
    assert [n.target for n in split.module.graph.nodes if n.op == "call_module"] == [f"piece_{i}" for i in range(layers + 1)]
    inside = [node_target_name(n) for p in split.pieces for n in p.graph.nodes if n.op == "call_function"]
    # The KV-cache write (folded into qk_norm_rope_cache on Qwen3) stays inside the pieces, captured with them.
    assert "graphinfer::paged_attention" not in inside and inside.count("graphinfer::qk_norm_rope_cache") == layers
    for ids, pos, md in check_inputs(model):  # the split module, pieces run eagerly, computes the fused graph
        torch.testing.assert_close(split.module(ids, pos, md), gm(ids, pos, md), rtol=0, atol=0)


def test_split_finds_identical_pieces_and_refuses_request_shaped_inputs(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3")  # 3 layers: pieces 1 and 2 differ only in the weights they read
    gm = LLM(path, device="cpu", max_num_seqs=4, num_gpu_blocks_override=8).llm_engine.worker.graph
    info = split_graph(gm).info
    assert info.num_pieces == 4 and [1, 2] in info.identical_groups and [0] in info.identical_groups
    assert "pieces 1..2 (2)" in info.summary()
    with pytest.raises(InvalidConfigError, match="block_tables"):  # attention left inside a piece
        split_graph(gm, ["graphinfer::rms_norm"])
    with pytest.raises(InvalidConfigError, match="no call of the splitting ops"):
        split_graph(gm, ["graphinfer::no_such_op"])


def test_cpu_refuses_piecewise_modes():
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        with pytest.raises(InvalidConfigError, match="the cpu platform runs NONE"):  # (eager kernels: FULL_DECODE_ONLY)
            LLM("tiny-llama", device="cpu", graph_mode=mode, num_gpu_blocks_override=8)


# ----- same tokens as NONE -----

@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe"])
def test_piecewise_modes_match_none_through_padding_and_chunked_prefill(model, monkeypatch):
    # 24 tokens a step: the longer prompts are chunked, and chunks share steps with decodes.
    kw = dict(device="cpu", max_num_seqs=8, num_gpu_blocks_override=96, block_size=4, dtype="float32", max_num_batched_tokens=24)
    expected = _tokens(LLM(model, **kw), PROMPTS, _greedy())
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        llm = LLM(model, graph_mode=mode, capture_sizes=SIZES, **kw)
        assert llm.llm_engine.worker.dispatcher.piecewise_graphs.captured_sizes == SIZES
        seen = _record_steps(llm)
        assert _tokens(llm, PROMPTS, _greedy()) == expected, mode
        counts = [t for t, _ in seen["piecewise"]]
        assert set(counts) - set(SIZES) and max(counts) <= 16  # padded token counts replayed
        assert any(1 in q and max(q) > 1 for _, q in seen["piecewise"])  # a step mixing a chunk with decodes
        assert seen["eager"] > 0  # steps over 16 tokens
        decodes = [q for _, q in seen["piecewise"] if max(q) == 1]
        if mode == "PIECEWISE":
            assert decodes  # uniform decode steps through the pieces too ...
        else:
            assert not decodes and llm.llm_engine.worker.model_runner.dispatcher.decode_graphs is not None  # ... or the full graphs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_piecewise_through_prefix_hits_and_preemption(monkeypatch, async_scheduling):
    prefix = list(range(30, 46))  # 4 shared blocks
    prompts = [prefix + [i, i + 1, 2 * i] for i in range(8)]
    kw = dict(device="cpu", max_num_seqs=8, num_gpu_blocks_override=30, block_size=4, dtype="float32", max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True) for i in range(8)]
    reference = LLM("tiny-qwen3", **kw)
    expected = _tokens(reference, prompts[:1], params[:1]) + _tokens(reference, prompts[1:], params[1:])
    assert reference.llm_engine.local_core.scheduler.num_preemptions > 0  # 30 blocks cannot hold 8 requests of ~8 blocks
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        llm = LLM("tiny-qwen3", graph_mode=mode, capture_sizes=[4, 8, 32], **kw)
        first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        rest = llm.generate(prompts[1:], params[1:], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first + rest] == expected, mode
        assert all(o.num_cached_tokens >= 16 for o in rest)  # the shared prefix came from the cache
        assert llm.llm_engine.local_core.scheduler.num_preemptions > 0


def test_padded_tokens_write_no_kv(tape):
    llm = LLM("tiny-llama", device="cpu", graph_mode="PIECEWISE", capture_sizes=[8], max_num_seqs=4, num_gpu_blocks_override=32,
              block_size=4, dtype="float32")
    engine = llm.llm_engine
    graphs = engine.worker.model_runner.dispatcher.piecewise_graphs
    engine.add_request("a", list(range(1, 8)), SamplingParams(temperature=0, max_tokens=3))
    engine.step()  # 7 tokens, padded to 8
    kv_before = engine.worker.model_runner.kv_cache.clone()
    engine.add_request("b", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # a's decode + b's 4-token prompt: 5 tokens, padded to 8
    assert graphs.slot_mapping[5:].tolist() == [-1] * 3 and graphs.positions[5:].tolist() == [0] * 3
    changed = (engine.worker.model_runner.kv_cache != kv_before).flatten(4).any(-1)  # [layers, 2, blocks, block_size]
    assert int(changed[0, 0].sum()) == 5  # the 5 real tokens' slots, nothing else


# ----- real weights -----

def test_smollm2_piecewise_matches_none(smollm2_llm, tape):
    pytest.importorskip("gguf")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i) for i in range(len(prompts))]
    none = smollm2_llm  # the shared engine where it runs on CPU (tape's stand-in is for the cpu platform) ...
    if none.llm_engine.local_core.device.type != "cpu":  # ... a CPU one of its own on a GPU machine
        none = LLM(device="cpu", dtype="float32", max_model_len=1024, seed=0, graph_mode="NONE")
    expected = _tokens(none, prompts, params)
    assert len({tuple(t) for t in expected}) == len(prompts)  # prompts whose outputs differ
    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, seed=0, graph_mode="FULL_AND_PIECEWISE", capture_sizes=[2, 16])
    seen = _record_steps(llm)
    assert _tokens(llm, prompts, params) == expected
    assert seen["piecewise"] and llm.llm_engine.worker.compiled.split.info.identical_groups[-1] != [0]


# ----- artifacts -----

def test_artifact_records_the_split_and_serves_piecewise(tape, tmp_path):
    kw = dict(device="cpu", max_num_seqs=8, num_gpu_blocks_override=64, block_size=4, dtype="float32")
    llm = LLM("tiny-qwen3", graph_mode="PIECEWISE", capture_sizes=[4, 8, 32], **kw)
    manifest = llm.llm_engine.save_artifact(str(tmp_path / "art"))
    assert manifest["graph_mode"] == "PIECEWISE"
    assert manifest["split"]["num_pieces"] == 3 and manifest["split"]["splitting_ops"] == sorted(DEFAULT_SPLITTING_OPS)
    assert "Piecewise split" in (tmp_path / "art" / "report.txt").read_text()
    expected = _tokens(llm, PROMPTS, _greedy())
    served = LLM(artifact=str(tmp_path / "art"), **kw)  # graph.py re-traced and split the same way
    assert served.llm_engine.worker.compiled.split.info == llm.llm_engine.worker.compiled.split.info
    assert _tokens(served, PROMPTS, _greedy()) == expected


# ----- Ascend's graph budget -----

def test_graph_budget_keeps_evenly_spread_sizes(caplog):
    assert fit_graph_budget([1, 2, 4, 8], graphs_per_size=3, budget=100) == [1, 2, 4, 8]
    with caplog.at_level(logging.WARNING):
        kept = fit_graph_budget(list(range(1, 21)), graphs_per_size=4, budget=21)
    assert len(kept) == 5 and kept[0] == 1 and kept[-1] == 20
    assert "5 of 20" in caplog.text and "4 graphs" in caplog.text


def test_engine_applies_the_platform_graph_budget(tape):
    tape.max_capture_graphs = 3 + 2 * 3  # three decode graphs, then room for two sizes of three pieces
    llm = LLM("tiny-llama", device="cpu", graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 16], max_num_seqs=4,
              num_gpu_blocks_override=32, dtype="float32")
    runner = llm.llm_engine.worker.model_runner
    assert sorted(runner.dispatcher.decode_graphs.graphs) == [1, 2, 4]
    assert runner.dispatcher.piecewise_graphs.captured_sizes == [1, 16]
