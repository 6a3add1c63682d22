"""graphinfer::apply_token_bitmask as a Triton kernel (the rule: graphinfer/ops/bitmask.py).

1-D grid of B * cdiv(V, BLOCK) programs; program (row, block) loads, for each of its BLOCK tokens, the bitmask word
that holds its bit (32 neighbouring tokens share a word: cached loads) and stores -inf where the bit is clear. One
masked load and one masked store per element, no loop, no reshape: the Triton-Ascend subset. Nothing is read on the
host, and the only per-step quantity, the row count, sizes the grid alone (no recompiles)."""
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv

_BLOCK = 2048


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, vocab_size, stride_logits, stride_bitmask, n_blocks,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // n_blocks).to(tl.int64)
    cols = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    words = tl.load(bitmask_ptr + row * stride_bitmask + cols // 32, mask=in_vocab, other=-1)
    blocked = ((words >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=in_vocab & blocked)


_BITMASK = Launcher(_bitmask_kernel)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    rows, vocab_size = logits.shape
    if not rows:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1, "apply_token_bitmask: rows must be contiguous"
    n_blocks = cdiv(vocab_size, _BLOCK)
    _BITMASK.launch((rows * n_blocks,), logits, bitmask, vocab_size, logits.stride(0), bitmask.stride(0), n_blocks,
                    BLOCK=_BLOCK, num_warps=4)
