"""First vs later identical offline batches right after LLM() returns (issue 55, item 3: no cold first run).

PYTHONPATH=. .venv/bin/python tools/cpu_first_run.py [--prompts 16] [--tokens 32] [--runs 3] [--dtype float32] \
    [--output-json first_run.json]
Prints the LLM() time and each batch's wall time and output tok/s (and writes them, with the machine, to --output-json);
the first should match the rest. Each run's prompts
have the same lengths but new token ids (--same: identical prompts), and prefix caching is off unless --prefix-caching:
an identical second batch would otherwise skip its prefill (a cached prefix), which is not a warm-up effect."""
import argparse
import json
import random
import time

from graphinfer import LLM, SamplingParams
from graphinfer.bench.common import environment, git_commit, machine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None)
    ap.add_argument("--same", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    t = time.perf_counter()
    llm = LLM(a.model, dtype=a.dtype, enable_prefix_caching=a.prefix_caching)
    startup_s = time.perf_counter() - t
    print(f"LLM(): {startup_s:.2f} s")
    lens = [random.Random(0).randrange(64, 257) for _ in range(a.prompts)]

    def prompts(seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]} for n in lens]
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    times = []
    for i in range(a.runs):
        t = time.perf_counter()
        llm.generate(prompts(0 if a.same else i + 1), sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
        print(f"run {i + 1}: {times[-1]:.3f} s, {a.prompts * a.tokens / times[-1]:.1f} out tok/s")
    ratio = times[0] / min(times[1:]) if len(times) > 1 else None
    print(f"first / best later: {ratio:.2f}x" if ratio else "")
    if a.output_json:
        with open(a.output_json, "w") as f:
            env = {**environment("cpu"), **machine(), **git_commit()}
            json.dump({"command": vars(a), "environment": env, "llm_init_s": startup_s, "run_s": times,
                       "out_tok_s": [a.prompts * a.tokens / s for s in times], "first_over_best_later": ratio}, f,
                      indent=1)


if __name__ == "__main__":
    main()
