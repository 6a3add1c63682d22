"""graphinfer::rejection_sample as a Triton kernel (the rule: graphinfer/ops/rejection.py).

One program per request, 1-D grid; it loads its k drafts and k + 1 target tokens as one BLOCK-wide masked tile,
counts the leading matches with a cumulative min (no loop that depends on data) and writes its output row. Nothing
is read on the host: capture-safe. Every access is masked (Triton-Ascend)."""
import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, next_power_of_2


@triton.jit
def _rejection_kernel(draft_ptr, target_ptr, cu_ptr, out_ptr, width, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    end = tl.load(cu_ptr + i).to(tl.int64)
    start = tl.load(cu_ptr + i - 1, mask=i > 0, other=0).to(tl.int64)
    k = end - start
    j = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + start + i + j, mask=j <= k, other=-1)
    draft = tl.load(draft_ptr + start + j, mask=j < k, other=-2)
    # accepted = the first position whose draft differs from its target (k if none does)
    miss = (draft != target) | (j >= k)
    accepted = tl.min(tl.where(miss, j, BLOCK), axis=0)
    tl.store(out_ptr + i * width + j, tl.where(j <= accepted, target, -1), mask=j < width)


_REJECTION = Launcher(_rejection_kernel)


def rejection_sample(draft_token_ids: Tensor, target_token_ids: Tensor, cu_num_draft_tokens: Tensor,
                     max_spec_len: int) -> Tensor:
    B, width = cu_num_draft_tokens.shape[0], max_spec_len + 1
    out = torch.empty(B, width, dtype=torch.int64, device=target_token_ids.device)
    if B:
        drafts = draft_token_ids if draft_token_ids.numel() else target_token_ids  # never read then (k = 0)
        _REJECTION.launch((B,), drafts, target_token_ids, cu_num_draft_tokens, out, width,
                          BLOCK=max(16, next_power_of_2(width)))
    return out
