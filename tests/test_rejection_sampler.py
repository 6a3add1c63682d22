"""graphinfer::rejection_sample: the reference against a plain loop, the Triton kernel (interpreted without a GPU,
also under Triton-Ascend's interpreter: the Makefile's test-triton-ascend) against the reference, and the rule's
exactness as a distribution. Imports only torch, triton, pytest and graphinfer.ops (the Ascend venv has no more)."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

import graphinfer.ops  # noqa: E402,F401
from graphinfer.ops.rejection import rejection_sample as reference  # noqa: E402
from graphinfer.ops.triton.rejection import rejection_sample as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loop(drafts, targets, ks, width):
    out, d, t = [], 0, 0
    for k in ks:
        a = 0
        while a < k and drafts[d + a] == targets[t + a]:
            a += 1
        out.append(targets[t:t + a + 1] + [-1] * (width - a - 1))
        d, t = d + k, t + k + 1
    return out


def case(rng, ks, match):
    """drafts / targets for draft counts ks; match: chance a draft equals its target."""
    drafts, targets = [], []
    for k in ks:
        t = [rng.randrange(50) for _ in range(k + 1)]
        drafts += [x if rng.random() < match else x + 1 for x in t[:k]]
        targets += t
    return drafts, targets


def tensors(drafts, targets, ks):
    i64 = dict(dtype=torch.int64, device=DEVICE)
    return (torch.tensor(drafts, **i64), torch.tensor(targets, **i64),
            torch.tensor(ks, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32))


def test_known_case():
    # request 0: 3 drafts, 2 accepted; request 1: no drafts; request 2: 2 drafts, all accepted (+ bonus)
    d, t, cu = tensors([5, 6, 9, 1, 2], [5, 6, 7, 8, 4, 1, 2, 3], [3, 0, 2])
    expected = [[5, 6, 7, -1, -1], [4, -1, -1, -1, -1], [1, 2, 3, -1, -1]]
    for fn in (reference, kernel):
        assert fn(d, t, cu, 4).tolist() == expected


@pytest.mark.parametrize("seed", range(8))
def test_random_cases(seed):
    rng = random.Random(seed)
    B = rng.randrange(1, 10)
    max_k = 5 if seed < 6 else 20  # seeds 6, 7: long drafts (seed 7: 22 wide, past the kernel's minimum block 16)
    ks = [0] * B if seed == 0 else [rng.randrange(0, max_k + 1) for _ in range(B)]
    width = max(ks) + 1 + (seed % 3)  # max_spec_len may exceed every k
    drafts, targets = case(rng, ks, match=[0.0, 0.5, 0.9, 1.0][seed % 4])
    expected = loop(drafts, targets, ks, width)
    args = tensors(drafts, targets, ks)
    assert reference(*args, width - 1).tolist() == expected
    assert kernel(*args, width - 1).tolist() == expected
    assert torch.ops.graphinfer.rejection_sample(*args, width - 1).tolist() == expected


@pytest.mark.parametrize("draft", [1, 4])  # the likeliest token, and an unlikely one
def test_emitted_token_follows_the_target_distribution(draft):
    """Targets t ~ p at a one-draft position: the first emitted token is distributed as p (chi-square, 4 degrees of
    freedom, bound 18.47: its p = 1e-3 critical value), and the draft is accepted at the rate p(draft)."""
    g = torch.Generator().manual_seed(draft)
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    n = 20000
    targets = torch.multinomial(p, 2 * n, replacement=True, generator=g)  # (position 1, bonus) per request
    drafts = torch.full((n,), draft, dtype=torch.int64)
    cu = torch.arange(1, n + 1, dtype=torch.int32)
    out = reference(drafts, targets, cu, 1)
    counts = torch.bincount(out[:, 0], minlength=5).double()
    expected = p.double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 18.47
    rate = float((out[:, 0] == draft).double().mean())
    assert abs(rate - p[draft]) < 4 * (p[draft] * (1 - p[draft]) / n) ** 0.5
    assert ((out[:, 1] != -1) == (out[:, 0] == draft)).all()  # the bonus token only after an acceptance
