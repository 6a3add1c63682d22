"""Verification of a step's drafts: the target token at every draft position, then graphinfer::rejection_sample.

Each request with k drafts has k + 1 logits rows. The sampler sees them as k + 1 rows of their own, row j with the
first j drafts counted as generated (penalties, min_tokens and a seeded request's (seed, position) key are those of
the token at that position), so every sampling parameter means what it means without speculation. The op then
keeps the drafts up to the first that differs from its target token, plus that token; nothing is read on the host.
"""
from dataclasses import dataclass

import numpy as np
import torch

from graphinfer.runtime.worker.sampler import Sampler, SamplerOutput


@dataclass
class _Position:
    """What the sampler reads of a sequence, as of draft position j (drafts[:j] generated)."""
    sampling_params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int
    generator: torch.Generator | None
    all_stop_token_ids: frozenset


def _positions(seq, k: int) -> list:
    if not k:
        return [seq]
    return [_Position(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids + seq.spec_token_ids[:j],
                      seq.num_output_tokens + j, seq.generator, seq.all_stop_token_ids) for j in range(k + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, rows: list, spec_lens: list[int], to_device) -> SamplerOutput:
    """SamplerOutput over every logits row, plus output_token_ids [B, max k + 1] (-1 padded): the tokens each
    request emits this step. to_device: the runner's non-blocking host-array copy."""
    positions = [p for seq, k in zip(rows, spec_lens) for p in _positions(seq, k)]
    out = sampler(logits, positions)
    drafts = to_device(np.fromiter((t for seq in rows for t in seq.spec_token_ids), dtype=np.int64))
    cu = to_device(np.cumsum(spec_lens, dtype=np.int32))
    out.output_token_ids = torch.ops.graphinfer.rejection_sample(drafts, out.sampled_token_ids, cu, max(spec_lens))
    return out


def warm_up_rejection_sample(device: torch.device) -> None:
    """One call of graphinfer::rejection_sample, so its kernel compiles (or loads) at start-up rather than in the
    first step that verifies drafts."""
    targets = torch.zeros(4, dtype=torch.int64, device=device)  # one request, 3 drafts
    torch.ops.graphinfer.rejection_sample(targets[:3], targets, torch.tensor([3], dtype=torch.int32, device=device), 3)
