"""What max_num_batched_tokens costs a running stream while a long prompt is prefilled, and what it saves that prompt.

    python tools/serve_fairness.py [--model ""] [--budgets 32,64,128,256,512,1024] [--context 1024] [--threads 1]
    python tools/serve_fairness.py --scenario --prompt-len 2000 [--budgets ...]

The scheduler gives every running stream one token per engine step and fills the rest of the step's budget with
prompt chunks, so while a long prompt is prefilled a stream's inter-token gap is the duration of one step of
(1 decode + budget - 1 prompt tokens). Default mode: that step's duration per budget, for a chunk at --context
tokens into the prompt, next to a decode-only step; from it, the prefill throughput and a --prompt-len prompt's
time to first token. Each figure is the minimum of --repeats runs: on a machine shared with other jobs a run is
only ever slowed down, so the minimum estimates the engine's own cost. --threads sets torch's intra-op threads
(on a 2-core machine that other jobs share, two OpenMP threads contend badly: one thread measures the compute).

--scenario: the real thing, once per budget: a stream decodes, a --prompt-len prompt arrives, steps run until it
has its first token; the stream's largest and median gap and the prompt's time to first token.
The engine alone (SmolLM2 fp32 by default); `graphinfer serve` adds the HTTP side.
"""
import argparse
import json
import random
import statistics
import time

from graphinfer import LLM, SamplingParams


def _stream(engine, rng) -> str:
    rid = engine.add_request(None, [rng.randrange(engine.hf_config.vocab_size) for _ in range(16)],
                             SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    for _ in range(3):  # its prefill and first decodes
        engine.step()
    return rid


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def step_costs(llm: LLM, budgets: list[int], context: int, repeats: int, prompt_len: int) -> list[dict]:
    engine = llm.llm_engine
    config = engine.local_core.scheduler.config  # the scheduler reads its budget every step
    rng = random.Random(0)
    vocab = engine.hf_config.vocab_size
    stream = _stream(engine, rng)
    decode = min(_timed_step(engine) for _ in range(5))
    rows = []
    for budget in budgets:
        times = []
        for _ in range(repeats):
            long = engine.add_request(None, [rng.randrange(vocab) for _ in range(context + budget)],
                                      SamplingParams(max_tokens=1))
            config.max_num_batched_tokens = context + 1
            engine.step()  # untimed: the decode and the prompt's first `context` tokens
            config.max_num_batched_tokens = budget
            times.append(_timed_step(engine))  # the decode + a (budget - 1)-token chunk at `context`
            engine.abort_request(long)
        step = min(times)
        rows.append({"budget": budget, "context": context, "decode_step_ms": 1000 * decode, "step_ms": 1000 * step,
                     "step_over_decode": step / decode, "prefill_tok_s": (budget - 1) / step,
                     "est_ttft_s": prompt_len / (budget - 1) * step, "all_step_ms": [1000 * t for t in times]})
        print(f"  {rows[-1]}", flush=True)
    engine.abort_request(stream)
    return rows


def scenario(llm: LLM, budgets: list[int], prompt_len: int) -> list[dict]:
    engine = llm.llm_engine
    config = engine.local_core.scheduler.config
    rng = random.Random(0)
    rows = []
    for budget in budgets:
        config.max_num_batched_tokens = budget
        stream = _stream(engine, rng)
        decode = statistics.median(_timed_step(engine) for _ in range(5))
        long = engine.add_request(None, [rng.randrange(engine.hf_config.vocab_size) for _ in range(prompt_len)],
                                  SamplingParams(max_tokens=1))
        t_arrive, steps = time.perf_counter(), []
        while True:
            t0 = time.perf_counter()
            got = {o.request_id for o in engine.step()}
            steps.append(time.perf_counter() - t0)
            assert stream in got, "the stream missed a step"
            if long in got:
                break
        rows.append({"budget": budget, "prompt_len": prompt_len, "decode_step_ms": 1000 * decode,
                     "prefill_steps": len(steps), "max_gap_ms": 1000 * max(steps),
                     "median_gap_ms": 1000 * statistics.median(steps), "ttft_s": time.perf_counter() - t_arrive})
        print(f"  {rows[-1]}", flush=True)
        engine.abort_request(stream)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budgets", default="32,64,128,256,512,1024")
    ap.add_argument("--context", type=int, default=1024, help="where in the prompt the timed chunk starts")
    ap.add_argument("--prompt-len", type=int, default=4000, help="the long prompt (estimated TTFT; --scenario)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--scenario", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    longest = max(args.prompt_len if args.scenario else args.context + max(budgets), 64)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=longest + 64, max_num_batched_tokens=longest + 64,
              enable_prefix_caching=False)
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    if args.scenario:
        rows = scenario(llm, budgets, args.prompt_len)
        print("\n| max_num_batched_tokens | decode step ms | prefill steps | stream's largest gap ms | median gap ms "
              "| long prompt TTFT s |\n|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['budget']} | {r['decode_step_ms']:.0f} | {r['prefill_steps']} | {r['max_gap_ms']:.0f} | "
                  f"{r['median_gap_ms']:.0f} | {r['ttft_s']:.1f} |")
    else:
        rows = step_costs(llm, budgets, args.context, args.repeats, args.prompt_len)
        print(f"\n| max_num_batched_tokens | step ms (= stream's gap) | x decode step ({rows[0]['decode_step_ms']:.0f} ms)"
              f" | prefill tok/s | est. TTFT of {args.prompt_len} tokens, s |\n|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['budget']} | {r['step_ms']:.0f} | {r['step_over_decode']:.1f} | {r['prefill_tok_s']:.0f} | "
                  f"{r['est_ttft_s']:.1f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
