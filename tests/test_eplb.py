"""EPLB while serving (runtime/worker/eplb_state.py) on CPU (gloo, real rank processes): a tiny Qwen3-MoE whose
router is skewed toward the experts of EP rank 1, at tp 2 + EP and at dp 2 + EP, EPLB on with 2 redundant experts and
a short interval: greedy tokens equal HF's (the perturbed model in transformers) before, during and after several
rearrangements, under the recorded-op capture stand-in (captured graphs replayed across placement changes) and in
NONE (slow); the last window's EP-rank imbalance is below the same load's under the plain placement; the placement
saved as an expert map starts an engine again. Plus the op, the move plan, the settings' refusals."""
import json

import pytest
import torch
from capture_standin import OpTapePlatform

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.config import EngineConfig
from graphinfer.eplb import initial_placement, load_expert_map
from graphinfer.eplb.transfer import plan_moves
from graphinfer.errors import InvalidConfigError
from graphinfer.models.parallel_layers import logical_maps_of

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=64, max_num_seqs=4,
          max_num_batched_tokens=16)
EPLB = dict(enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"window_size": 3, "step_interval": 4, "num_redundant_experts": 2})
PROMPTS = [[3 + i] * (2 + 5 * i) for i in range(3)] + [list(range(100, 121))]
HOT = (4, 5)  # experts of EP rank 1 (of 8 over 2 ranks) the router prefers


def _params(n=10):
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _ in PROMPTS]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def skewed(tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, HF greedy tokens of PROMPTS for 10 and 6 new tokens): tiny Qwen3-MoE with an offset in one
    hidden dimension of every embedding and router rows that favour HOT along it, so most tokens go to rank 1."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_checkpoint("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] += 2.0
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                for e in HOT:
                    layer.mlp.gate.weight[e, 0] += 3.0 if e == HOT[0] else 2.0
    out = str(tmp_path_factory.mktemp("tiny-qwen3-moe-skewed"))
    hf.save_pretrained(out)
    with torch.no_grad():
        ref = {n: [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p):]
                   .tolist() for p in PROMPTS] for n in (10, 6)}
    return out, ref


def _check_engine(llm, ref):
    """Tokens equal HF's before, during and after rearrangements; the last window balanced better than plain."""
    engine = llm.llm_engine
    assert engine.eplb_stats()["rearrangements"] == 0
    first = llm.generate(PROMPTS, _params(), use_tqdm=False)  # rearranges every 4 steps meanwhile
    mid = engine.eplb_stats()
    second = llm.generate(PROMPTS, _params(6), use_tqdm=False)
    stats = engine.eplb_stats()
    assert _tokens(first) == ref[10] and _tokens(second) == ref[6]
    assert mid["rearrangements"] >= 2 and stats["rearrangements"] > mid["rearrangements"], stats
    last = stats["last"]
    assert last["window_steps"] == 3 and last["rank_imbalance_without_eplb"] > 1.3, last
    assert last["rank_imbalance"] < last["rank_imbalance_without_eplb"], last
    assert stats["moved_bytes_total"] > 0 and stats["num_physical_experts"] == 10
    return stats


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_eplb_tokens_match_hf_across_rearrangements_captured(layout, skewed, monkeypatch, tmp_path):
    path, ref = skewed
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    size = {"tensor_parallel_size": 2} if layout == "tp2" else {"data_parallel_size": 2}
    kw = dict(KW, graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8])
    with LLM(path, **size, **EPLB, **kw) as llm:
        runner = llm.llm_engine.local_core.worker.model_runner if layout == "tp2" else \
            llm.llm_engine.engine_core.local.worker.model_runner
        replays = []
        graphs = runner.dispatcher.decode_graphs
        original = graphs.replay
        monkeypatch.setattr(graphs, "replay", lambda *a, **k: replays.append(runner.eplb.rearrangements) or
                            original(*a, **k))
        _check_engine(llm, ref)
        assert len(set(replays)) >= 2  # the same decode graphs replayed under several placements
        saved = llm.llm_engine.save_expert_map(str(tmp_path / "map.json"))
    placement = load_expert_map(saved, 8, 2)
    assert placement.shape == (2, 10) and not torch.equal(placement[0], initial_placement(1, 8, 2)[0])
