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
from graphinfer.server.metrics import Metrics
from graphinfer import LLM, SamplingParams
from graphinfer.config import EngineConfig
from graphinfer.eplb import initial_placement, load_expert_map
from graphinfer.eplb.transfer import keep_in_place, plan_moves
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
    """(checkpoint dir, HF greedy tokens of PROMPTS for 10 and 6 new tokens): tiny Qwen3-MoE with a small offset in
    one hidden dimension of every embedding and router rows that favour HOT along it, so ~85% of the routed slots go to
    rank 1's experts (the plain placement's EP-rank imbalance ~1.7)."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_checkpoint("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] += 0.05
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                for e in HOT:
                    layer.mlp.gate.weight[e, 0] += 1.05 if e == HOT[0] else 0.7
                # experts 6x: their outputs steer the tokens, so an expert's weights in a wrong slot change them
                layer.mlp.experts.gate_up_proj.mul_(6.0)
                layer.mlp.experts.down_proj.mul_(6.0)
    out = str(tmp_path_factory.mktemp("tiny-qwen3-moe-skewed"))
    hf.save_pretrained(out)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p):]
               .tolist() for p in PROMPTS]
    return out, {10: ref, 6: [r[:6] for r in ref]}  # greedy: 6 tokens are the first 6 of 10


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


def _runner(llm, layout):
    engine = llm.llm_engine
    return (engine.local_core if layout == "tp2" else engine.engine_core.local).worker.model_runner


def _size(layout) -> dict:
    return {"tensor_parallel_size": 2} if layout == "tp2" else {"data_parallel_size": 2}


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_eplb_tokens_match_hf_across_rearrangements_captured(layout, skewed, monkeypatch, tmp_path):
    """Under the capture stand-in (FULL_AND_PIECEWISE): the decode graphs captured at start replay under several
    placements; /metrics exports the rearrangements; the placement saved as an expert map is a valid one."""
    path, ref = skewed
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    kw = dict(KW, graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8])
    with LLM(path, **_size(layout), **EPLB, **kw) as llm:
        runner = _runner(llm, layout)
        replays = []
        graphs = runner.dispatcher.decode_graphs
        original = graphs.replay
        monkeypatch.setattr(graphs, "replay", lambda *a, **k: replays.append(runner.eplb.rearrangements) or
                            original(*a, **k))
        stats = _check_engine(llm, ref)
        assert len(set(replays)) >= 2  # the same decode graphs replayed under several placements
        metrics = Metrics("m")
        metrics.watch_eplb(llm.llm_engine)
        text = metrics.render().decode()
        saved = llm.llm_engine.save_expert_map(str(tmp_path / "map.json"))
    # values as prometheus_client writes them (Go's float format: 1155072.0 is "1.155072e+06")
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("graphinfer:eplb_")}
    assert samples["graphinfer:eplb_rearrangements_total"] == stats["rearrangements"]
    assert samples["graphinfer:eplb_moved_bytes_total"] == stats["moved_bytes_total"]
    assert "graphinfer:eplb_ep_rank_imbalance{" in text and "graphinfer:eplb_ep_rank_imbalance_without_eplb{" in text
    placement = load_expert_map(saved, 8, 2)
    assert placement.shape == (2, 10) and not torch.equal(placement[0], initial_placement(1, 8, 2)[0])


@pytest.mark.parametrize("layout", [pytest.param("tp2", marks=pytest.mark.slow), "dp2"])
def test_eplb_tokens_match_hf_across_rearrangements_none(layout, skewed):
    """The same in NONE (eager graphs), with async scheduling (tp 2: slow, the default suite's budget)."""
    path, ref = skewed
    with LLM(path, **_size(layout), **EPLB, **KW, async_scheduling=True) as llm:
        _check_engine(llm, ref)


@pytest.mark.slow
def test_expert_map_path_starts_from_a_saved_placement(skewed, tmp_path):
    """A placement saved from an EPLB engine, loaded with expert_map_path (static: no EPLB), serves HF's tokens on
    that placement's replicas."""
    path, ref = skewed
    with LLM(path, tensor_parallel_size=2, **EPLB, **KW) as llm:
        llm.generate(PROMPTS, _params(), use_tqdm=False)
        saved = llm.llm_engine.save_expert_map(str(tmp_path / "map.json"))
    placement = load_expert_map(saved, 8, 2)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, expert_map_path=saved, **KW) as llm:
        layers = _runner(llm, "tp2").moe_layers
        assert [m.placement for m in layers.values()] == placement.tolist()
        assert llm.llm_engine.eplb_stats() == {"enabled": False}
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == ref[10]


# ----- pieces, in one process -----

def test_map_op_spreads_replicas_and_counts_real_rows_only():
    """Slot t*K+k takes replica (t*K+k) % count (vLLM's rule); the physical load counts the first num_tokens rows."""
    placement = [0, 1, 2, 3, 1, 1]  # expert 1 has three replicas: slots 1, 4, 5
    log2phy, count = logical_maps_of(placement, 4)
    assert log2phy.tolist()[1] == [1, 4, 5] and count.tolist() == [1, 3, 1, 1]
    ids = torch.tensor([[1, 0], [1, 2], [1, 3], [3, 1]])
    load = torch.zeros(6, dtype=torch.int64)
    phys = torch.ops.graphinfer.eplb_map_to_physical_and_record(ids, log2phy, count, load, torch.tensor([3]))
    assert phys.tolist() == [[1, 0], [5, 2], [4, 3], [3, 4]]  # expert 1 at positions 0, 2, 4, 7: replicas 0, 2, 1, 1
    assert load.tolist() == [1, 1, 1, 1, 1, 1]  # the last row is padding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_map_op_in_a_cuda_graph_follows_a_rewritten_map():
    """The op captured in a CUDA graph reads the maps at their addresses: after they are rewritten in place (a
    rearrangement) a replay routes by the new placement, and counts into the same load buffer."""
    dev = "cuda"
    ids = torch.tensor([[1, 0], [1, 2], [1, 3], [3, 1]], device=dev)
    log2phy, count = (t.to(dev) for t in logical_maps_of([0, 1, 2, 3, 1, 1], 4))
    load, n = torch.zeros(6, dtype=torch.int64, device=dev), torch.tensor([4], device=dev)
    op = torch.ops.graphinfer.eplb_map_to_physical_and_record
    op(ids, log2phy, count, load, n)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        phys = op(ids, log2phy, count, load, n)
    load.zero_()
    graph.replay()
    assert phys.tolist() == [[1, 0], [5, 2], [4, 3], [3, 4]] and int(load.sum()) == 8
    new_log2phy, new_count = logical_maps_of([1, 1, 0, 2, 3, 1], 4)  # expert 1 now at slots 0, 1, 5
    log2phy.copy_(new_log2phy)
    count.copy_(new_count)
    graph.replay()
    torch.cuda.synchronize()
    assert phys.tolist() == [[0, 2], [5, 3], [1, 4], [4, 1]] and load.tolist() == [2, 3, 2, 3, 4, 2]


@pytest.mark.parametrize("seed", range(4))
def test_move_plan_turns_the_old_placement_into_the_new(seed):
    """Applying the planned copies (all reading the old weights) to 'weights' that are their expert's id gives the
    new placement; experts a rank already held are copied locally, never sent."""
    from graphinfer.eplb import rebalance_experts

    g = torch.Generator().manual_seed(seed)
    old = initial_placement(1, 8, 4)[0].tolist()
    new = rebalance_experts(torch.randint(0, 100, (1, 8), generator=g), 12, 1, 1, 4)[0][0].tolist()
    per = 3
    moves = plan_moves(old, new, 4)
    got = list(old)
    for m in moves:
        got[m.dst_rank * per + m.dst_slot] = old[m.src_rank * per + m.src_slot]
        held_here = old[m.dst_rank * per:(m.dst_rank + 1) * per]
        assert (m.src_rank == m.dst_rank) == (new[m.dst_rank * per + m.dst_slot] in held_here)
    assert got == new
    assert moves == sorted(moves, key=lambda m: (m.dst_rank, m.dst_slot))
    # the same experts per rank, each one a rank keeps left in its slot: as many slots unchanged as can be, the same
    # sends; a copy within a rank only for an extra replica of an expert it keeps
    from collections import Counter

    kept = keep_in_place(old, new, 4)
    unchanged = 0
    for r in range(4):
        o, n = Counter(old[r * per:(r + 1) * per]), Counter(new[r * per:(r + 1) * per])
        assert Counter(kept[r * per:(r + 1) * per]) == n
        unchanged += sum((o & n).values())
    assert sum(a == b for a, b in zip(old, kept)) == unchanged
    kept_moves = plan_moves(old, kept, 4)
    assert all(kept[m.src_rank * per + m.src_slot] == old[m.src_rank * per + m.src_slot]
               for m in kept_moves if m.src_rank == m.dst_rank)
    assert sum(m.src_rank != m.dst_rank for m in kept_moves) == sum(m.src_rank != m.dst_rank for m in moves)


def test_settings_refuse_what_cannot_work(skewed, tiny_checkpoint):
    path, _ = skewed
    with pytest.raises(InvalidConfigError, match="enable_expert_parallel"):
        EngineConfig.from_kwargs(enable_eplb=True, tensor_parallel_size=2)
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size x data_parallel_size > 1"):
        EngineConfig.from_kwargs(enable_eplb=True, enable_expert_parallel=True)
    with pytest.raises(InvalidConfigError, match="unknown key"):
        EngineConfig.from_kwargs(eplb_config={"num_redundant": 2})
    with pytest.raises(InvalidConfigError, match="needs enable_eplb"):
        EngineConfig.from_kwargs(eplb_config={"num_redundant_experts": 2}, enable_expert_parallel=True,
                                 tensor_parallel_size=2)
    # refused before any rank starts: 8 + 1 physical experts over 2 ranks; a dense model
    with pytest.raises(InvalidConfigError, match="num_redundant_experts=2"):
        LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"num_redundant_experts": 1}, **KW)
    with pytest.raises(InvalidConfigError, match="dense model"):
        LLM(tiny_checkpoint("qwen3")[0], tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, **KW)
    bad = {"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
        {"device_id": 0, "device_expert": [0, 1, 2, 3]}, {"device_id": 1, "device_expert": [4, 5, 6, 0]}]}]}
    with pytest.raises(InvalidConfigError, match=r"logical experts \[7\] have no replica"):
        from graphinfer.eplb import placement_from_json
        placement_from_json(bad, 8, 2)


@pytest.mark.slow
def test_bench_moe_balance_eplb(skewed, tmp_path, capsys):
    """`bench moe-balance --eplb`: two EP ranks with EPLB on the skewed model; the JSON has the last window's
    imbalance with and without it and the moved bytes."""
    from graphinfer.bench.moe_balance import run

    out = tmp_path / "eplb.json"
    result = run(skewed[0], ep_size=2, dtype="float32", device="cpu", num_prompts=8, min_len=16, max_len=48,
                 max_model_len=512, eplb=True, eplb_config={"step_interval": 6, "window_size": 4},
                 output_json=str(out))
    stats = json.loads(out.read_text())["eplb"]
    assert stats == json.loads(json.dumps(result["eplb"]))
    assert stats["rearrangements"] >= 2 and stats["num_physical_experts"] == 10 and stats["moved_bytes_total"] > 0
    assert len(stats["history"]) == stats["rearrangements"]
    assert "mean over EPLB-placed windows" in capsys.readouterr().out
