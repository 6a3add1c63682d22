"""The proposer a speculative_config asks for (vLLM's method names: "ngram", "mtp", or a draft model)."""
import logging

from graphinfer.config import SpeculativeConfig
from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats
from graphinfer.runtime.spec_decode.ngram_proposer import NgramProposer

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
    elif spec.method == "mtp":  # the model runner's drafter (it drafts after each step, from the hidden states)
        proposer = target.worker.model_runner.drafter
    else:  # it builds a Worker of its own
        from graphinfer.runtime.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(spec, target)
    return proposer, SpecDecodingStats(spec.num_speculative_tokens)
