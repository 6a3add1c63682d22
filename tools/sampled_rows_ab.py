"""The sampled-rows forward (compiler/sampled_rows.py) on and off in one engine, interleaved: time to first token of
the CPU peers' batch-1 prompt (162 tokens) and the prefill of their 64 prompts (64-256 tokens, one token each).

    PYTHONPATH=. .venv/bin/python tools/sampled_rows_ab.py [--dtype float32] [--rounds 10] [--output-json F]

Bundled SmolLM2 (or --model), the workload of tools/cpu_peers.py. Each round times both ways in turn (the order
alternating), so the two see the same machine; reports the best and the median of each and the tokens of both
(which must agree). Writes JSON.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from cpu_peers import workload

from graphinfer import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--output-json", default="")
    a = p.parse_args()
    prompts = workload(64)
    llm = LLM(a.model, dtype=a.dtype, enable_prefix_caching=False, max_model_len=1024)
    runner = llm.llm_engine.worker.model_runner
    rows_graph = runner.graph_rows
    if rows_graph is None:
        raise SystemExit("this engine has no sampled-rows forward (the start-up log says why)")
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def run(batch: list[list[int]], rows_only: bool) -> tuple[float, list[int]]:
        runner.graph_rows = rows_graph if rows_only else None
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids} for ids in batch], one, use_tqdm=False)
        return time.perf_counter() - t, [o.outputs[0].token_ids[0] for o in out]

    cases = {"ttft": prompts[:1], "prefill_64": prompts}
    times = {case: {"sampled_rows": [], "whole": []} for case in cases}
    tokens = {case: {} for case in cases}
    for case, batch in cases.items():  # warm-up
        run(batch, True), run(batch, False)
    for r in range(a.rounds):
        for case, batch in cases.items():
            for rows_only in ((True, False) if r % 2 == 0 else (False, True)):
                key = "sampled_rows" if rows_only else "whole"
                dt, tokens[case][key] = run(batch, rows_only)
                times[case][key].append(round(dt, 4))
    result = {
        "command": "tools/sampled_rows_ab.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                      if v not in ("", None)),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                    platform.processor()),
        "load_average_at_start": os.getloadavg(), "dtype": a.dtype,
        "cases": {case: {"prompt_tokens": sum(map(len, batch)), "rows": len(batch),
                         "tokens_agree": tokens[case]["sampled_rows"] == tokens[case]["whole"],
                         **{k: {"best_s": min(v), "median_s": statistics.median(v), "runs_s": v}
                            for k, v in times[case].items()}}
                  for case, batch in cases.items()},
    }
    for c in result["cases"].values():
        c["best_ratio"] = round(c["sampled_rows"]["best_s"] / c["whole"]["best_s"], 4)
        c["median_ratio"] = round(c["sampled_rows"]["median_s"] / c["whole"]["median_s"], 4)
    text = json.dumps(result, indent=1)
    print(text)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
