"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) must give what
the synchronous engine gives: the same tokens, stops, logprobs and finish reasons, through preemption,
prefix-cache hits, chunked prefill, stop tokens (one dropped row each), penalties (which make it wait), and
aborts, with no KV block leaked. On cpu nothing overlaps, but every code path of the async engine runs."""
import random
from collections import Counter

import pytest

from graphinfer import LLM, SamplingParams

# Tight on purpose: 6 running sequences, a 48-token budget and 16 blocks of 8 force chunked prefill and
# preemptions; every third prompt shares a 40-token prefix (prefix-cache hits).
ENGINE = dict(max_num_seqs=6, max_num_batched_tokens=48, num_gpu_blocks_override=16, block_size=8, dtype="float32")


def _prompts(n=16, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 200) for _ in range(40)]
    return [{"prompt_token_ids": (shared if i % 3 == 0 else []) + [rng.randrange(1, 200) for _ in range(rng.randrange(3, 60))]}
            for i in range(n)]


def _run(async_scheduling: bool, prompts, params, **kw):
    llm = LLM("tiny-llama", async_scheduling=async_scheduling, **{**ENGINE, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.local_core.scheduler.block_manager.num_free_blocks == engine.worker.model_runner.num_blocks
    assert not engine.output_processor.requests and not engine.local_core.scheduler.running and not engine.local_core.scheduler.waiting
    return [o.outputs[0] for o in outs], engine.local_core.scheduler.num_preemptions


def _summary(outs):
    return [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]


@pytest.fixture(scope="module")
def greedy_sync():
    prompts = _prompts()
    lens = random.Random(1)
    params = [SamplingParams(temperature=0, max_tokens=lens.randrange(1, 40)) for _ in prompts]
    return prompts, params, _run(False, prompts, params)


def test_greedy_matches_sync_through_preemption(greedy_sync):
    prompts, params, (expected, preempted) = greedy_sync
    outs, async_preempted = _run(True, prompts, params)
    assert preempted > 0 and async_preempted > 0  # the setting does exercise preemption
    assert _summary(outs) == _summary(expected)


def test_stop_tokens_drop_the_extra_row(greedy_sync):
    prompts, params, (expected, _) = greedy_sync
    common = [t for t, _ in Counter(t for o in expected for t in o.token_ids).most_common(3)]
    params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, stop_token_ids=common) for p in params]
    sync, _ = _run(False, prompts, params)
    outs, _ = _run(True, prompts, params)
    assert sum(o.finish_reason == "stop" for o in sync) >= 3
    assert _summary(outs) == _summary(sync)


def test_seeded_sampling_min_tokens_and_logprobs_match_sync():
    prompts = _prompts(8, seed=3)
    # Half the vocabulary stops: min_tokens decides most lengths, so counting the in-flight token matters.
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12 + i, min_tokens=4,
                             logprobs=2, stop_token_ids=list(range(256)))
              for i in range(len(prompts))]
    sync, _ = _run(False, prompts, params, num_gpu_blocks_override=64)
    outs, _ = _run(True, prompts, params, num_gpu_blocks_override=64)
    assert sum(len(o.token_ids) == 5 for o in sync) >= 2  # stopped right after min_tokens
    assert _summary(outs) == _summary(sync)
    for a, b in zip(outs, sync):
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-5, abs=1e-5)
        for ea, eb in zip(a.logprobs, b.logprobs, strict=True):  # batches differ by dropped rows: float noise
            assert list(ea) == list(eb) and [lp.rank for lp in ea.values()] == [lp.rank for lp in eb.values()]
            assert [lp.logprob for lp in ea.values()] == pytest.approx([lp.logprob for lp in eb.values()], rel=1e-5,
                                                                       abs=1e-5)


def test_penalties_wait_for_the_previous_tokens():
    """Penalties count the generated tokens, so a step with a penalised row waits for the tokens in flight.
    Greedy on the tiny model repeats itself; strong penalties change that, token by token."""
    prompts = _prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=2.0 if i % 2 else 0.0,
                             repetition_penalty=2.0 if i % 3 == 0 else 1.0, frequency_penalty=1.0 if i == 4 else 0.0)
              for i in range(len(prompts))]
    sync, _ = _run(False, prompts, params, num_gpu_blocks_override=64)
    outs, _ = _run(True, prompts, params, num_gpu_blocks_override=64)
    assert _summary(outs) == _summary(sync)


def test_abort_with_a_step_in_flight_leaks_nothing():
    llm = LLM("tiny-llama", async_scheduling=True, **{**ENGINE, "num_gpu_blocks_override": 64})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [p["prompt_token_ids"] for p in _prompts(4)]
    ids = [engine.add_request(None, p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.local_core._in_flight is not None and engine.local_core.scheduler.running[0].num_pending == 1
    engine.abort_request(ids[0])
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert ids[0] not in finished and all(len(finished[i]) == 20 for i in ids[1:])
    assert engine.local_core.scheduler.block_manager.num_free_blocks == engine.worker.model_runner.num_blocks
    sync = LLM("tiny-llama", **{**ENGINE, "num_gpu_blocks_override": 64}).generate(prompts[1:], params, use_tqdm=False)
    assert [finished[i] for i in ids[1:]] == [o.outputs[0].token_ids for o in sync]


def test_length_stop_is_known_ahead():
    """A request whose last token is in flight is not scheduled again: with exactly the blocks its prompt and
    max_tokens need (4 of 8 tokens: 24 + 9 - 1 = 32 positions), an extra row would need a 5th block."""
    prompt = list(range(1, 25))
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    sync, _ = _run(False, [prompt], params, num_gpu_blocks_override=4)
    outs, preempted = _run(True, [prompt], params, num_gpu_blocks_override=4)
    assert preempted == 0 and len(outs[0].token_ids) == 9 and outs[0].finish_reason == "length"
    assert _summary(outs) == _summary(sync)
