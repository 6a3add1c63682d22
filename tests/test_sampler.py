from dataclasses import dataclass, field
import math

import pytest
import torch

from graphinfer.errors import InvalidConfigError
from graphinfer.runtime.worker.sampler import Sampler, _exponential_
from graphinfer.sampling_params import SamplingParams

V = 64
EOS = 7


@dataclass
class Row:
    """What the sampler reads of a scheduled sequence (engine/sequence.py)."""
    sampling_params: SamplingParams
    prompt_token_ids: list = field(default_factory=list)
    output_token_ids: list = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_ids: frozenset = frozenset({EOS})

    @property
    def num_output_tokens(self) -> int:  # the token being sampled holds a placeholder once scheduled
        return len(self.output_token_ids) + 1

    @property
    def all_stop_token_ids(self) -> frozenset:
        return frozenset(self.sampling_params.stop_token_ids) | self.eos_token_ids


def row(prompt=(), output=(), eos=(EOS,), **kw):
    p = SamplingParams(**kw)
    g = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    return Row(p, list(prompt), list(output), g, frozenset(eos))


def rand_logits(b, v=V, seed=0, scale=3.0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def probs_logits(probs, b):
    return torch.tensor(probs).log().expand(b, -1).contiguous()


def test_greedy_is_argmax_in_mixed_batch():
    logits = rand_logits(6)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0) for i in range(6)]
    out = Sampler()(logits, rows)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids[::2], logits.argmax(-1)[::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_is_the_fp32_argmax(dtype):
    """All-greedy batches skip the fp32 copy: the same tokens as the full path, ties (first maximum) included."""
    logits = rand_logits(8, seed=3).to(dtype)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # an exact tie: the first index wins
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.sampled_logprobs is None and out.topk_token_ids is None
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1)) and int(out.sampled_token_ids[1]) == 5
    # A min_tokens mask in force, or logprobs, take the full path (eos masked; logprobs reported).
    logits[0, EOS] = logits[0].max() + 1
    masked = Sampler()(logits, [row(temperature=0.0, min_tokens=2)] + [row(temperature=0.0)] * 7)
    assert int(masked.sampled_token_ids[0]) != EOS and torch.equal(masked.sampled_token_ids[1:], out.sampled_token_ids[1:])
    assert Sampler()(logits, [row(temperature=0.0, logprobs=1)] * 8).sampled_logprobs is not None


def test_input_dtype_and_logits_untouched():
    logits = rand_logits(3).to(torch.bfloat16)
    before = logits.clone()
    out = Sampler()(logits, [row(temperature=0.0, repetition_penalty=2.0, prompt=range(10), logprobs=0)
                                for _ in range(3)])
    assert torch.equal(logits, before)
    assert out.sampled_logprobs.dtype == torch.float32


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 10.0])
def test_top_k_1_equals_greedy(temperature):
    logits = rand_logits(32, seed=1)
    greedy = Sampler()(logits, [row(temperature=0.0) for _ in range(32)]).sampled_token_ids
    topk1 = Sampler()(logits, [row(temperature=temperature, top_k=1) for _ in range(32)]).sampled_token_ids
    assert torch.equal(greedy, topk1)


def run_steps(sampler, rows, steps, logits_seed=3):
    """Sample `steps` tokens for every row on a fixed sequence of flat-ish logits."""
    toks = []
    for s in range(steps):
        logits = rand_logits(len(rows), seed=logits_seed + s, scale=0.5)
        toks.append(sampler(logits, rows).sampled_token_ids)
    return torch.stack(toks, 1)


def test_seed_reproducible_and_independent_of_batch():
    alone = run_steps(Sampler(seed=0), [row(seed=42)], 20)[0]
    # Same row in a batch with unseeded and other-seeded neighbours, different sampler seed: same tokens.
    # Logits depend on the row position, so put the seeded row first (same logits row as alone).
    batch = [row(seed=42), row(), row(seed=7), row(temperature=0.0), row(top_p=0.9)]
    together = run_steps(Sampler(seed=123), batch, 20)[0]
    assert torch.equal(alone, together)
    again = run_steps(Sampler(seed=0), [row(seed=42)], 20)[0]
    assert torch.equal(alone, again)


def test_different_seeds_differ():
    a = run_steps(Sampler(), [row(seed=1)], 20)[0]
    b = run_steps(Sampler(), [row(seed=2)], 20)[0]
    assert not torch.equal(a, b)


def test_unseeded_rows_follow_sampler_seed():
    a = run_steps(Sampler(seed=5), [row(), row()], 10)
    b = run_steps(Sampler(seed=5), [row(), row()], 10)
    c = run_steps(Sampler(seed=6), [row(), row()], 10)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprobs_ranks_and_topk_are_raw():
    logits = rand_logits(5, seed=4)
    # Penalties/temperature/top-k must not change the reported logprobs.
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=0.7, top_k=10, logprobs=5, repetition_penalty=1.5, prompt=range(20)),
        row(temperature=1.3, top_p=0.8, presence_penalty=1.0, output=[1, 2, 3]),
        row(temperature=1.0, logprobs=0),
        row(temperature=2.0, min_p=0.05),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    tok = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, tok[:, None])[:, 0])
    ref_ranks = torch.tensor([int((ref[i] > ref[i, tok[i]]).sum()) + 1 for i in range(5)])
    assert torch.equal(out.sampled_ranks, ref_ranks)
    assert out.sampled_ranks[0] == 1  # greedy without penalties is the top token
    vals, ids = torch.topk(ref, 5, dim=-1)
    assert out.topk_token_ids.shape == (5, 5) and out.topk_token_ids.dtype == torch.int64
    assert torch.equal(out.topk_token_ids, ids)
    torch.testing.assert_close(out.topk_logprobs, vals)


def test_raw_logits_mode_reports_the_logits():
    logits = rand_logits(3, seed=5).to(torch.bfloat16)
    rows = [row(temperature=0.0, logprobs=2), row(temperature=0.8, repetition_penalty=1.5, prompt=range(9),
                                                   logprobs=0), row(temperature=0.0)]
    out = Sampler(logprobs_mode="raw_logits")(logits, rows)
    raw = logits.float()  # before penalties and temperature, as raw_logprobs
    tok = out.sampled_token_ids
    assert torch.equal(out.sampled_logprobs, raw.gather(1, tok[:, None])[:, 0])
    assert torch.equal(out.topk_logprobs, torch.topk(raw, 2, dim=-1).values)
    assert torch.equal(out.sampled_ranks, torch.tensor([int((raw[i] > raw[i, tok[i]]).sum()) + 1 for i in range(3)]))
    with pytest.raises(InvalidConfigError, match="processed_logits.*raw_logprobs, raw_logits"):
        Sampler(logprobs_mode="processed_logits")


def test_tie_aware_comparison_at_the_logits_precision():
    from graphinfer.bench.common import compare_tie_aware, ulp
    from graphinfer.outputs import Logprob

    assert ulp(200.0, torch.bfloat16) == 1.0 and ulp(-300.0, torch.bfloat16) == 2.0 and ulp(1.5, torch.bfloat16) == 2**-7
    ref = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    got = [[5, 6, 7], [5, 9, 1], [5, 8, 1]]  # request 1: at a one-ulp gap; request 2: a three-ulp gap
    top = [{6: Logprob(200.0, 1), 9: Logprob(199.0, 2)}, {6: Logprob(201.0, 1), 8: Logprob(198.0, 2)}]
    logits = [[None, top[0]], [None, top[0]], [None, top[1]]]
    cmp = compare_tie_aware(ref, logits, got, logits_dtype=torch.bfloat16)
    assert (cmp["identical"], cmp["tie_divergences"], [m["request"] for m in cmp["mismatches"]]) == (1, 1, [2])
    assert cmp["mismatches"][0]["tie_limit"] == 1.0 and not cmp["ok"]
    # the same numbers read as log-probs with the fixed threshold: both are mismatches
    assert len(compare_tie_aware(ref, logits, got)["mismatches"]) == 2


def test_no_topk_when_nobody_asks():
    out = Sampler()(rand_logits(2), [row(), row(temperature=0.0)])
    assert out.topk_token_ids is None and out.topk_logprobs is None and out.sampled_logprobs is None


def sample_many(logits_row, n, **kw):
    return Sampler(seed=11)(logits_row.expand(n, -1).contiguous(), [row(**kw) for _ in range(n)]).sampled_token_ids


def test_top_k_restricts_support():
    logits = rand_logits(1, seed=5, scale=1.0)[0]
    toks = sample_many(logits, 3000, temperature=3.0, top_k=5)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    assert set(toks.tolist()) == allowed  # only the top 5, and with T=3 all of them show up


def test_top_p_restricts_to_nucleus():
    logits = probs_logits([0.05, 0.5, 0.1, 0.3, 0.05], 1)[0]
    toks = sample_many(logits, 3000, top_p=0.75)
    assert set(toks.tolist()) == {1, 3}  # 0.5 + 0.3 covers 0.75
    toks = sample_many(logits, 3000, top_p=0.85)
    assert set(toks.tolist()) == {1, 3, 2}


def test_min_p_restricts():
    logits = probs_logits([0.05, 0.5, 0.1, 0.3, 0.05], 1)[0]
    assert set(sample_many(logits, 3000, min_p=0.25).tolist()) == {1, 3}  # keep p >= 0.125
    assert set(sample_many(logits, 3000, min_p=0.15).tolist()) == {1, 3, 2}  # keep p >= 0.075


def ref_penalised(logits, r):
    """Per-row, per-token reference of vLLM's penalties."""
    x = logits.clone()
    p = r.sampling_params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        c = r.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def test_penalties_constructed_cases():
    base = torch.full((V,), -5.0)

    def greedy(top_two, **kw):
        logits = base.clone()
        logits[0], logits[1] = top_two
        return int(Sampler()(logits[None], [row(temperature=0.0, **kw)]).sampled_token_ids[0])

    assert greedy((3.0, 2.9)) == 0
    assert greedy((3.0, 2.9), prompt=[0], repetition_penalty=1.2) == 1  # 3/1.2 = 2.5
    assert greedy((-1.0, -1.1), output=[0], repetition_penalty=1.2) == 1  # -1*1.2 = -1.2
    assert greedy((-1.0, -1.1), output=[0], repetition_penalty=0.5) == 0  # < 1 rewards repeats
    assert greedy((2.0, 1.5), output=[0], presence_penalty=0.6) == 1
    assert greedy((2.0, 1.5), prompt=[0], presence_penalty=0.6) == 0  # prompt tokens don't count
    assert greedy((2.0, 1.5), output=[0, 0, 0], frequency_penalty=0.2) == 1  # 2 - 0.6
    assert greedy((2.0, 1.5), output=[0, 0], frequency_penalty=0.2) == 0  # 2 - 0.4
    assert greedy((2.0, 1.5), output=[1], presence_penalty=-1.0) == 1  # negative encourages: 1.5 + 1


def test_penalties_match_reference_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        B = 8
        logits = rand_logits(B, seed=100 + trial, scale=1.0)
        rows = []
        for i in range(B):
            kw = {}
            if torch.rand(1, generator=g) < 0.6:
                kw["repetition_penalty"] = float(torch.empty(1).uniform_(0.5, 2.0, generator=g))
            if torch.rand(1, generator=g) < 0.6:
                kw["presence_penalty"] = float(torch.empty(1).uniform_(-2, 2, generator=g))
            if torch.rand(1, generator=g) < 0.6:
                kw["frequency_penalty"] = float(torch.empty(1).uniform_(-2, 2, generator=g))
            prompt = torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
            output = torch.randint(0, 16, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()
            rows.append(row(prompt, output, temperature=0.0, **kw))
        out = Sampler()(logits, rows)
        ref = torch.stack([ref_penalised(logits[i], rows[i]) for i in range(B)]).argmax(-1)
        assert torch.equal(out.sampled_token_ids, ref)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 3], logits[0, 9] = 10.0, 9.0, 8.0

    def greedy(output, **kw):
        return int(Sampler()(logits, [row(output=output, temperature=0.0, **kw)]).sampled_token_ids[0])

    assert greedy([1, 2], min_tokens=3, stop_token_ids=[3]) == 9
    assert greedy([1, 2], min_tokens=3, stop_token_ids=[3], ignore_eos=True) == 9  # vLLM masks eos regardless
    assert greedy([1, 2, 4], min_tokens=3, stop_token_ids=[3]) == EOS  # reached: no mask
    assert greedy([], stop_token_ids=[3]) == EOS
    # Random rows never draw them either.
    toks = sample_many(torch.zeros(V).index_fill(0, torch.tensor([EOS, 3]), 5.0), 500,
                       min_tokens=2, stop_token_ids=[3], temperature=1.0)
    assert not set(toks.tolist()) & {EOS, 3}
    # Models with several end ids (Llama 3's <|end_of_text|> and <|eot_id|>) get all of them masked.
    two_eos = Sampler()(logits, [row(output=[1], temperature=0.0, min_tokens=3, eos=(EOS, 3))]).sampled_token_ids
    assert int(two_eos[0]) == 9


def test_sampling_follows_softmax():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000
    toks = sample_many(probs.log() * 1.0, n, temperature=1.0)
    counts = torch.bincount(toks, minlength=5).float()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40, (counts, expected)  # 4 dof: P(chi2 > 40) ~ 4e-8
    # Temperature 2 flattens to softmax(log p / 2).
    toks = sample_many(probs.log(), n, temperature=2.0)
    counts = torch.bincount(toks, minlength=5).float()
    expected = torch.softmax(probs.log() / 2, -1) * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 40


def test_llm_logprobs_mode_raw_logits():
    """LLM(logprobs_mode="raw_logits") reports the logits: the same tokens as raw_logprobs, each position's values
    shifted by one constant (the log-sum-exp), and refused with the fix for a mode it lacks."""
    from graphinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    outs = {mode: LLM("tiny-llama", device="cpu", num_gpu_blocks_override=16, logprobs_mode=mode)
            .generate([[1, 2, 3, 4]], params, use_tqdm=False)[0].outputs[0] for mode in ("raw_logprobs", "raw_logits")}
    assert outs["raw_logits"].token_ids == outs["raw_logprobs"].token_ids
    for logits, logprobs in zip(outs["raw_logits"].logprobs, outs["raw_logprobs"].logprobs):
        assert logits.keys() == logprobs.keys()
        shifts = [logits[t].logprob - logprobs[t].logprob for t in logits]
        assert max(shifts) - min(shifts) < 1e-4 and abs(shifts[0]) > 1e-3
    with pytest.raises(InvalidConfigError, match="raw_logprobs, raw_logits"):
        LLM("tiny-llama", device="cpu", num_gpu_blocks_override=16, logprobs_mode="processed_logprobs")


def test_greedy_rows_on_cpu_take_the_cpu_kernel(monkeypatch):
    """Greedy rows with nothing else to do: the cpu platform's argmax (ops/cpu/sampling.py; torch.max where the
    library is not built), the same index as torch.max(dim=-1)."""
    from graphinfer.ops.cpu import sampling as cpu_sampling

    calls, real = [], cpu_sampling.argmax
    monkeypatch.setattr(cpu_sampling, "argmax", lambda logits: calls.append(tuple(logits.shape)) or real(logits))
    logits = rand_logits(3).to(torch.bfloat16)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(3)])
    assert calls == [(3, V)] and torch.equal(out.sampled_token_ids, logits.max(dim=-1).indices)


def test_cpu_exponential_draws_are_exp1_and_seeded():
    """The race's Exp(1) noise on CPU (-log U, U uniform: ATen's CPU exponential_ is a serial libm loop): mean and
    variance 1, P(E > 3) = e^-3, and the same generator seed gives the same draws."""
    q = _exponential_(torch.empty(200_000), torch.Generator().manual_seed(0))
    assert (q >= 0).all()
    assert abs(q.mean().item() - 1) < 0.01 and abs(q.var().item() - 1) < 0.03
    assert abs((q > 3).float().mean().item() - math.exp(-3)) < 0.003
    assert torch.equal(q, _exponential_(torch.empty(200_000), torch.Generator().manual_seed(0)))
