"""EPLB's balancing policy (graphinfer/eplb/policy.py) on load matrices, and vLLM-Ascend's expert-map JSON
(graphinfer/eplb/expert_map.py): invariants, balance, determinism, vLLM's own expected placement, round trips and
each refusal. Pure host code: fast, no model."""
import json

import numpy as np
import pytest
import torch

from graphinfer.eplb import (balancedness, initial_placement, load_expert_map, logical_maps, placement_from_json,
                             placement_to_json, rank_imbalance, rank_load, rebalance_experts, save_expert_map)
from graphinfer.errors import InvalidConfigError

# (num_logical, num_replicas, num_groups, num_nodes, num_gpus): hierarchical (2 nodes; 4 nodes), global (groups do
# not divide nodes), one GPU, no redundancy, many replicas of few experts.
SHAPES = [(12, 16, 4, 2, 8), (16, 24, 8, 4, 8), (16, 20, 3, 2, 4), (8, 8, 1, 1, 1), (16, 16, 4, 2, 4),
          (4, 12, 2, 1, 2), (64, 72, 8, 2, 8)]


def _loads(num_layers, num_logical, seed=0):
    """Skewed load matrices: one hot expert, Zipf, random, all equal (a layer each)."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.ones(num_logical)
    hot[num_logical // 2] = 50.0 * num_logical
    zipf = 1000.0 / torch.arange(1, num_logical + 1, dtype=torch.float64)
    zipf = zipf[torch.randperm(num_logical, generator=g)]
    rand = torch.randint(0, 1000, (num_logical,), generator=g).double()
    equal = torch.full((num_logical,), 7.0)
    rows = [hot, zipf, rand, equal]
    return torch.stack([rows[i % 4].double() for i in range(num_layers)])


def _check_invariants(phy2log, log2phy, count, weight, num_replicas, num_gpus):
    L, E = weight.shape
    assert phy2log.shape == (L, num_replicas) and phy2log.dtype == torch.int64
    assert log2phy.shape == (L, E, num_replicas - E + 1) and count.shape == (L, E)
    assert ((phy2log >= 0) & (phy2log < E)).all()
    assert (count >= 1).all(), "every logical expert keeps a replica"
    assert (count.sum(-1) == num_replicas).all(), "replica counts add up to the physical experts"
    # count is what phy2log says; log2phy lists exactly those slots, ascending, -1 padded, and maps back
    assert torch.equal(count, torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log)))
    for layer in range(L):
        for e in range(E):
            slots = log2phy[layer, e]
            n = int(count[layer, e])
            assert (slots[n:] == -1).all()
            assert slots[:n].tolist() == sorted(slots[:n].tolist())
            assert (phy2log[layer, slots[:n]] == e).all()
    assert sum(int(count[layer].sum()) for layer in range(L)) == L * num_replicas  # every slot listed once
    assert num_replicas % num_gpus == 0  # equal slots per rank: rank r owns [r * per, (r + 1) * per)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}-R{}-g{}-n{}-gpu{}".format(*s))
def test_invariants_and_balance(shape):
    E, R, groups, nodes, gpus = shape
    weight = _loads(8, E, seed=E + R)
    phy2log, log2phy, count = rebalance_experts(weight, R, groups, nodes, gpus)
    _check_invariants(phy2log, log2phy, count, weight, R, gpus)
    # the busiest rank does less than under vLLM's starting placement on the skewed layers (a single hot expert only
    # when there are redundant slots to copy it to: otherwise its rank carries it whole either way). Greedy packing
    # is a heuristic: on an already even random load it may end a little worse than the identity, so no bound there.
    after = rank_load(phy2log, weight, gpus).max(-1).values
    before = rank_load(initial_placement(8, E, R - E), weight, gpus).max(-1).values
    if gpus > 1:
        skewed = [layer for layer in range(8) if layer % 4 == 1 or (layer % 4 == 0 and R > E)]  # Zipf, one hot
        assert (after[skewed] < before[skewed]).all()
        assert balancedness(rank_load(phy2log, weight, gpus)) > balancedness(
            rank_load(initial_placement(8, E, R - E), weight, gpus))


def test_redundancy_goes_to_the_hot_expert():
    """One expert with most of the tokens gets every redundant slot, each copy on another rank, and the busiest rank
    carries one copy's share instead of the whole expert."""
    E, R, gpus = 16, 20, 4
    weight = torch.ones(1, E)
    weight[0, 5] = 1000.0
    phy2log, log2phy, count = rebalance_experts(weight, R, 1, 1, gpus)
    assert count[0, 5] == 5 and (count[0, torch.arange(E) != 5] == 1).all()
    ranks = {int(p) // (R // gpus) for p in log2phy[0, 5, :5]}
    assert len(ranks) == gpus  # spread over every rank (5 copies, 4 ranks: one rank has two)
    before = rank_imbalance(initial_placement(1, E, R - E), weight, gpus)
    after = rank_imbalance(phy2log, weight, gpus)
    assert before[0] > 3.5 and after[0] < 2.0


def test_vllm_published_example():
    """DeepSeek EPLB's README example, the expected placement of vLLM's test: tests/distributed/test_eplb_algo.py
    test_basic_rebalance (vllm-project/vllm @ 030ea52effcb05071543c8c42b8f0145e94cee43); the same algorithm as
    vllm/distributed/eplb/rebalance_algo.py @ 07fb932a49cb8ee0762ce29009a11726051a22ab and policy/default.py
    @ 02c1119c578212d6d51339bc88ad6d12f96e08c2."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, count = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert count.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy[0, 1].tolist() == [13, 15, -1, -1, -1]  # expert 1's two replicas, ascending
    _check_invariants(phy2log, log2phy, count, weight.double(), 16, 8)


def test_hierarchical_keeps_groups_on_one_node():
    """Node-aware: every replica of a group's experts sits on the node the group was packed to, and each node holds
    num_groups / num_nodes whole groups."""
    E, R, groups, nodes, gpus = 16, 24, 8, 2, 8
    weight = _loads(4, E, seed=3)
    phy2log, _, _ = rebalance_experts(weight, R, groups, nodes, gpus)
    per_node = R // nodes
    for layer in range(4):
        node_of_group = {}
        for p, e in enumerate(phy2log[layer].tolist()):
            assert node_of_group.setdefault(e // (E // groups), p // per_node) == p // per_node
        assert sorted(list(node_of_group.values()).count(n) for n in range(nodes)) == [groups // nodes] * nodes


def test_hierarchical_and_global_agree_where_both_apply():
    """One node: packing the groups onto it only reorders the experts, so without ties the placement is the global
    one exactly. Groups that do not divide the nodes fall back to the global form."""
    weight = torch.rand(6, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1000
    glob = rebalance_experts(weight, 40, 1, 1, 8)
    for groups in (2, 4, 8):
        hier = rebalance_experts(weight, 40, groups, 1, 8)
        for a, b in zip(hier, glob):
            assert torch.equal(a, b)
    fallback = rebalance_experts(weight, 40, 3, 2, 8)  # 3 groups over 2 nodes
    for a, b in zip(fallback, glob):
        assert torch.equal(a, b)


def test_deterministic_for_equal_loads():
    """Equal loads: the same placement every time, and a defined one: groups to nodes in order, redundant slots to
    the lowest expert indices first, replicas packed heaviest first (ties by index) into the lightest rank (ties by
    rank), so equal replicas are dealt round-robin over a node's ranks."""
    weight = torch.full((2, 8), 5.0)
    a = rebalance_experts(weight, 8, 2, 2, 4)
    b = rebalance_experts(weight.clone(), 8, 2, 2, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].tolist() == [[0, 2, 1, 3, 4, 6, 5, 7]] * 2  # node 0: ranks 0, 1 get [0, 2], [1, 3]; node 1 alike
    assert (a[2] == 1).all()

    phy2log, _, count = rebalance_experts(torch.full((1, 4), 5.0), 8, 1, 1, 2)
    assert count.tolist() == [[2, 2, 2, 2]]
    # 8 replicas of load 2.5, stable order [0, 1, 2, 3, 0', 1', 2', 3'], alternately into ranks 0, 1 (the lighter)
    assert phy2log.tolist() == [[0, 2, 0, 2, 1, 3, 1, 3]]
    assert rank_imbalance(phy2log, torch.full((1, 4), 5.0), 2).tolist() == [1.0]


def test_logical_maps_width_and_unused_slots():
    phy2log = torch.tensor([[0, 1, -1, 2, 3, -1], [3, -1, 2, 1, 0, 0]])
    log2phy, count = logical_maps(phy2log, 4, max_replicas=2)
    assert count.tolist() == [[1, 1, 1, 1], [2, 1, 1, 1]]
    assert log2phy[0, :, 0].tolist() == [0, 1, 3, 4] and (log2phy[0, :, 1] == -1).all()
    assert log2phy[1, 0].tolist() == [4, 5]
    with pytest.raises(InvalidConfigError, match="max_replicas=1"):
        logical_maps(phy2log, 4, max_replicas=1)


def test_metrics():
    assert balancedness(torch.tensor([[100.0, 0, 0, 0], [100.0, 0, 0, 0]])) == 0.25  # vLLM's own case
    assert balancedness(torch.tensor([3.0, 3.0, 3.0])) == 1.0
    assert balancedness(torch.zeros(2, 4)) == 1.0
    # rank_load splits an expert's tokens evenly over its replicas
    phy2log = torch.tensor([[0, 1, 0, 2]])
    assert rank_load(phy2log, torch.tensor([[8.0, 2.0, 6.0]]), 2).tolist() == [[6.0, 10.0]]
    assert rank_imbalance(phy2log, torch.tensor([[8.0, 2.0, 6.0]]), 2).tolist() == [10.0 / 8.0]
    assert rank_imbalance(phy2log, torch.zeros(1, 3), 2).tolist() == [1.0]


@pytest.mark.parametrize("args, match", [
    ((torch.ones(2, 12), 15, 4, 2, 8), "multiple of num_gpus"),
    ((torch.ones(2, 12), 8, 4, 2, 8), ">= the 12 logical experts"),
    ((torch.ones(2, 12), 16, 8, 2, 8), "does not divide the 12"),
    ((torch.ones(2, 12), 18, 2, 2, 3), "not a multiple of num_nodes"),
    ((torch.ones(12), 16, 4, 2, 8), "num_moe_layers, num_logical_experts"),
    ((-torch.ones(2, 12), 16, 4, 2, 8), "finite and >= 0"),
    ((torch.full((2, 12), float("nan")), 16, 4, 2, 8), "finite and >= 0"),
    ((torch.ones(2, 12), 16, 0, 1, 8), ">= 1"),
])
def test_rebalance_refusals(args, match):
    with pytest.raises(InvalidConfigError, match=match):
        rebalance_experts(*args)


# --- vLLM-Ascend's expert-map JSON ----------------------------------------------------------------------------------

def test_expert_map_round_trip(tmp_path):
    weight = _loads(3, 12, seed=5)
    phy2log, _, _ = rebalance_experts(weight, 16, 4, 2, 4)
    record = placement_to_json(phy2log, 4)
    assert record["moe_layer_count"] == 3 and record["layer_list"][1]["device_count"] == 4
    device = record["layer_list"][1]["device_list"][2]
    assert device["device_id"] == 2 and device["device_expert"] == phy2log[1, 8:12].tolist()
    path = tmp_path / "expert_map.json"
    save_expert_map(path, phy2log, 4)
    assert json.loads(path.read_text()) == record
    assert torch.equal(load_expert_map(path, num_logical=12, ep_size=4, num_layers=3), phy2log)
    assert torch.equal(placement_from_json(record), phy2log)


def test_expert_map_reads_vllm_ascend_layout():
    """The layout vLLM-Ascend writes (vllm_ascend/eplb/adaptor/vllm_adaptor.py _export_tensor_to_file) and reads
    (vllm_ascend/ops/expert_load_balancer.py @ 1427299d2bd936bbaa244b1040bb365c0652478a): device_expert[j] is the
    logical expert in local slot j, devices in EP-rank order; a rank may hold two copies of one expert."""
    record = {"moe_layer_count": 1, "layer_list": [{"layer_id": 0, "device_count": 2, "device_list": [
        {"device_id": 0, "device_expert": [3, 0, 1]}, {"device_id": 1, "device_expert": [2, 3, 3]}]}]}
    assert placement_from_json(record).tolist() == [[3, 0, 1, 2, 3, 3]]


def _record():
    return {"moe_layer_count": 2, "layer_list": [
        {"layer_id": i, "device_count": 2, "device_list": [{"device_id": 0, "device_expert": [0, 1, 4]},
                                                           {"device_id": 1, "device_expert": [2, 3, 0]}]}
        for i in range(2)]}


def _set(record, path, value):
    *keys, last = path
    for k in keys:
        record = record[k]
    if value is KeyError:
        del record[last]
    else:
        record[last] = value


@pytest.mark.parametrize("path, value, kwargs, match", [
    (["moe_layer_count"], KeyError, {}, 'missing "moe_layer_count"'),
    (["moe_layer_count"], 3, {}, '"moe_layer_count" is 3 but "layer_list" has 2'),
    (["moe_layer_count"], "2", {}, '"moe_layer_count" must be an integer'),
    (["layer_list"], {}, {}, '"layer_list" must be a list'),
    (["layer_list", 1, "layer_id"], 5, {}, r'layer_list\[1\]: "layer_id" is 5'),
    (["layer_list", 1, "device_count"], 3, {}, 'layer 1: "device_count" is 3 but "device_list" has 2'),
    (["layer_list", 0, "device_list", 1, "device_id"], 0, {}, r'layer 0, device_list\[1\]: "device_id" is 0'),
    (["layer_list", 1, "device_list", 0, "device_expert"], KeyError, {}, 'layer 1, device 0: missing "device_expert"'),
    (["layer_list", 1, "device_list", 1, "device_expert"], [2, 3], {}, "layer 1, device 1: .* has 2 experts"),
    (["layer_list", 1, "device_list", 1, "device_expert"], [2, 3, 1.5], {}, r"device_expert\[2\]\" must be an int"),
    (["layer_list", 1, "device_list", 1, "device_expert"], [2, 3, 7], {"num_logical": 5},
     r"layer 1, device 1: device_expert\[2\] = 7 is outside \[0, 5\)"),
    (["layer_list", 0, "device_list", 1, "device_expert"], [2, -1, 0], {}, r"device_expert\[1\] = -1 is outside"),
    (["layer_list", 0, "device_list", 1, "device_expert"], [2, 2, 0], {}, r"layer 0: logical experts \[3\] have no"),
    ([], None, {"ep_size": 4}, 'layer 0: "device_count" is 2, but the expert-parallel size is 4'),
    ([], None, {"num_layers": 3}, '"moe_layer_count" is 2, but the model has 3 MoE layers'),
    ([], None, {"num_logical": 6}, r"layer 0: logical experts \[5\] have no replica"),
])
def test_expert_map_refusals(path, value, kwargs, match):
    record = _record()
    if path:
        _set(record, path, value)
    with pytest.raises(InvalidConfigError, match=match):
        placement_from_json(record, source="m.json", **kwargs)


def test_expert_map_file_refusals(tmp_path):
    with pytest.raises(InvalidConfigError, match="no such file"):
        load_expert_map(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidConfigError, match="bad.json: cannot be read as JSON"):
        load_expert_map(bad)
    bad.write_text("[]")
    with pytest.raises(InvalidConfigError, match="must be a JSON object"):
        load_expert_map(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_record()))
    assert load_expert_map(good, num_logical=5, ep_size=2, num_layers=2).tolist() == [[0, 1, 4, 2, 3, 0]] * 2
    with pytest.raises(InvalidConfigError, match="do not split evenly over ep_size=4"):
        save_expert_map(tmp_path / "x.json", torch.tensor([[0, 1, 2, 3, 0, 1]]), 4)
    with pytest.raises(InvalidConfigError, match=r"logical experts \[2\] have no replica"):
        save_expert_map(tmp_path / "x.json", np.array([[0, 1, 3, 3]]), 2)
