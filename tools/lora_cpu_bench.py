"""CPU LoRA ops: the references (graphinfer/ops/lora.py) against the cpu platform's forms (graphinfer/ops/cpu/lora.py).

    PYTHONPATH=. .venv/bin/python tools/lora_cpu_bench.py [--threads 2] [--tokens 1,16,256,2048] [--repeats 3]
                                                          [--stat median|min]

Shapes: a fused qkv of SmolLM2-135M (in 576; slices q 576, k 192, v 192, so out 960), n 3 slices, R 16, S 4 slots,
indices drawn uniformly from [-1, S). Columns, in microseconds per call: shrink (reference, gather, all slots,
what the cpu op runs) then expand (reference, gather, one-hot, what the cpu op runs). Each cell: the best of
--repeats medians of a batch of calls (at least --min-time seconds): the dev machine is shared. Where another
process holds a core, 2 OpenMP threads wait on each other for whole scheduler slices (cells of ~8 ms multiples):
--stat min then reports the fastest single call instead (what the ops cost on free cores). Freed memory is
kept in the process as the cpu platform keeps it (platforms/cpu.retain_freed_memory), else every large temporary
is page-faulted in again and the table measures the kernel, not the ops.
"""
import argparse
import statistics
import subprocess
import time

import torch

import graphinfer.ops  # noqa: F401  (registers the reference ops)
from graphinfer.ops.cpu import lora as cpu_lora
from graphinfer.platforms.cpu import retain_freed_memory

IN, SLICES, RANK, SLOTS = 576, (576, 192, 192), 16, 4


def _time(fn, args, min_time: float, repeats: int, stat: str = "median") -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < min_time or len(times) < 5:
            t = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t)
        best = min(best, statistics.median(times) if stat == "median" else min(times))
    return best * 1e6


def _cpu_info() -> str:
    name = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    flags = subprocess.run(["grep", "-m1", "^flags", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    avx = sorted({f for f in flags.split() if f.startswith("avx")})
    return f"{name.strip()}\nAVX flags: {' '.join(avx)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", default="1,16,256,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--stat", choices=("median", "min"), default="median")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    retained = retain_freed_memory()
    print(_cpu_info())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, freed memory retained: {retained}")
    what = "medians" if args.stat == "median" else "passes' fastest calls"
    print(f"in {IN}, slices {SLICES}, R {RANK}, S {SLOTS}; us per call (best of {args.repeats} {what})\n")
    ref_shrink = torch.ops.graphinfer.lora_shrink.default.reference
    ref_expand = torch.ops.graphinfer.lora_expand.default.reference
    shrinks = [("ref", ref_shrink), ("gather", cpu_lora.shrink_gather), ("all slots", cpu_lora.shrink_all_slots),
               ("cpu op", cpu_lora.lora_shrink_cpu)]
    expands = [("ref", ref_expand), ("gather", cpu_lora.expand_gather), ("one-hot", cpu_lora.expand_one_hot),
               ("cpu op", cpu_lora.lora_expand_cpu)]
    head = ["T", "dtype"] + [f"shrink {n}" for n, _ in shrinks] + [f"expand {n}" for n, _ in expands]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for dtype in (torch.bfloat16, torch.float32):
        for T in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator().manual_seed(T)
            x = torch.randn(T, IN, generator=g).to(dtype)
            a = (torch.randn(SLOTS, len(SLICES), RANK, IN, generator=g) * 0.05).to(dtype)
            b = (torch.randn(SLOTS, sum(SLICES), RANK, generator=g) * 0.05).to(dtype)
            y = torch.randn(T, sum(SLICES), generator=g).to(dtype)
            idx = torch.randint(-1, SLOTS, (max(T, 256),), generator=g)
            buf = ref_shrink(x, a, idx)
            row = [str(T), str(dtype).removeprefix("torch.")]
            row += [f"{_time(fn, (x, a, idx), args.min_time, args.repeats, args.stat):.0f}" for _, fn in shrinks]
            row += [f"{_time(fn, (y, buf, b, idx, list(SLICES)), args.min_time, args.repeats, args.stat):.0f}"
                    for _, fn in expands]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
