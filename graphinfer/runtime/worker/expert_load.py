"""Expert load statistics (EPLB's input, as vLLM-Ascend's dynamic EPLB reads it): per MoE layer, the tokens
routed to each expert.

The counts live on the device, one int64 buffer per layer (MoEExperts.expert_counts), and are added to inside
the graph by graphinfer::moe_count_experts, which counts only the first num_tokens rows: num_tokens is one
static device tensor the model runner fills before each step (the real token count), so the padded rows of a
captured bucket never count. Reading them (read_expert_load) is a host sync: never on the step path.

A token is counted once per expert slot (top_k per token), so a layer's counts sum to tokens x top_k. Under
tensor parallelism every rank routes the same (replicated) tokens, so rank 0's counts are the totals.
"""
import re

import torch
from torch import nn

from graphinfer.errors import InvalidConfigError
from graphinfer.models.parallel_layers import MoEExperts

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_layers(model: nn.Module) -> dict[int, MoEExperts]:
    """Decoder layer index -> its MoEExperts, in layer order (empty for a dense model)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts):
            match = _LAYER.search(name)
            found[int(match.group(1)) if match else len(found)] = module
    return dict(sorted(found.items()))


def read_expert_load(layers: dict[int, MoEExperts]) -> dict[int, list[int]]:
    """Layer index -> tokens per expert (one host read for all layers)."""
    if not layers:
        return {}
    counts = torch.stack([m.expert_counts for m in layers.values()]).tolist()
    return dict(zip(layers, counts))


def reset_expert_load(layers: dict[int, MoEExperts]) -> None:
    for m in layers.values():
        m.expert_counts.zero_()


def tokens_per_rank(counts: list[int], ep_size: int) -> list[int]:
    """Tokens per expert-parallel rank under vLLM's default contiguous placement: rank r owns experts
    [r * E / ep_size, (r + 1) * E / ep_size)."""
    E = len(counts)
    if ep_size < 1 or E % ep_size:
        fits = [d for d in range(1, E + 1) if E % d == 0]
        raise InvalidConfigError(f"ep_size={ep_size} does not split the {E} experts evenly; use one of {fits}.")
    per = E // ep_size
    return [sum(counts[r * per:(r + 1) * per]) for r in range(ep_size)]


def imbalance(values: list[int]) -> float:
    """max / mean (1.0 = perfectly balanced; also 1.0 when nothing was counted)."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


def summarize(load: dict[int, list[int]], ep_size: int = 1) -> dict:
    """Per layer: tokens per expert and per EP rank, and the imbalance (max / mean) of each; overall: the mean
    and the worst layer's imbalance. JSON-ready (layer keys are strings)."""
    layers = {}
    for layer, counts in load.items():
        ranks = tokens_per_rank(counts, ep_size)
        layers[str(layer)] = {"tokens_per_expert": counts, "tokens_per_rank": ranks, "tokens": sum(counts),
                              "expert_imbalance": imbalance(counts), "rank_imbalance": imbalance(ranks)}
    rank = [v["rank_imbalance"] for v in layers.values()]
    expert = [v["expert_imbalance"] for v in layers.values()]
    return {"ep_size": ep_size, "num_moe_layers": len(layers), "layers": layers,
            "mean_rank_imbalance": sum(rank) / len(rank) if rank else 1.0, "max_rank_imbalance": max(rank, default=1.0),
            "mean_expert_imbalance": sum(expert) / len(expert) if expert else 1.0,
            "max_expert_imbalance": max(expert, default=1.0)}
