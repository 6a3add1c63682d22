"""Quantized SmolLM2 on CPU against llama.cpp, in one run (issue 27; `tools/cpu_bench.sh quant` runs it).

    PYTHONPATH=. .venv/bin/python tools/cpu_quant_peers.py [--llama-python .venv-peers/bin/python] \
        [--configs fp32,int8_wo,gguf] [--output-json out.json]

The peer workload (issue 30): 64 prompts of 64-256 random token ids (seed 0), 64 greedy new tokens each, EOS
ignored, prefix caching off; batch 1 = the first prompt. graphinfer runs each config (fp32: the GGUF
dequantized; int8_wo / int4_wo: quantized at load; gguf: the file's blocks kept) in this process; llama.cpp
(llama-cpp-python, the same GGUF as shipped) runs in the peer venv's python, one prompt at a time (its Python
API has no batched generation), 2 threads. Per engine: batch-1 TTFT and decode tok/s (TPOT), batch-64 output
tok/s, the bytes of the weights, and token agreement with graphinfer fp32 (the share of positions whose greedy
token is the same). Prints a table, writes JSON.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, n_new, prompts = sys.argv[1], int(sys.argv[2]), json.load(sys.stdin)
llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)
def gen(prompt):
    ids, t0, ttft = [], time.perf_counter(), None
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        ids.append(tok)
        if len(ids) == n_new:
            break
    return ids, ttft, time.perf_counter() - t0
gen(prompts[0])  # warm-up
ids, ttft, total = gen(prompts[0])
t = time.perf_counter()
outs = [gen(p)[0] for p in prompts]
batch_s = time.perf_counter() - t
print(json.dumps({"batch1_tokens": ids, "ttft_s": ttft, "batch1_s": total, "batch_s": batch_s, "outputs": outs}))
"""


def workload(n: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return same / sum(len(r) for r in ref)


def run_graphinfer(model: str, quantization: str | None, prompts, n_new: int) -> dict:
    from graphinfer import LLM, SamplingParams
    from graphinfer.bench.accuracy import weight_bytes

    llm = LLM(model, dtype="float32", quantization=quantization, enable_prefix_caching=False, max_model_len=512)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    req = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(req[:1], full, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(req[:1], one, use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    batch1 = llm.generate(req[:1], full, use_tqdm=False)[0].outputs[0].token_ids
    batch1_s = time.perf_counter() - t
    t = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(req, full, use_tqdm=False)]
    batch_s = time.perf_counter() - t
    result = {"batch1_tokens": list(batch1), "ttft_s": ttft, "batch1_s": batch1_s, "batch_s": batch_s,
              "outputs": [list(o) for o in outs], "weight_bytes": weight_bytes(llm)}
    llm.shutdown()
    return result


def run_llama(python: str, gguf: str, prompts, n_new: int) -> dict:
    res = subprocess.run([python, "-c", LLAMA_SCRIPT, gguf, str(n_new)], input=json.dumps(prompts),
                         capture_output=True, text=True, timeout=3600)
    if res.returncode:
        raise SystemExit(f"llama.cpp run failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["weight_bytes"] = os.path.getsize(gguf)
    return out


def summarise(name: str, r: dict, n_new: int, ref: dict | None) -> dict:
    tpot = (r["batch1_s"] - r["ttft_s"]) / (n_new - 1)
    row = {"engine": name, "batch64_tok_s": sum(map(len, r["outputs"])) / r["batch_s"], "batch1_tok_s": 1 / tpot,
           "tpot_ms": tpot * 1e3, "ttft_ms": r["ttft_s"] * 1e3, "weight_mb": r["weight_bytes"] / 1e6}
    if ref is not None:
        row["agreement_vs_fp32"] = agreement(ref["outputs"], r["outputs"])
    return row


def main() -> None:
    from graphinfer.bench.common import environment, markdown_table
    from graphinfer.config import bundled_model_path

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="", help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--configs", default="fp32,int8_wo,gguf", help="graphinfer configs: fp32 and quantization names")
    p.add_argument("--llama-python", default=None, help="a python with llama-cpp-python (tools/cpu_bench.sh quant "
                                                        "makes .venv-peers); none: graphinfer only")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--output-json", default=None)
    a = p.parse_args()
    gguf = a.model or bundled_model_path()
    prompts = workload(a.num_prompts)
    raw, rows = {}, []
    for cfg in a.configs.split(","):
        raw[cfg] = run_graphinfer(gguf, None if cfg == "fp32" else cfg, prompts, a.new_tokens)
        print(f"graphinfer {cfg}: done", file=sys.stderr)
    if a.llama_python:
        raw["llama.cpp"] = run_llama(a.llama_python, gguf, prompts, a.new_tokens)
    ref = raw.get("fp32")
    for name, r in raw.items():
        rows.append(summarise(name if name == "llama.cpp" else f"graphinfer {name}", r, a.new_tokens, ref))
    print(markdown_table(["engine", "weights MB", "batch-64 out tok/s", "batch-1 decode tok/s (TPOT ms)",
                          "TTFT ms", "tokens = graphinfer fp32"],
                         [[r["engine"], f"{r['weight_mb']:.0f}", f"{r['batch64_tok_s']:.1f}",
                           f"{r['batch1_tok_s']:.1f} ({r['tpot_ms']:.1f})", f"{r['ttft_ms']:.0f}",
                           f"{r.get('agreement_vs_fp32', 1.0):.1%}"] for r in rows]))
    result = {"model": gguf, "workload": {"num_prompts": a.num_prompts, "new_tokens": a.new_tokens, "seed": 0,
                                          "prompt_tokens": sum(map(len, prompts))},
              "environment": {**environment("cpu"), "loadavg": open("/proc/loadavg").read().split()[:3]},
              "rows": rows, "raw": raw}
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
