"""Speculative decoding: proposers (n-gram lookup, a draft model) and the engine-side bookkeeping.

The target verifies a request's k drafts in one forward of 1 + k tokens: the normal sampler draws a target token at
each of the k + 1 positions (drafts before a position count as generated there), and graphinfer::rejection_sample
keeps the drafts up to the first one that differs from its target token, plus that token (or the bonus token after
k accepted drafts). Drafts are deterministic (lookup, a draft model's argmax), for which this is the exact
accept / resample-from-residual rule: the output follows the target distribution (graphinfer/ops/rejection.py).
"""
import logging

from graphinfer.config import SpeculativeConfig
from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats
from graphinfer.runtime.spec_decode.ngram_proposer import NgramProposer, draft_budget

__all__ = ["NgramProposer", "draft_budget", "make_proposer"]

logger = logging.getLogger(__name__)


def make_proposer(spec: SpeculativeConfig | None, target):
    """(proposer, its SpecDecodingStats) for the target EngineCore's speculative_config, or (None, None) without
    one."""
    if spec is None:
        return None, None
    if target.config.scheduler_config.async_scheduling:
        logger.info("speculative decoding: steps run synchronously (the drafts need the last step's tokens)")
    if spec.method == "ngram":
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:  # it builds a Worker of its own
        from graphinfer.runtime.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(spec, target)
    return proposer, SpecDecodingStats(spec.num_speculative_tokens)
