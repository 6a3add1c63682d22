"""graphinfer::apply_token_bitmask on cpu tensors: xgrammar's own C++ kernel (one pass over the logits; the torch
reference makes several), the implementation the cpu platform registers for its eager / inductor kernels."""
from torch import Tensor


def apply_token_bitmask_cpu(logits: Tensor, bitmask: Tensor) -> None:
    import xgrammar as xgr  # imported by the first structured request anyway (runtime/structured_output/)

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], backend="cpu")


CPU_BITMASK_OPS = {"apply_token_bitmask": apply_token_bitmask_cpu}
