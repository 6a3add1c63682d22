"""Expert-parallel load balancing (EPLB): the balancing policy (policy.py, vLLM's default / DeepSeek's hierarchical
algorithm) and the static placement file (expert_map.py, vLLM-Ascend's expert-map JSON). Pure host code: plain
torch / numpy, no model or runtime imports, so the runtime that counts the load and moves the weights builds on it."""
from graphinfer.eplb.expert_map import (load_expert_map, placement_from_json, placement_to_json, save_expert_map,
                                        starting_placement, validate_placement)
from graphinfer.eplb.policy import (balancedness, initial_placement, logical_maps, rank_imbalance, rank_load,
                                    rebalance_experts)

__all__ = ["balancedness", "initial_placement", "load_expert_map", "logical_maps", "placement_from_json",
           "placement_to_json", "rank_imbalance", "rank_load", "rebalance_experts", "save_expert_map",
           "starting_placement", "validate_placement"]
