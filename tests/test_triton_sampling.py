"""The fused sampling Triton kernel (graphinfer/ops/triton/sampling.py) and the Sampler's use of it.

Without a CUDA GPU it runs under TRITON_INTERPRET=1 (upstream Triton, or Triton-Ascend's interpreter in the
.venv-ascend venv, see the Makefile's test-triton-ascend); with one, compiled on "cuda" tensors. The
interpreter runs one program per row at ~20 ms each, so the statistical tests use a few hundred draws and the
exact draw is checked against a numpy Philox instead.
"""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

from graphinfer.ops.triton.sampling import _launch_params, sample  # noqa: E402
from graphinfer.runtime.worker.sampler import Sampler  # noqa: E402
from graphinfer.sampling_params import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sample(logits, temps, seeds=None, offsets=None, **kw):
    n = logits.shape[0]
    seeds = torch.zeros(n, dtype=torch.int64) if seeds is None else torch.as_tensor(seeds, dtype=torch.int64)
    offsets = torch.arange(n) if offsets is None else torch.as_tensor(offsets, dtype=torch.int64)
    temps = torch.as_tensor(temps, dtype=torch.float32).expand(n).contiguous()
    return sample(logits.to(DEVICE), temps.to(DEVICE), seeds.to(DEVICE), offsets.to(DEVICE), **kw).cpu()


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# Small tiles and few target programs: several splits of several tiles each, the last tile ragged.
SPLIT_LOOP = dict(block_q=16, target_programs=18)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, SPLIT_LOOP], ids=["one-tile", "split-loop"])
def test_greedy_equals_argmax_with_ties(dtype, kw):
    V = 1003  # not a multiple of any tile
    logits = _randn(6, V, seed=1, scale=3.0).to(dtype)
    top = logits.float().max() + 1
    logits[0, 700] = logits[0, 3] = top  # tie across splits: the lower index wins
    logits[1, 64] = logits[1, 63] = top  # across a tile boundary
    logits[2, 1002] = logits[2, 1001] = top  # in the ragged last tile
    logits[3, 9] = logits[3, 5] = logits[3, 6] = top  # several lanes of one Philox quad
    logits[4] = float("-inf")  # nothing finite: index 0, as torch.argmax
    if kw:
        assert _launch_params(6, V, 16, 18) == (3, 6)  # 3 splits of 6 tiles of 64
    got = _sample(logits, 0.0, **kw)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[:5].tolist() == [3, 63, 1001, 5, 0]


# ----- an exact reference of the draw: Philox4x32-10 in numpy, as tl.philox computes it -----
def _philox(seed: int, c0, c1: int, c2: int):
    m = np.uint64(0xFFFFFFFF)
    c0 = c0.astype(np.uint64)
    c1, c2, c3 = (np.full_like(c0, v) for v in (c1, c2, 0))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        a, b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (b >> np.uint64(32)) ^ c1 ^ k0, b & m, (a >> np.uint64(32)) ^ c3 ^ k1, a & m
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m, (k1 + np.uint64(0xBB67AE85)) & m
    return c0, c1, c2, c3


def _reference_draw(logits_row: np.ndarray, temperature: float, seed: int, offset: int) -> int:
    """argmax_i logits_i * (log2(e) / T) - log2(-log2 u_i) (= argmax logits_i / T - log(-log u_i), in base 2), u_i =
    output i % 4 of Philox(seed, (i // 4, offset lo, offset hi, 0))."""
    V = logits_row.shape[0]
    i = np.arange(V)
    outs = _philox(seed % 2**64, i // 4, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF)
    bits = np.choose(i % 4, outs).astype(np.uint32).view(np.int32).astype(np.int64)
    bits = np.where(bits < 0, -bits - 1, bits)
    u = np.clip(bits.astype(np.float32) * np.float32(4.6566127342e-10), np.float32(1e-10), np.float32(0.99999988))
    g = -np.log2(-np.log2(u))
    scale = np.float32(1.4426950408889634) / np.float32(temperature)
    return int(np.argmax(logits_row.astype(np.float32) * scale + g))


def test_draw_matches_numpy_philox_reference():
    """The exact draw: the Gumbel formula, the counter layout (i // 4, lane i % 4), the offset's high bits, and
    negative (>= 2**63 as uint64) seeds."""
    V = 301
    logits = _randn(6, V, seed=2, scale=0.3)  # near-flat: the noise decides
    seeds = [0, 1, 12345, -1, -(2**63), 2**62 + 7]
    offsets = [0, 1, 7, 2**32 + 5, 5, 2**40]
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.9])
    got = _sample(logits, temps, seeds, offsets).tolist()
    want = [_reference_draw(logits[r].numpy(), float(temps[r]), seeds[r], offsets[r]) for r in range(6)]
    assert got == want


def _chi2(tokens, probs):
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_samples_follow_softmax_of_logits_over_temperature():
    """logits = T log p, so softmax(logits / T) = p for either temperature. A kernel that ignored the
    temperature (chi2 ~ 50-110 here), multiplied by it (~100-460) or added log(u) as the noise (~40) fails;
    7 degrees of freedom: P(chi2 > 30) ~ 1e-4 (the draws are fixed by the seeds). Exponential noise (-log u,
    the outer log missing) is too close to Gumbel for 160 draws: the numpy reference test catches it."""
    p = torch.tensor([0.6, 0.2, 0.1, 0.05, 0.03, 0.01, 0.007, 0.003])
    n = 160
    for i, T in enumerate((0.5, 2.0)):
        tokens = _sample(T * p.log().expand(n, -1).contiguous(), T, torch.full((n,), 1000 + i), torch.arange(n))
        assert _chi2(tokens, p) < 30, (T, torch.bincount(tokens, minlength=8))


def test_seeded_row_same_whatever_its_batch():
    V = 500
    mine = _randn(V, seed=3, scale=0.5)
    alone = _sample(mine[None], 0.8, [42], [17])
    mates = _randn(4, V, seed=4)
    batch = torch.cat([mates[:2], mine[None], mates[2:]])
    together = _sample(batch, torch.tensor([0.0, 1.5, 0.8, 0.8, 1.0]), [7, 42, 42, 9, 42], [3, 17, 17, 17, 0])
    assert int(together[2]) == int(alone[0])
    # The split of the vocab over programs does not change the draw either.
    assert int(_sample(mine[None], 0.8, [42], [17], **SPLIT_LOOP)[0]) == int(alone[0])


def test_offsets_and_seeds_give_different_draws():
    V = 1000
    flat = torch.zeros(16, V)  # uniform: every draw is the noise's argmax
    by_offset = _sample(flat, 1.0, [5] * 16, range(16))
    assert len(set(by_offset.tolist())) >= 12  # 16 draws from 1000 tokens: repeats are rare
    by_seed = _sample(flat, 1.0, range(16), [0] * 16)
    assert len(set(by_seed.tolist())) >= 12
    high = _sample(flat[:8], 1.0, [5] * 8, [2**32 + k for k in range(8)])  # only the offset's high bits differ
    assert high.tolist() != by_offset[:8].tolist()


def test_mixed_greedy_and_random_rows_and_ragged_tail():
    V = 1003
    logits = _randn(6, V, seed=5, scale=0.2)
    tail = torch.full((V,), float("-inf"))
    tail[-3:] = 0.0  # only the last three tokens, in the ragged last tile, can be drawn
    logits[1] = logits[3] = tail
    temps = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.0, 1.0])
    got = _sample(logits, temps, **SPLIT_LOOP)
    assert torch.equal(got[::2], logits[::2].argmax(-1))
    assert {int(got[1]), int(got[3])} <= {1000, 1001, 1002}
    assert 0 <= int(got[5]) < V


# ----- the Sampler's fast path -----
class _Row:
    """What the sampler reads of a scheduled sequence (its placeholder for the token sampled counts in
    num_output_tokens)."""
    def __init__(self, output=(), **kw):
        self.sampling_params = SamplingParams(**kw)
        self.prompt_token_ids, self.output_token_ids, self.generator = [], list(output), None
        self.all_stop_token_ids = frozenset({0})

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids) + 1


def test_sampler_kernel_paths_share_the_seeded_stream():
    V = 200
    logits = _randn(4, V, seed=6, scale=0.3).to(DEVICE)
    calls = []

    def kernel(*args):
        calls.append(args[0].dtype)
        return sample(*args)

    sampler = Sampler(seed=1, device=DEVICE, kernel=kernel)
    seeded = _Row(output=[5, 6, 7], temperature=0.9, seed=123)
    alone = sampler(logits[:1].bfloat16(), [seeded]).sampled_token_ids
    assert calls == [torch.bfloat16]  # the fast path: the kernel reads the logits in their own dtype
    assert int(alone[0]) == _reference_draw(logits[0].bfloat16().float().cpu().numpy(), 0.9, 123, 3)
    # In a batch that needs the torch path (top_p, logprobs, a greedy row): the same token for the seeded row.
    rows = [seeded, _Row(temperature=1.0, top_p=0.5), _Row(temperature=0.0, logprobs=2), _Row()]
    out = sampler(logits.bfloat16(), rows)
    assert calls[-1] == torch.float32 and int(out.sampled_token_ids[0]) == int(alone[0])
    assert int(out.sampled_token_ids[2]) == int(logits[2].bfloat16().argmax())


def test_cpu_platform_picks_the_kernel_with_triton_kernels():
    from graphinfer.platforms.cpu import CpuPlatform

    assert CpuPlatform().sampler_kernel("triton") is sample
    assert CpuPlatform().sampler_kernel("reference") is None and CpuPlatform().sampler_kernel("eager") is None
