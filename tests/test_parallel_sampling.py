"""Parallel sampling (n, best_of) and echo, offline on the bundled SmolLM2 (the session's smollm2_llm) and through one
`graphinfer serve` of it with the official openai client.

References: the engine's own n=1 runs (child i of a request seeded s is the n=1 request seeded s + i, vLLM's rule), the
openai client's parsing, vLLM's choice numbering (prompt p's i-th output is choice p * n + i).
The server runs with --async-scheduling, so the children also run with steps launched ahead.
"""
import math

import openai
import pytest

from graphinfer import SamplingParams
from graphinfer.config import CacheConfig, SchedulerConfig
from graphinfer.errors import InvalidSamplingParamsError
from graphinfer.runtime.entrypoints.parallel_sampling import child_params, child_request_id
from graphinfer.runtime.engine.scheduler import Scheduler
from graphinfer.runtime.engine.sequence import Sequence

MODEL = "smol"
PROMPT = "Once upon a time, in a small village by the sea,"
SAMPLE = dict(temperature=1.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def server(openai_server):  # conftest: SmolLM2 fp32, async scheduling
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _texts(out):
    return [c.text for c in out.outputs]


# ----- server (the official openai client) -----

def _stream(chunks, field=lambda ch: ch.text):
    """choice index -> (text, finish_reason), from streamed chunks."""
    got = {}
    for chunk in chunks:
        for ch in chunk.choices:
            text, finish = got.get(ch.index, ("", None))
            got[ch.index] = (text + (field(ch) or ""), ch.finish_reason or finish)
    return got


def test_server_completions_n(client):
    kw = dict(model=MODEL, prompt=PROMPT, n=3, seed=7, max_tokens=6, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once (vLLM's usage)
    assert r.usage.completion_tokens == 18
    streamed = _stream(client.completions.create(**kw, stream=True))
    assert streamed == {c.index: (c.text, c.finish_reason) for c in r.choices}


def test_server_chat_n(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=3, seed=2, max_tokens=6)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    streamed = _stream(client.chat.completions.create(**kw, stream=True), lambda ch: ch.delta.content)
    assert streamed == {c.index: (c.message.content, c.finish_reason) for c in r.choices}


def test_server_n_with_several_prompts_numbers_choices_prompt_major(client):
    prompts = [PROMPT, "The ships at night"]
    kw = dict(model=MODEL, n=2, seed=4, max_tokens=5, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw).choices for p in prompts]
    assert [(c.index, c.text) for c in r.choices] == [(2 * p + c.index, c.text) for p in range(2) for c in alone[p]]
    streamed = _stream(client.completions.create(prompt=prompts, stream=True, **kw))
    assert {k: t for k, (t, _) in streamed.items()} == {c.index: c.text for c in r.choices}


def test_server_best_of(client):
    kw = dict(model=MODEL, prompt=PROMPT, seed=9, max_tokens=5, logprobs=0, extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=3, **kw).choices  # the same three candidates: seeds 9, 10, 11
    best = client.completions.create(n=2, best_of=3, **kw).choices
    ranked = sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [(c.index, c.text) for c in best] == [(0, ranked[0].text), (1, ranked[1].text)]
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(n=1, best_of=2, stream=True, **kw)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=3, best_of=2, **kw)


def test_server_echo(client, smollm2_llm):
    ids = smollm2_llm.get_tokenizer()(PROMPT).input_ids
    kw = dict(model=MODEL, max_tokens=5, temperature=0, echo=True)
    text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    assert text == PROMPT + plain
    from_ids = client.completions.create(prompt=ids, n=2, **kw).choices
    assert [c.text for c in from_ids] == [smollm2_llm.get_tokenizer().decode(ids) + plain] * 2
    assert _stream(client.completions.create(prompt=PROMPT, stream=True, **kw)) == {0: (text, "length")}
    # echo + logprobs: the prompt's logprobs (computed by child 0 alone) before each choice's own
    both = [c.logprobs for c in client.completions.create(prompt=PROMPT, n=2, logprobs=1, **kw).choices]
    assert both[0].token_logprobs[0] is None and len(both[0].tokens) == len(ids) + 5
    assert both[0].tokens == both[1].tokens  # greedy twins
    P = len(ids)
    assert both[0].token_logprobs[:P] == both[1].token_logprobs[:P]  # the same prompt logprobs
    assert both[0].token_logprobs[P:] == pytest.approx(both[1].token_logprobs[P:], abs=1e-5)  # (child 1: cache hits)


# ----- offline -----

def test_invalid_n_and_best_of():
    for kw, match in [(dict(n=0), "n=0"), (dict(n=3, best_of=2), "best_of=2 must be an integer >= n=3"),
                      (dict(n=1, best_of=2, temperature=0), "greedy")]:
        with pytest.raises(InvalidSamplingParamsError, match=match):
            SamplingParams(**kw)
    assert SamplingParams(n=2).num_candidates == 2 and SamplingParams(n=2, best_of=3).num_candidates == 3


def test_seeded_n_gives_distinct_reproducible_children_equal_to_n1_runs(smollm2_llm):
    params = SamplingParams(n=3, seed=11, **SAMPLE)
    out, again = (smollm2_llm.generate(PROMPT, params, use_tqdm=False)[0] for _ in range(2))
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(set(_texts(out))) == 3, _texts(out)
    assert _texts(again) == _texts(out)
    singles = smollm2_llm.generate([PROMPT] * 3, [SamplingParams(seed=11 + i, **SAMPLE) for i in range(3)],
                                   use_tqdm=False)
    assert [o.outputs[0].token_ids for o in singles] == [c.token_ids for c in out.outputs]
    chat = smollm2_llm.chat([{"role": "user", "content": "Name a colour."}], SamplingParams(n=2, seed=3, **SAMPLE),
                            use_tqdm=False)[0]
    assert [c.index for c in chat.outputs] == [0, 1] and all(len(c.token_ids) == 4 for c in chat.outputs)


def test_greedy_n_equals_n1(smollm2_llm):
    # 3 full blocks of prompt (64 tokens each on cpu): the second child reads the first one's prompt KV, written in
    # the same step
    prompt = "Greedy siblings must agree. " * 32
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    two = smollm2_llm.generate(prompt, SamplingParams(n=2, **greedy), use_tqdm=False)[0]
    bs = smollm2_llm.llm_engine.local_core.scheduler.block_manager.block_size
    assert two.metrics["num_cached_tokens"][0] == 0 and two.metrics["num_cached_tokens"][1] >= 2 * bs
    ref = smollm2_llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [ref.outputs[0].token_ids] * 2


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(smollm2_llm):
    best = smollm2_llm.generate(PROMPT, SamplingParams(n=2, best_of=4, seed=5, **SAMPLE), use_tqdm=False)[0]
    candidates = smollm2_llm.generate([PROMPT] * 4, [SamplingParams(seed=5 + i, logprobs=0, **SAMPLE)
                                                     for i in range(4)], use_tqdm=False)
    for o in candidates:  # the candidates' own logprobs add up to their cumulative logprob
        c = o.outputs[0]
        assert math.isclose(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), c.cumulative_logprob,
                            abs_tol=1e-4)
    ranked = sorted((o.outputs[0] for o in candidates), key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert all(math.isclose(b.cumulative_logprob, r.cumulative_logprob, rel_tol=1e-4)
               for b, r in zip(best.outputs, ranked))
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert all(c.logprobs is None for c in best.outputs)  # not asked for: computed only to rank


def test_children_share_the_prompt_blocks_and_abort_together(smollm2_llm):
    engine = smollm2_llm.llm_engine
    bm, bs = engine.local_core.scheduler.block_manager, engine.local_core.scheduler.block_manager.block_size
    ids = engine.tokenize("[kv sharing] A keeper climbs the stairs, lights the lamp and waits for the ships " * 8)
    assert len(ids) > 2 * bs and len(ids) % bs, len(ids)  # shared full blocks, and a partial last block
    in_use = bm.num_blocks - bm.num_free_blocks
    rid = engine.add_request(None, ids, SamplingParams(n=3, seed=1, **SAMPLE))
    engine.step()  # one step admits and prefills all three children
    children = [engine.local_core.scheduler.requests[f"{i}_{rid}"] for i in range(3)]
    assert all(c.num_computed_tokens == len(ids) for c in children)
    shared = (len(ids) - 1) // bs * bs
    assert [c.num_cached_tokens for c in children] == [0, shared, shared]
    own = -(-len(ids) // bs)  # blocks one prompt takes
    assert bm.num_blocks - bm.num_free_blocks - in_use == own + 2 * (own - shared // bs)  # not 3 * own
    computed = sum(len(ids) - c.num_cached_tokens for c in children)
    assert computed < 1.5 * len(ids), computed  # ~1x the prompt, not 3x
    engine.abort_request(rid)  # the request's id aborts every child
    assert not engine.output_processor.requests and not engine.output_processor.parents and not engine.local_core.scheduler.running
    assert bm.num_blocks - bm.num_free_blocks == in_use


def test_failed_step_withdraws_the_blocks_offered_to_the_prefix_cache(smollm2_llm):
    engine = smollm2_llm.llm_engine
    prompt = "[failed step] The night was long and the sea was grey, the keeper wrote. " * 8
    params = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    runner, execute = engine.worker.model_runner, engine.worker.model_runner.execute

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    runner.execute = boom
    try:
        with pytest.raises(KeyboardInterrupt):
            smollm2_llm.generate(prompt, params, use_tqdm=False)
    finally:
        runner.execute = execute
    out = smollm2_llm.generate(prompt, params, use_tqdm=False)[0]
    # nothing was served from blocks whose KV was never written (the sibling shares the ones written now)
    bs = engine.local_core.scheduler.block_manager.block_size
    assert out.metrics["num_cached_tokens"][0] == 0 and out.metrics["num_cached_tokens"][1] >= 2 * bs
    ref = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert _texts(out) == _texts(ref[0]) * 2


def test_scheduler_shares_prompt_blocks_in_one_step_only_with_prefix_caching():
    for caching in (True, False):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                          CacheConfig(block_size=4, enable_prefix_caching=caching), 64, max_model_len=64)
        params = SamplingParams(n=3, seed=0)
        for i in range(3):
            sched.add_request(Sequence(child_request_id("r", i), list(range(10)), child_params(params, i), 8))
        out = sched.schedule()
        assert [s.num_tokens for s in out.scheduled] == ([10, 2, 2] if caching else [10, 10, 10])
        assert sched.block_manager.num_blocks - sched.block_manager.num_free_blocks == (3 + 1 + 1 if caching else 9)
