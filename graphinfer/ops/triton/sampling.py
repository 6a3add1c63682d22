"""Fused sampling kernel: one token per row from [B, V] logits in one pass (greedy or the Gumbel-max race).

Per row r with temperature T[r]: T = 0 is greedy, argmax_i logits_i (ties to the lowest index, as
torch.argmax); T > 0 draws argmax_i logits_i / T + g_i with g_i = -log(-log u_i), which picks token i with
probability softmax(logits / T)_i (the Gumbel-max trick; the exponential race argmax(p_i / E_i) of the torch
sampler is the same thing with E_i = -log u_i). Computed in base 2, logits_i * (log2(e) / T) - log2(-log2 u_i):
that is the same score times log2(e) plus a constant, so the same argmax, with one multiply by a per-row
constant instead of a division and two log2 instead of two natural logs. At B = 256 and a 152K vocab the
per-element arithmetic, not reading the logits, bounds the kernel (on an H200, before this change: 155.6 us with
temperature, 33 us greedy); the change's effect there is not measured yet (`tools/h100_bench.sh kernel_timings`).
The logits are read once, in their own dtype, and nothing but one int64 per row is written (plus a [B, S] partial
when the vocab is split, below).

RNG, as vLLM / FlashInfer's seed + offset: u_i depends only on (seeds[r], offsets[r], i), both int64 device
tensors the kernel loads (no host sync, safe to capture in a device graph). Element i takes output i % 4 of
Philox(key = seed, counter = (i // 4, offset low 32 bits, offset high 32 bits, 0)): one Philox call feeds four
elements (its rounds dominate the arithmetic), and the draw does not depend on block sizes or the vocab split.
Philox is called on 32-bit counters directly rather than through tl.rand with an int64 offset because
Triton-Ascend 3.2 runs 64-bit offsets through its 64-bit Philox variant: this way CUDA and Ascend draw the same.

Grid: programs = B * S, 1-D. Program (r, s) scans the vocab chunk s of row r in [BLOCK_Q, 4] tiles, keeping a
running best per lane (strictly greater wins, so each lane keeps its lowest index among equals). With S = 1 it
writes the token; with S > 1 it writes its (best score, index) and a second launch reduces the S partials per
row (max score, then lowest index). S is chosen so that small batches still spread over the device (batch 1
at 152K vocab: 75 programs instead of one program streaming 300 KB through Philox on a single SM); at batch
>= _TARGET_PROGRAMS there is one program per row and a single launch.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphinfer.ops.triton.launch import Launcher, cdiv, next_power_of_2

_BLOCK_Q = 512  # Philox calls per tile: tiles of 4 * 512 = 2,048 logits
_TARGET_PROGRAMS = 512  # split the vocab while fewer rows than this (~4 programs per H100 SM)
_MAX_SPLITS = 256  # the reduce kernel holds a row's partials in one tile


@triton.jit
def _tile_scores(logits_row, start, n_cols, seed, off_lo, off_hi, temperature, scale, r, c,
                 BLOCK_Q: tl.constexpr):
    """(scores, element indices) of the [BLOCK_Q, 4] tile at `start` (a multiple of 4); -inf past the vocab.
    scale: log2(e) / temperature (unused when greedy)."""
    idx = start + r[:, None] * 4 + c[None, :]
    x = tl.load(logits_row + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32)
    if temperature > 0.0:
        q = start // 4 + r  # Philox counter: one call per 4 consecutive elements
        zero = q * 0
        r0, r1, r2, r3 = tl.philox(seed, q, zero + off_lo, zero + off_hi, zero)
        bits = tl.where(c[None, :] == 0, r0[:, None], tl.where(c[None, :] == 1, r1[:, None],
                        tl.where(c[None, :] == 2, r2[:, None], r3[:, None])))
        u = tl.uint_to_uniform_float(bits)
        u = tl.minimum(tl.maximum(u, 1.0e-10), 0.99999988)  # u = 0 or 1 would give an infinite g
        x = x * scale - tl.log2(-tl.log2(u))
    return x, idx


@triton.jit(do_not_specialize=["n_rows", "n_splits", "tiles_per_split"])
def _sample_kernel(logits_ptr, temp_ptr, seed_ptr, offset_ptr, out_val_ptr, out_idx_ptr, n_rows, n_cols,
                   stride_row, n_splits, tiles_per_split, BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits
    temperature = tl.load(temp_ptr + row)
    scale = 1.4426950408889634 / tl.maximum(temperature, 1.0e-30)  # log2(e) / T, once per program
    seed = tl.load(seed_ptr + row)
    offset = tl.load(offset_ptr + row)
    off_lo = offset.to(tl.int32)  # truncates: the low 32 bits
    off_hi = (offset >> 32).to(tl.int32)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    r = tl.arange(0, BLOCK_Q)
    c = tl.arange(0, 4)
    lo = split * tiles_per_split * (4 * BLOCK_Q)

    # The first tile seeds the running best: a row of -inf logits then still returns its first index.
    best, best_idx = _tile_scores(logits_row, lo, n_cols, seed, off_lo, off_hi, temperature, scale, r, c, BLOCK_Q)
    for t in range(1, tiles_per_split):
        s, idx = _tile_scores(logits_row, lo + t * (4 * BLOCK_Q), n_cols, seed, off_lo, off_hi, temperature,
                              scale, r, c, BLOCK_Q)
        take = s > best
        best = tl.where(take, s, best)
        best_idx = tl.where(take, idx, best_idx)

    top = tl.max(tl.max(best, axis=1), axis=0)
    token = tl.min(tl.min(tl.where(best == top, best_idx, n_cols), axis=1), axis=0)
    if SPLIT:
        tl.store(out_val_ptr + pid, top)
    tl.store(out_idx_ptr + pid, token.to(tl.int64))


@triton.jit(do_not_specialize=["n_rows", "n_splits"])
def _sample_reduce_kernel(val_ptr, idx_ptr, out_ptr, n_rows, n_splits, BLOCK_R: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    """out[r] = the index of the best of row r's n_splits partials (max score; lowest index among equals)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.arange(0, BLOCK_S)
    mask = (rows < n_rows)[:, None] & (s < n_splits)[None, :]
    at = rows[:, None] * n_splits + s[None, :]
    val = tl.load(val_ptr + at, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + at, mask=mask, other=0)
    top = tl.max(val, axis=1)
    big = tl.full(idx.shape, 1 << 62, tl.int64)
    # Masked splits (past n_splits) are excluded by index; a row whose partials are all -inf keeps split 0's.
    token = tl.min(tl.where((val == top[:, None]) & mask, idx, big), axis=1)
    tl.store(out_ptr + rows, token, mask=rows < n_rows)


_SAMPLE = Launcher(_sample_kernel)
_SAMPLE_REDUCE = Launcher(_sample_reduce_kernel)


@functools.lru_cache(maxsize=4096)
def _launch_params(n_rows: int, n_cols: int, block_q: int, target_programs: int) -> tuple[int, int]:
    """(splits, tiles per split), once per shape: split the vocab only while the rows alone would leave the
    device mostly idle; every split gets at least one tile and the last split is not empty."""
    tiles = cdiv(n_cols, 4 * block_q)
    splits = min(tiles, _MAX_SPLITS, max(1, cdiv(target_programs, n_rows)))
    per_split = cdiv(tiles, splits)
    return cdiv(tiles, per_split), per_split


def sample(logits: Tensor, temperature: Tensor, seeds: Tensor, offsets: Tensor,
           block_q: int = _BLOCK_Q, num_warps: int = 4, target_programs: int = _TARGET_PROGRAMS) -> Tensor:
    """One token per row of logits [B, V] (bf16, fp16 or fp32): greedy where temperature[r] == 0, else a draw
    from softmax(logits[r] / temperature[r]) keyed by (seeds[r], offsets[r]). temperature: [B] float32;
    seeds, offsets: [B] int64, all on the logits' device. Returns [B] int64. block_q, num_warps and
    target_programs (the vocab is split while n_rows < target_programs) are tuning knobs; the tokens drawn do
    not depend on them."""
    n_rows, n_cols = logits.shape
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_q = min(block_q, max(1, next_power_of_2(cdiv(n_cols, 4))))
    splits, per_split = _launch_params(n_rows, n_cols, block_q, target_programs)
    if splits == 1:
        _SAMPLE.launch((n_rows,), logits, temperature, seeds, offsets, out, out, n_rows, n_cols, logits.stride(0),
                       1, per_split, BLOCK_Q=block_q, SPLIT=False, num_warps=num_warps)
        return out
    part_val = torch.empty(n_rows * splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(n_rows * splits, dtype=torch.int64, device=logits.device)
    _SAMPLE.launch((n_rows * splits,), logits, temperature, seeds, offsets, part_val, part_idx, n_rows, n_cols,
                   logits.stride(0), splits, per_split, BLOCK_Q=block_q, SPLIT=True, num_warps=num_warps)
    block_s = next_power_of_2(splits)
    block_r = max(1, min(next_power_of_2(n_rows), 1024 // block_s))
    _SAMPLE_REDUCE.launch((cdiv(n_rows, block_r),), part_val, part_idx, out, n_rows, splits,
                          BLOCK_R=block_r, BLOCK_S=block_s, num_warps=1)
    return out
