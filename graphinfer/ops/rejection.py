"""graphinfer::rejection_sample: which of a step's draft tokens a request keeps (speculative decoding).

Request i proposed k_i drafts d_1..d_k (draft_token_ids[cu[i-1]:cu[i]], vLLM's cu_num_draft_tokens layout) and
the sampler drew a target token t_j at each of its k_i + 1 positions (target_token_ids[cu[i-1] + i : cu[i] + i + 1]),
position j's distribution p_j conditioned on d_1..d_{j-1}. The request emits t_1..t_{a+1}, a = the number of leading
drafts equal to their target token. For a deterministic proposal (q = one-hot at d, as the n-gram and argmax
draft proposers make) this IS the standard rule: accept d with probability min(1, p(d) / q(d)) = p(d) = P(t = d),
and on rejection resample from normalize(max(p - q, 0)) = p restricted to tokens != d, which is t's distribution
given t != d. So the emitted tokens follow the target distribution exactly; greedy (t = argmax) is the special case.
"""
import torch
from torch import Tensor

from graphinfer.ops.library import graphinfer_op, register_fake


@graphinfer_op()
def rejection_sample(draft_token_ids: Tensor, target_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                     max_spec_len: int) -> Tensor:
    """-> [B, max_spec_len + 1] int64: row i holds t_1..t_{a+1} of request i, then -1. Reference: vectorised over
    the requests, nothing read on the host."""
    B, width = cu_num_draft_tokens.shape[0], max_spec_len + 1
    dev = target_token_ids.device
    cu = cu_num_draft_tokens.long()
    k = torch.diff(cu, prepend=cu.new_zeros(1))  # drafts per request
    j = torch.arange(width, device=dev)[None, :]
    t_idx = (cu - k + torch.arange(B, device=dev))[:, None] + j  # request i's targets start at cu[i-1] + i
    targets = torch.where(j <= k[:, None], target_token_ids[t_idx.clamp(max=target_token_ids.numel() - 1)], -1)
    is_draft = j < k[:, None]
    drafts = torch.full_like(targets, -2)
    if draft_token_ids.numel():
        d_idx = ((cu - k)[:, None] + j).clamp(max=draft_token_ids.numel() - 1)
        drafts = torch.where(is_draft, draft_token_ids[d_idx], -2)
    accepted = ((drafts == targets) & is_draft).long().cumprod(dim=1).sum(dim=1)  # leading matches
    return torch.where(j <= accepted[:, None], targets, -1)


@register_fake(rejection_sample)
def _(draft_token_ids, target_token_ids, cu_num_draft_tokens, max_spec_len):
    return target_token_ids.new_empty(cu_num_draft_tokens.shape[0], max_spec_len + 1)
