"""vLLM's default EPLB policy (DeepSeek's EPLB, vllm/distributed/eplb/policy/default.py, formerly rebalance_algo.py):
from the measured load of each logical expert, choose how many physical replicas each one gets and which EP rank
holds each replica, so that the busiest rank does as little as possible.

Hierarchical form (num_groups divisible by num_nodes; DeepSeek-V3's group-limited routing keeps a token's experts
in a few groups, so keeping a group on one node keeps its traffic on the fast intra-node links):
  1. pack the expert groups onto nodes, an equal number per node, balancing the nodes' total load;
  2. within each node, replicate its experts: each redundant slot goes to the expert with the highest load per
     replica (a replica takes an equal share of its expert's tokens);
  3. pack the node's replicas onto its GPUs, an equal number per GPU, balancing the GPUs' load.
Global form (otherwise): the same with one group and one node, i.e. replicate over all experts, pack over all GPUs.

Physical slot p lives on rank p // (num_replicas // num_gpus). Ties are broken by index everywhere (a stable sort,
the first of equal minima / maxima), so equal loads give one defined placement on every machine; vLLM's
np.argsort(-w) is an unstable sort, so for tied loads its order is the sort implementation's.
Plain numpy / torch on the host: the policy runs between steps, never inside a graph.
"""
import numpy as np
import torch

from graphinfer.errors import InvalidConfigError


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of each row into num_packs packs of exactly n / num_packs items, greedily: heaviest item
    first, into the lightest pack that still has room. weight [X, n] -> (pack_index [X, n], rank_in_pack [X, n])."""
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:  # one item per pack: nothing to balance, keep the order
        return np.tile(np.arange(n, dtype=np.int64), (rows, 1)), np.zeros((rows, n), dtype=np.int64)
    order = np.argsort(-weight, axis=-1, kind="stable")  # heaviest first, equal loads by index
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    for r in range(rows):
        loads = np.zeros(num_packs)
        items = np.zeros(num_packs, dtype=np.int64)
        for i in order[r]:
            pack = int(np.argmin(loads))  # the lightest open pack; the lowest index among equals
            pack_index[r, i], rank_in_pack[r, i] = pack, items[pack]
            loads[pack] += weight[r, i]
            items[pack] += 1
            if items[pack] == per_pack:
                loads[pack] = np.inf  # full
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """Give each of the num_log experts of a row one replica, then each of the num_phy - num_log redundant ones to
    the expert whose load per replica is highest then (the lowest index among equals), which minimises the largest
    replica load. weight [X, num_log] -> (phy2log [X, num_phy] with phy2log[:, :num_log] = identity,
    logcnt [X, num_log])."""
    rows, num_log = weight.shape
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (rows, 1))
    logcnt = np.ones((rows, num_log), dtype=np.int64)
    every = np.arange(rows)
    for p in range(num_log, num_phy):
        hottest = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, p] = hottest
        logcnt[every, hottest] += 1
    return phy2log, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.arange(perm.shape[1], dtype=perm.dtype)[None].repeat(perm.shape[0], 0), axis=1)
    return inv


def _hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int) -> np.ndarray:
    """weight [L, E] float64 -> phy2log [L, num_phy] (the three steps of the module docstring)."""
    L, E = weight.shape
    group_size, groups_per_node = E // num_groups, num_groups // num_nodes
    per_gpu = num_phy // num_gpus

    # 1. groups -> nodes. log2mlog: logical expert -> its place in the node-major order ("mlog"), where node k holds
    # mlog [k * E / num_nodes, (k + 1) * E / num_nodes), its groups in packing order, each group's experts in order.
    group_node, group_rank = balanced_packing(weight.reshape(L, num_groups, group_size).sum(-1), num_nodes)
    log2mlog = (((group_node * groups_per_node + group_rank) * group_size)[..., None]
                + np.arange(group_size)).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # 2. replicate within each node: one row per (layer, node), over that node's experts and physical slots.
    mlog_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, E // num_nodes)
    phy2mlog, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)

    # 3. each node's replicas -> its GPUs, by the load of one replica (its expert's load / its replica count).
    phy_load = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, axis=1)
    gpu, slot = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * per_gpu + slot)  # final slot (node-local) -> replica
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)  # node-local mlog index
    pphy2mlog = (pphy2mlog.reshape(L, num_nodes, -1)
                 + np.arange(0, E, E // num_nodes)[None, :, None]).reshape(L, num_phy)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def logical_maps(physical_to_logical_map: torch.Tensor, num_logical: int,
                 max_replicas: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of a placement: (logical_to_physical_map [L, num_logical, max_replicas], each expert's physical
    slots in ascending order, -1 padded; logical_replica_count [L, num_logical]). max_replicas defaults to
    num_physical - num_logical + 1, the most any placement can give one expert, so the map's shape stays the same
    across rebalances (a captured graph reads it in place). Entries of -1 in the placement are unused slots."""
    phy2log = torch.as_tensor(physical_to_logical_map).to("cpu", torch.int64).numpy()
    L, num_phy = phy2log.shape
    width = num_phy - num_logical + 1 if max_replicas is None else max_replicas
    count = np.zeros((L, num_logical), dtype=np.int64)
    log2phy = np.full((L, num_logical, max(width, 1)), -1, dtype=np.int64)
    for p in range(num_phy):  # ascending slots: each expert's replicas in slot order
        layers = np.nonzero(phy2log[:, p] >= 0)[0]
        experts = phy2log[layers, p]
        full = count[layers, experts] >= width
        if full.any():
            raise InvalidConfigError(f"layer {layers[full][0]}: logical expert {experts[full][0]} has more than "
                                     f"max_replicas={width} physical replicas; raise max_replicas.")
        log2phy[layers, experts, count[layers, experts]] = p
        count[layers, experts] += 1
    return torch.from_numpy(log2phy), torch.from_numpy(count)


def _check(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if weight.dim() != 2 or weight.numel() == 0:
        raise InvalidConfigError(f"EPLB weight must be [num_moe_layers, num_logical_experts], got "
                                 f"{tuple(weight.shape)}.")
    E = weight.shape[1]
    if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise InvalidConfigError("EPLB weight (tokens per expert) must be finite and >= 0.")
    if min(num_groups, num_nodes, num_gpus) < 1:
        raise InvalidConfigError(f"EPLB needs num_groups, num_nodes, num_gpus >= 1, got {num_groups}, "
                                 f"{num_nodes}, {num_gpus}.")
    if num_replicas < E or num_replicas % num_gpus:
        raise InvalidConfigError(f"EPLB num_replicas={num_replicas} must be >= the {E} logical experts and a "
                                 f"multiple of num_gpus={num_gpus} (num_redundant_experts = num_replicas - {E}).")
    if num_groups % num_nodes == 0:  # the hierarchical form's own constraints
        if E % num_groups:
            raise InvalidConfigError(f"EPLB num_groups={num_groups} does not divide the {E} logical experts.")
        if num_gpus % num_nodes:
            raise InvalidConfigError(f"EPLB num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}.")


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's rebalance_experts. weight [layers, num_logical] (tokens per logical expert over the window);
    num_replicas = physical experts (logical + redundant), a multiple of num_gpus (the EP size).
    Returns int64 CPU tensors: physical_to_logical_map [layers, num_replicas]; logical_to_physical_map
    [layers, num_logical, num_replicas - num_logical + 1] (ascending physical slots, -1 padded);
    logical_replica_count [layers, num_logical]. Raises InvalidConfigError for sizes that do not fit."""
    weight = torch.as_tensor(weight).detach().to("cpu", torch.float64)
    _check(weight, num_replicas, num_groups, num_nodes, num_gpus)
    w = weight.numpy()
    if num_groups % num_nodes == 0:
        phy2log = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:  # groups cannot be split evenly over nodes: balance globally
        phy2log = _hierarchical(w, num_replicas, 1, 1, num_gpus)
    phy2log = torch.from_numpy(phy2log)
    log2phy, count = logical_maps(phy2log, weight.shape[1])
    return phy2log, log2phy, count


def initial_placement(num_layers: int, num_logical: int, num_redundant: int = 0) -> torch.Tensor:
    """vLLM's starting placement (EplbState.build_initial_global_physical_to_logical_map): the logical experts in
    order, then redundant slot i holds expert i % num_logical. [num_layers, num_logical + num_redundant]."""
    row = list(range(num_logical)) + [i % num_logical for i in range(num_redundant)]
    return torch.tensor([row] * num_layers, dtype=torch.int64)


def rank_load(physical_to_logical_map: torch.Tensor, weight: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Load per EP rank [layers, num_ranks] of a placement under a logical load [layers, num_logical]: each
    expert's tokens split evenly over its replicas (as routing spreads them), summed over each rank's slots."""
    phy2log = torch.as_tensor(physical_to_logical_map).to("cpu", torch.int64)
    weight = torch.as_tensor(weight).to("cpu", torch.float64)
    L, num_phy = phy2log.shape
    if num_phy % num_ranks:
        raise InvalidConfigError(f"{num_phy} physical experts do not split evenly over {num_ranks} ranks.")
    count = torch.zeros(L, weight.shape[1], dtype=torch.float64).scatter_add_(
        1, phy2log, torch.ones(L, num_phy, dtype=torch.float64))
    per_replica = (weight / count.clamp(min=1)).gather(1, phy2log)
    return per_replica.view(L, num_ranks, num_phy // num_ranks).sum(-1)


def balancedness(load_per_rank: torch.Tensor) -> float:
    """vLLM's logged EPLB balancedness: sum over layers of the mean rank load / sum over layers of the max rank
    load (load_per_rank [layers, ranks] or [ranks]); 1.0 is perfect, 1 / ranks is everything on one rank. 1.0 when
    nothing was counted (vLLM logs 0.0 there; no load is not an imbalance)."""
    load = torch.as_tensor(load_per_rank).to("cpu", torch.float64)
    load = load.reshape(-1, load.shape[-1])
    top = float(load.max(-1).values.sum())
    return float(load.mean(-1).sum()) / top if top > 0 else 1.0


def rank_imbalance(physical_to_logical_map: torch.Tensor, weight: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Per layer, max / mean of the EP-rank load (rank_load) of a placement under a logical load: 1.0 is perfect,
    num_ranks is everything on one rank (1.0 for a layer with no load). [layers] float64."""
    load = rank_load(physical_to_logical_map, weight, num_ranks)
    mean = load.mean(-1)
    return torch.where(mean > 0, load.max(-1).values / mean.clamp(min=1e-300), torch.ones_like(mean))
