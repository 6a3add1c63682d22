"""Fair scheduling for serving: a long prompt that arrives while a stream runs is prefilled in chunks of at most
max_num_batched_tokens per engine step, and the stream gets a token in every one of those steps.

The bound is stated in engine steps and tokens per step, not in seconds: the running stream's largest gap is
one step, and no step carries more than the budget, so its gap in time is one step of at most `budget` tokens,
whatever the machine's speed or load (a wall-clock threshold on a shared 2-core machine would be flaky). The
end-to-end check through HTTP, with a generous ratio measured in the same run, is in test_server.py
(test_long_prompt_mid_stream_keeps_the_stream_flowing).
"""
import asyncio
import math

import pytest

from graphinfer import LLM, SamplingParams
from graphinfer.cli import build_parser
from graphinfer.runtime.entrypoints.async_llm import AsyncLLMEngine
from graphinfer.server.defaults import SERVE_BATCHED_TOKENS, resolve_serve_engine_args, serve_batched_tokens

BUDGET, LONG = 64, 900


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_long_prompt_mid_stream_costs_the_stream_one_step_per_chunk(async_scheduling):
    llm = LLM("tiny-llama", max_model_len=1024, max_num_batched_tokens=BUDGET, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    steps = []  # per engine step: {request id: tokens scheduled}
    schedule = engine.local_core.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append({s.seq.request_id: s.num_tokens for s in out.scheduled})
        return out

    engine.local_core.scheduler.schedule = recorded
    aengine = AsyncLLMEngine(engine)
    greedy = dict(temperature=0, ignore_eos=True)

    async def main():
        (stream,) = aengine.add_requests([[1, 2, 3, 4]], SamplingParams(max_tokens=300, **greedy), ["stream"])
        n = 0
        async for out in stream:
            n = len(out.outputs[0].token_ids)
            if n >= 5:
                break
        (long,) = aengine.add_requests([[(7 * i) % 500 + 1 for i in range(LONG)]],
                                       SamplingParams(max_tokens=1, **greedy), ["long"])
        at_arrival, at_long_first = n, None

        async def read_long():
            async for _ in long:
                pass
            return n  # the stream's token count when the long prompt got its token

        reader = asyncio.create_task(read_long())
        async for out in stream:
            n = len(out.outputs[0].token_ids)
            if reader.done() and at_long_first is None:
                at_long_first = reader.result()
        if at_long_first is None:
            at_long_first = await reader
        return at_arrival, at_long_first, n

    try:
        at_arrival, at_long_first, total = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert total == 300
    prefill = [s for s in steps if "long" in s]
    assert sum(s["long"] for s in prefill) == LONG  # then the long prompt's one token was sampled
    assert len(prefill) >= math.ceil(LONG / BUDGET)
    for s in steps:  # every step within the budget: a step's duration is that of <= BUDGET tokens
        assert sum(s.values()) <= BUDGET, s
    for s in prefill:  # ... and the running stream had its decode in every step of the long prompt's prefill
        assert s.get("stream") == 1, s
    # and those tokens reached the stream's consumer as they came: it kept receiving while the prompt was prefilled
    assert at_long_first - at_arrival >= len(prefill) - 2, (at_arrival, at_long_first, len(prefill))
    assert aengine.kv_blocks_in_use == 0


def test_serve_budget_default_is_per_platform_and_shown_in_help():
    assert serve_batched_tokens("cpu") == SERVE_BATCHED_TOKENS["cpu"] < 8192
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"{SERVE_BATCHED_TOKENS['cpu']} on cpu" in " ".join(help_text.split())
    generate = build_parser().parse_args(["generate", "--prompt", "x"])
    serve = build_parser().parse_args(["serve"])
    assert generate.max_num_batched_tokens == 8192 and serve.max_num_batched_tokens is None  # resolved at start
    cpu = SERVE_BATCHED_TOKENS["cpu"]
    assert resolve_serve_engine_args({"device": "cpu", "max_num_batched_tokens": None, "max_num_seqs": 256}) == \
        {"device": "cpu", "max_num_batched_tokens": cpu, "max_num_seqs": min(256, cpu)}  # no request starves
    assert resolve_serve_engine_args({"device": "cpu", "max_num_batched_tokens": 4096, "max_num_seqs": 256}) == \
        {"device": "cpu", "max_num_batched_tokens": 4096, "max_num_seqs": 256}
