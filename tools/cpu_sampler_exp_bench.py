"""Exp(1) draws for the sampler's exponential race on CPU: ATen's exponential_ against uniform_ + log (what
runtime/worker/sampler.py's _exponential_ does on CPU), for B rows of a V-token vocabulary, 2 threads.

    PYTHONPATH=. .venv/bin/python tools/cpu_sampler_exp_bench.py [--rows 64] [--vocab 49152] [--output-json F]
"""
import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--output-json", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.empty(a.rows, a.vocab)
    ways = {"exponential_": lambda: q.exponential_(generator=g),
            "uniform_ + log": lambda: q.uniform_(generator=g).log_().neg_()}
    ms = {name: [] for name in ways}
    for _ in range(3):  # alternating rounds
        for name, f in ways.items():
            f()
            t = time.perf_counter()
            for _ in range(a.calls):
                f()
            ms[name].append((time.perf_counter() - t) / a.calls * 1e3)
    res = {name: round(statistics.median(v), 2) for name, v in ms.items()}
    print(res)
    if a.output_json:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   platform.processor())
        with open(a.output_json, "w") as f:
            json.dump({"rows": a.rows, "vocab": a.vocab, "threads": a.threads, "cpu": cpu, "torch": torch.__version__,
                       "ms_median_of_3_rounds": res, "ms_rounds": ms}, f, indent=1)


if __name__ == "__main__":
    main()
