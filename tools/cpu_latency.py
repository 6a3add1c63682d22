"""Batch-1 latency on CPU: decode tok/s, time to first token, and the prefill of a long prompt (issue 20).

    PYTHONPATH=. .venv/bin/python tools/cpu_latency.py [--dtype float32] [--kernels inductor] [--prefill-len 4096]

Bundled SmolLM2 (or --model), random prompt ids, greedy, ignore_eos; one warm-up of each measurement first
(compiles on the compiled path), then the best of --repeats. Prints one JSON line.
"""
import argparse
import json
import os
import random
import time

from graphinfer import LLM, SamplingParams


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kernels", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    llm = LLM(a.model, dtype=a.dtype, kernels=a.kernels, enable_prefix_caching=False,
              max_model_len=max(a.prefill_len + 16, a.prompt_len + a.max_tokens + 1))
    rng = random.Random(0)
    prompt = [rng.randrange(10000) for _ in range(a.prompt_len)]
    long_prompt = [rng.randrange(10000) for _ in range(a.prefill_len)]

    def gen(ids, n):
        return lambda: llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    ttft = best_of(gen(prompt, 1), a.repeats)
    total = best_of(gen(prompt, a.max_tokens), a.repeats)
    prefill = best_of(gen(long_prompt, 1), a.repeats)
    engine = llm.llm_engine
    print(json.dumps({
        "dtype": str(engine.config.model_config.torch_dtype), "kernels": a.kernels or "default",
        "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "ttft_s": round(ttft, 4),
        "decode_tok_s": round((a.max_tokens - 1) / (total - ttft), 2), "batch1_tok_s": round(a.max_tokens / total, 2),
        "prefill_len": a.prefill_len, "prefill_s": round(prefill, 3), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
