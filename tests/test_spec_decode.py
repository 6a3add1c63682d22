"""Speculative decoding (graphinfer/runtime/spec_decode/): greedy outputs equal those without it, for every k and
proposer, through chunked prefill, prefix-cache hits, preemption and the async flag; sampled tokens follow the
target distribution (chi-square); rejected drafts leave no KV block behind; the counters add up."""
import random

import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.config import SpeculativeConfig
from graphinfer.errors import InvalidConfigError
from graphinfer.runtime.worker.sampler import Sampler
from graphinfer.runtime.engine.sequence import Sequence
from graphinfer.runtime.spec_decode.ngram_proposer import NgramProposer
from graphinfer.runtime.spec_decode.verify import verify

# Tight: 16 blocks of 8 and a 48-token budget force chunked prefill and preemptions (as test_async_scheduling).
ENGINE = dict(max_num_seqs=6, max_num_batched_tokens=48, num_gpu_blocks_override=16, block_size=8, dtype="float32")


def ngram(k, lo=1, hi=3):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def test_ngram_proposer_takes_the_most_recent_longest_match_with_k_tokens_after():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # "1 2 3" last followed by 7 8 1
    assert p.propose([5, 6, 7, 5, 6], 3) == [7, 5, 6]
    assert p.propose([5, 6, 7, 5, 6], 1) == [7]  # budget
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([4, 4, 4], 3) == [4]  # an overlapping occurrence, continuation cut at the end
    assert p.propose([4, 4, 4, 4, 4, 4], 2) == [4, 4]  # not the most recent "4 4 4": only one token follows it
    assert p.propose([1, 2, 7, 7, 1, 2, 8, 1, 2], 2) == [8, 1]  # the most recent of the occurrences with 2 after
    assert NgramProposer(3, 2, 2).propose([1, 2, 9, 3, 2], 3) == []  # "3 2" never seen before; "2" alone too short


def test_speculative_config_parses_vllms_forms():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 4, "model": "[ngram]"})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    assert SpeculativeConfig.from_dict({"model": "tiny-llama", "num_speculative_tokens": 2}).method == "draft_model"
    for bad in ({"method": "eagle"}, {"method": "ngram", "num_speculative_tokens": 0}, {"speculative_model": "x"},
                {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {"method": "draft_model"}):
        with pytest.raises(InvalidConfigError):
            SpeculativeConfig.from_dict(bad)


def _prompts(n=12, seed=0):
    """Repetitive prompts (a phrase said a few times, so lookup finds matches) of varied lengths; every third shares
    a 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(24)]
    out = []
    for i in range(n):
        phrase = [rng.randrange(1, 200) for _ in range(rng.randrange(2, 6))]
        body = phrase * rng.randrange(2, 6) + [rng.randrange(1, 200) for _ in range(rng.randrange(0, 8))]
        out.append({"prompt_token_ids": (shared if i % 3 == 0 else []) + body})
    return out


def _run(prompts, params, **kw):
    llm = LLM("tiny-llama", **{**ENGINE, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.local_core.scheduler.block_manager.num_free_blocks == engine.worker.model_runner.num_blocks  # nothing leaked
    assert not engine.output_processor.requests and not engine.local_core.scheduler.running and not engine.local_core.scheduler.waiting
    return outs, engine


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


@pytest.fixture(scope="module")
def greedy_base():
    prompts = _prompts()
    lens = random.Random(1)
    params = [SamplingParams(temperature=0, max_tokens=lens.randrange(1, 40)) for _ in prompts]
    outs, engine = _run(prompts, params)
    assert engine.local_core.scheduler.num_preemptions > 0
    return prompts, params, outs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_equals_no_spec(greedy_base, k):
    prompts, params, expected = greedy_base
    outs, engine = _run(prompts, params, speculative_config=ngram(k))
    assert _summary(outs) == _summary(expected)
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    # the counters add up: per request, per position, and what was drafted at most k per verification
    assert sum(o.metrics["spec_decode_num_draft_tokens"] for o in outs) == stats["num_draft_tokens"]
    assert sum(o.metrics["spec_decode_num_accepted_tokens"] for o in outs) == stats["num_accepted_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert len(stats["num_accepted_tokens_per_pos"]) == k
    stats["num_accepted_tokens_per_pos"].append(0)  # a copy: the caller's dict never aliases the live counters
    assert len(engine.spec_decode_stats()["num_accepted_tokens_per_pos"]) == k
    assert stats["num_draft_tokens"] <= k * stats["num_drafts"]
    assert engine.local_core.scheduler.num_preemptions > 0


def test_ngram_with_async_flag_and_stops(greedy_base):
    """Stop tokens and stop strings can land mid-proposal: the rest of the accepted drafts is dropped."""
    prompts, params, expected = greedy_base
    common = [o.outputs[0].token_ids[2] for o in expected if len(o.outputs[0].token_ids) > 2][:3]
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, stop_token_ids=common) for p in params]
    base, _ = _run(prompts, params)
    outs, _ = _run(prompts, params, speculative_config=ngram(4), async_scheduling=True)
    assert sum(o.outputs[0].finish_reason == "stop" for o in base) >= 3
    assert _summary(outs) == _summary(base)


def test_logprobs_and_penalties_with_spec(greedy_base):
    """Logprobs of the emitted tokens and penalties (which count the drafts before each position) as without spec."""
    prompts, _, _ = greedy_base
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, repetition_penalty=1.3, presence_penalty=0.5)
    base, _ = _run(prompts[:4], params)
    outs, engine = _run(prompts[:4], params, speculative_config=ngram(3))
    assert engine.spec_decode_stats()["num_drafts"] > 0
    for o, b in zip(outs, base):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
        for lp, blp in zip(o.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp.keys() == blp.keys()
            for t in lp:
                assert lp[t].rank == blp[t].rank and abs(lp[t].logprob - blp[t].logprob) < 1e-4


def _seq(tokens, drafts, params):
    seq = Sequence("r", [1], params, max_tokens=100)
    seq.token_ids += tokens
    seq.output_token_ids += tokens
    seq.spec_token_ids = list(drafts)
    seq.num_pending = 1  # scheduled: the verify step's tokens hold a placeholder
    return seq


def _chisquare_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's statistic below the 1e-4 quantile's bound for len(probs) - 1 <= 7 degrees of freedom (24.3)."""
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token of probability 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) < 24.3


@pytest.mark.parametrize("drafts", [(2, 5), (7, 0)])  # a likely then an unlikely draft, and the reverse
def test_verification_follows_the_target_distribution(drafts):
    """Rows of two drafts over an 8-token vocabulary with fixed target distributions per position: the first
    emitted token follows p0, the second (after an accepted first draft) follows p1, and a draft is accepted at the
    rate p(draft) (the accept / resample-from-residual rule)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, 8) * 1.5, dim=-1)
    n = 20000
    rows = [_seq([], drafts, SamplingParams(temperature=1.0)) for _ in range(n)]
    logits = p.log().repeat(n, 1)  # rows (request, position): request i's positions at 3i..3i+2
    out = verify(Sampler(seed=0), logits, rows, [2] * n, torch.from_numpy)
    emitted = out.output_token_ids
    first = torch.bincount(emitted[:, 0], minlength=8).float()
    assert _chisquare_ok(first, p[0])
    accepted = emitted[:, 0] == drafts[0]
    assert abs(accepted.float().mean() - p[0, drafts[0]]) < 4 * (p[0, drafts[0]] * (1 - p[0, drafts[0]]) / n) ** 0.5
    assert (emitted[~accepted, 1] == -1).all()  # a rejection ends the row
    second = torch.bincount(emitted[accepted, 1], minlength=8).float()
    if accepted.sum() > 500:
        assert _chisquare_ok(second, p[1])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_no_spec(greedy_base, k):
    """tiny-qwen3 (random weights, the same 256-token vocabulary) drafts for tiny-llama: mostly rejected, which
    exercises the draft's rollback after every rejection."""
    prompts, params, expected = greedy_base
    outs, engine = _run(prompts, params, speculative_config={"model": "tiny-qwen3", "num_speculative_tokens": k})
    assert _summary(outs) == _summary(expected)
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] <= k * stats["num_drafts"]
    proposer = engine.local_core.proposer  # a Worker of its own and a block manager over its KV cache
    assert proposer.block_manager.num_free_blocks + sum(len(m.block_table) for m in proposer.mirrors.values()) \
        == proposer.worker.num_blocks


def test_draft_model_itself_accepts_everything():
    """The target as its own draft: every draft is accepted (greedy), so a step emits k + 1 tokens."""
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    base, _ = _run(prompts, params)
    outs, engine = _run(prompts, params, speculative_config={"model": "tiny-llama", "num_speculative_tokens": 3})
    assert _summary(outs) == _summary(base)
    stats = engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert stats["mean_acceptance_length"] > 3.0


def test_vocabulary_mismatch_is_refused():
    with pytest.raises(InvalidConfigError, match="vocabulary"):
        LLM("tiny-llama", **ENGINE, speculative_config={"model": "smollm2-135m", "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_verify_graphs_replay_under_the_capture_stand_in(monkeypatch, greedy_base, method):
    """FULL_DECODE_ONLY with speculative decoding captures verify graphs (1 + k tokens per request) next to the
    decode graphs; uniform verification steps replay them (padded buckets included) with the tokens of NONE."""
    from capture_standin import OpTapePlatform

    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    prompts, params, expected = greedy_base
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    spec = ngram(2) if method == "ngram" else {"model": "tiny-llama", "num_speculative_tokens": 2}
    llm = LLM("tiny-llama", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4], speculative_config=spec,
              **{**ENGINE, "num_gpu_blocks_override": 64})
    runner = llm.llm_engine.worker.model_runner
    assert runner.dispatcher.verify_graphs.query_len == 3 and sorted(runner.dispatcher.verify_graphs.graphs) == [1, 2, 4]
    replays = []
    replay = runner.dispatcher.verify_graphs.replay
    monkeypatch.setattr(runner.dispatcher.verify_graphs, "replay", lambda *a, **k: replays.append(len(a[0])) or replay(*a, **k))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(outs) == _summary(expected)
    assert replays and set(replays) <= {3, 6, 9, 12}


SMOLLM2_NGRAM = ngram(3, 1, 4)


@pytest.fixture(scope="module")
def smollm2_ngram():
    """The real SmolLM2 (fp32) with ngram speculative decoding: the greedy check below and the bad-words one."""
    llm = LLM(dtype="float32", max_model_len=1024, seed=0, speculative_config=SMOLLM2_NGRAM)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("spec", [SMOLLM2_NGRAM, pytest.param(  # self-draft: 23 s; tiny draft models run below
    {"method": "draft_model", "model": "SMOLLM2", "num_speculative_tokens": 2}, marks=pytest.mark.slow)],
                         ids=["ngram", "self-draft"])
def test_smollm2_greedy_equals_no_spec(smollm2_greedy, smollm2_path, spec, request):
    """The real SmolLM2 (fp32) on test_smollm2's prompts, 32 greedy tokens: ngram lookup, and SmolLM2 drafting for
    itself, give the tokens of the engine without speculation."""
    from test_smollm2 import PROMPTS

    if spec.get("model") == "SMOLLM2":  # resolved here, not at collection (a machine without the package skips)
        spec = {**spec, "model": smollm2_path}
    n = len(PROMPTS) if spec["method"] == "ngram" else 2  # the self-draft runs two SmolLM2s: fewer prompts
    ngram_engine = spec["method"] == "ngram"
    llm = request.getfixturevalue("smollm2_ngram") if ngram_engine else \
        LLM(dtype="float32", max_model_len=1024, seed=0, speculative_config=spec)
    before = dict(llm.llm_engine.spec_decode_stats())  # the shared ngram engine may have run the bad-words test
    outs = llm.generate(PROMPTS[:n], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in smollm2_greedy[:n]]
    stats = llm.llm_engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] > before.get("num_accepted_tokens", 0)
    if spec.get("model") is not None:
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    if not ngram_engine:
        llm.shutdown()


def test_bad_words_with_ngram_drafts(smollm2_ngram, smollm2_llm):
    """bad_words under ngram speculative decoding (test_bad_words_engines.py: the prompts, and the plain engine's
    texts): the repeated prompt's " France" is drafted after " capital of" and must be rejected where banned."""
    from test_bad_words_engines import check_bad_words, expected_texts

    outs = check_bad_words(smollm2_ngram, expected_texts(smollm2_llm))
    assert outs[0].metrics["spec_decode_num_draft_tokens"] > 0  # drafts were verified


def test_metrics_export_the_counters(greedy_base):
    from graphinfer.server.metrics import Metrics

    prompts, params, _ = greedy_base
    _, engine = _run(prompts[:4], params[:4], speculative_config=ngram(3))
    metrics = Metrics("tiny")
    metrics.watch_spec_decode(engine)
    text = metrics.render().decode()
    stats = engine.spec_decode_stats()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'graphinfer:spec_decode_{name}_total{{model_name="tiny"}} {float(stats[name])}' in text
    for pos, n in enumerate(stats["num_accepted_tokens_per_pos"]):
        assert f'graphinfer:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}} {float(n)}' in text


def test_cli_speculative_config(capsys):
    """--speculative-config takes vLLM's JSON; a bad one is a usage error naming the problem."""
    from graphinfer.cli import build_parser, main

    args = build_parser().parse_args(["generate", "--model", "tiny-llama", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}', "--prompt", "x"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        main(["generate", "--model", "tiny-llama", "--prompt", "x", "--speculative-config", "{method: ngram}"])
    assert "not JSON" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-llama", "--prompt", "x", "--speculative-config", '{"method": "eagle"}']) != 0
    assert "use one of ngram, draft_model" in capsys.readouterr().err


def test_rejected_drafts_leave_no_blocks_behind(greedy_base):
    """After every step each sequence holds exactly the blocks of its computed tokens: the lookahead blocks of
    rejected drafts went back to the pool at once (with block_size 2, three drafts span a block)."""
    prompts, params, _ = greedy_base
    llm = LLM("tiny-llama", **{**ENGINE, "block_size": 2, "num_gpu_blocks_override": 96},
              speculative_config={"model": "tiny-qwen3", "num_speculative_tokens": 3})
    engine = llm.llm_engine
    bm = engine.local_core.scheduler.block_manager
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p["prompt_token_ids"], sp)
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.local_core.scheduler.running:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    stats = engine.spec_decode_stats()
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # some drafts were rejected
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_cuda_graphs_with_speculative_decoding_match_eager(monkeypatch, mode, method):
    """On a GPU (tools/h100_bench.sh check): real CUDA graphs and the Triton kernels (rejection_sample included):
    ngram k=3 and a draft model (k=3) give the greedy tokens of NONE without speculation. The verify graphs (1 + k
    tokens per request) replay only when every request has k drafts: a draft model proposes k every step, ngram on a
    random model mostly fewer (on an H200 no ngram verify step replayed; on CPU the same 12 requests never have 3
    drafts each in one step), so the replays are asserted for the draft model."""
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) for _ in prompts]
    kw = dict(max_num_seqs=16, device="cuda", dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 28)
    base = LLM("tiny-qwen3", graph_mode="NONE", **kw)
    expected = _summary(base.generate(prompts, params, use_tqdm=False))
    base.shutdown()
    spec = ngram(3, 1, 4) if method == "ngram" else {"model": "tiny-qwen3", "num_speculative_tokens": 3}
    llm = LLM("tiny-qwen3", graph_mode=mode, capture_sizes=[1, 2, 4, 8, 16], speculative_config=spec, **kw)
    graphs = llm.llm_engine.worker.model_runner.dispatcher.verify_graphs
    replays, replay = [], graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda *a, **k: replays.append(len(a[0])) or replay(*a, **k))
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0
    assert replays or method == "ngram"
    llm.shutdown()
