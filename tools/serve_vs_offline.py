"""Served against offline latency, in one run: the offline API's batch-1 TTFT / TPOT, then `graphinfer serve` of the
same model and settings under `graphinfer bench serve` (1 client, then 16), on the same random-token prompts.

    python tools/serve_vs_offline.py --dtype auto --output-json out.json [--label HEAD]

What the server adds over the engine shows as served TPOT / offline TPOT at one client (HTTP, detokenization, the
stream's events and, when they share an interpreter, the engine loop's waits for the GIL). Run it under another
checkout (PYTHONPATH=that tree) to compare two commits on one machine, interleaved.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import httpx


def offline(dtype: str, max_model_len: int, prompt_len: int, max_tokens: int, repeats: int, seed: int) -> dict:
    """Batch-1 TTFT and TPOT through LLMEngine.add_request / step (what LLM.generate drives), per repeat."""
    from graphinfer import LLM, SamplingParams
    from graphinfer.bench.serve import TOKEN_IDS

    llm = LLM(dtype=dtype, max_model_len=max_model_len)
    engine, rng = llm.llm_engine, random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for i in range(repeats + 1):  # the first is a warm-up
        engine.add_request(f"r{i}", [rng.randrange(*TOKEN_IDS) for _ in range(prompt_len)], params)
        start, first, n = time.perf_counter(), None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                first = first or time.perf_counter()
        end = time.perf_counter()
        if i:
            runs.append({"ttft_ms": (first - start) * 1e3, "tpot_ms": (end - first) / (n - 1) * 1e3, "tokens": n})
    llm.shutdown()
    return {"runs": runs, "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in runs),
            "tpot_p50_ms": statistics.median(r["tpot_ms"] for r in runs)}


def served(dtype: str, max_model_len: int, prompt_len: int, max_tokens: int, num_prompts: int, concurrency: list[int],
           port: int, seed: int, log_path: str) -> dict:
    from graphinfer.bench.serve import run

    cmd = [sys.executable, "-m", "graphinfer.cli", "serve", "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: see {log_path}")
                time.sleep(0.5)
            result = run(f"http://127.0.0.1:{port}", concurrency, num_prompts, prompt_len, max_tokens, None, None, None,
                         seed)
        finally:
            proc.terminate()
            proc.wait(60)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="offline batch-1 requests (after a warm-up)")
    p.add_argument("--num-prompts", type=int, default=16, help="served requests per concurrency level")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--output-json", required=True)
    a = p.parse_args()
    import graphinfer

    off = offline(a.dtype, a.max_model_len, a.prompt_len, a.max_tokens, a.repeats, a.seed)
    print(f"offline batch 1: TTFT {off['ttft_p50_ms']:.1f} ms, TPOT {off['tpot_p50_ms']:.2f} ms", flush=True)
    srv = served(a.dtype, a.max_model_len, a.prompt_len, a.max_tokens, a.num_prompts,
                 [int(c) for c in a.concurrency.split(",")], a.port, a.seed, a.output_json + ".serve.log")
    one = next(lv for lv in srv["levels"] if lv["concurrency"] == 1)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    commit = subprocess.run(["git", "-C", os.path.dirname(os.path.dirname(graphinfer.__file__)), "rev-parse",
                             "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "serve_vs_offline", "label": a.label, "commit": commit, "graphinfer": graphinfer.__file__,
              "date": datetime.now(timezone.utc).isoformat(), "cpu": cpu,
              "isa": [f for f in flags if f.startswith(("avx512", "amx")) or f == "avx2"],
              "load_average": os.getloadavg(), "args": vars(a), "offline": off, "served": srv,
              "served_over_offline_tpot": one["tpot_p50_ms"] / off["tpot_p50_ms"]}
    with open(a.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"served / offline TPOT at one client: {result['served_over_offline_tpot']:.3f}")


if __name__ == "__main__":
    main()
