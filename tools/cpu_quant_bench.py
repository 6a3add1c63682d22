"""CPU weight-only quantized linears: graphinfer's wo_linear kernel (csrc/cpu/quant_linear.cpp) against torch's own
quantized CPU kernels and the float F.linear, at SmolLM2-135M's shapes.

    PYTHONPATH=. .venv/bin/python tools/cpu_quant_bench.py [--threads 2] [--m 1,8,64,256] [--output-json out.json]

Rows (per weight shape [N, K] and token count M):
- ours q4: wo_linear bits 4, group 32, scales + zeros (GGUF Q4_1's form; the transformer layers of the goal model);
- ours q8: wo_linear bits 8, group 32, scales only (GGUF Q8_0's form; its LM head / embeddings);
- ours q4 / q8 a8: the same forms with fp16 scales (the file's width) on wo_linear_a8 (csrc/cpu/quant_linear_a8.cpp:
  activations rounded to int8 per block of 32, integer dot products, llama.cpp's arithmetic; the decode default on
  CPUs whose best int8 path is AVX2, else GRAPHINFER_CPU_WO_ACTIVATIONS=int8; from 64 tokens on, with AVX-512 VNNI, its GEMM);
- torch int4: aten._weight_int4pack_mm_for_cpu (group 32, bf16-free fp32 scales and zeros);
- torch int8: aten._weight_int8pack_mm (per-channel scales: the only form it takes);
- ours q4 / q8 bf16 gemm: wo_linear's bf16_gemm (gemm_bf16 where the CPU has avx512_bf16; from 64 tokens on), bf16 x;
- fp32 / bf16: F.linear on the float weight; bf16 / fp32 prepacked: oneDNN's linear on the weight prepacked as the
  cpu platform prepacks dense linears (compiler/cpu_packed_linear.py), x in the weight's dtype.
Weights are cold as in a decode step, where each layer's weights are evicted before their next use: every
measurement cycles through enough copies of its weights to exceed --working-set-mb (default 128 MB, 4x the L3
of the 2-core dev machine), so GB/s (weight bytes read per second, scales and zeros included) is memory bandwidth,
not cache bandwidth. Each cell: the best of its batch medians over --repeats passes over the whole table (a batch:
the calls within --min-time seconds, at least --min-calls): the dev machine is shared, and a burst of someone
else's work spoils a pass's cells, rarely the same cell in every pass. Freed memory stays in the process as the cpu
platform keeps it (GRAPHINFER_CPU_RETAIN_FREED_MEMORY, recorded in the JSON): with glibc's defaults a large output
(the LM head's 50 MB at 256 tokens) is page-faulted in again every call.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from graphinfer import envs
from graphinfer.ops.cpu import ext
from graphinfer.ops.quant import pack_int4
from graphinfer.platforms.cpu import retain_freed_memory

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # [N, K]: q/o, k/v, gate/up, down, LM head
GROUP = 32
IMPLS = ("ours_q4", "ours_q4_a8", "ours_q8", "ours_q8_a8", "torch_int4", "torch_int8", "fp32", "bf16")
EXTRA_IMPLS = ("ours_q4_bf16gemm", "ours_q8_bf16gemm", "bf16_prepacked", "fp32_prepacked")  # GEMM-only rows: --impls names them


def make_weights(impl: str, n: int, k: int) -> tuple[tuple, int]:
    """One copy of impl's weight tensors for an [n, k] linear, and their bytes."""
    g = k // GROUP
    if impl == "ours_q4":
        t = (pack_int4(torch.randint(0, 16, (n, k))), torch.rand(n, g) * 0.01, -torch.rand(n, g) * 0.05)
    elif impl in ("ours_q4_a8", "ours_q4_bf16gemm"):  # GGUF's fp16 scales
        t = (pack_int4(torch.randint(0, 16, (n, k))), (torch.rand(n, g) * 0.01).half(), (-torch.rand(n, g) * 0.05).half())
    elif impl == "ours_q8":
        t = (torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, g) * 0.01)
    elif impl in ("ours_q8_a8", "ours_q8_bf16gemm"):
        t = (torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, g) * 0.01).half())
    elif impl == "torch_int4":
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        t = (packed, torch.rand(g, n, 2) * 0.01)
    elif impl == "torch_int8":
        t = (torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01)
    elif impl in ("bf16_prepacked", "fp32_prepacked"):
        dtype = torch.bfloat16 if impl == "bf16_prepacked" else torch.float32
        t = (torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dtype) * 0.05, 64),)
        return t, n * k * t[0].element_size()
    else:
        t = (torch.randn(n, k, dtype=torch.float32 if impl == "fp32" else torch.bfloat16) * 0.05,)
    return t, sum(x.numel() * x.element_size() for x in t)


def call(impl: str, x: torch.Tensor, w: tuple) -> torch.Tensor:
    if impl == "ours_q4":
        return torch.ops.graphinfer_cpu_quant.wo_linear.default(x, w[0], w[1], w[2], 4, None)
    if impl == "ours_q4_bf16gemm":
        return torch.ops.graphinfer_cpu_quant.wo_linear.default(x.bfloat16(), w[0], w[1], w[2], 4, None, True)
    if impl == "ours_q8_bf16gemm":
        return torch.ops.graphinfer_cpu_quant.wo_linear.default(x.bfloat16(), w[0], w[1], None, 8, None, True)
    if impl.endswith("_prepacked"):
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16() if impl == "bf16_prepacked" else x, w[0], None, "none",
                                                  [], "")
    if impl == "ours_q8":
        return torch.ops.graphinfer_cpu_quant.wo_linear.default(x, w[0], w[1], None, 8, None)
    if impl in ("ours_q4_a8", "ours_q8_a8"):  # int8 activations: the decode kernel, from 64 tokens on gemm_vnni
        return torch.ops.graphinfer_cpu_quant.wo_linear_a8.default(x, w[0], w[1], w[2] if len(w) > 2 else None, None)
    if impl == "torch_int4":
        return torch._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1])
    if impl == "torch_int8":
        return torch._weight_int8pack_mm(x, w[0], w[1])
    return F.linear(x.to(w[0].dtype), w[0])


def prepare(impl: str, n: int, k: int, working_set_mb: int) -> dict:
    w0, nbytes = make_weights(impl, n, k)
    copies = max(1, min(64, -(-working_set_mb * 2 ** 20 // nbytes)))
    return {"impl": impl, "bytes": nbytes, "weights": [w0] + [tuple(t.clone() for t in w0) for _ in range(copies - 1)]}


def batch_median(cell: dict, x: torch.Tensor, min_time: float, min_calls: int) -> float:
    """Median seconds of one call over a batch of calls (at least min_calls and min_time seconds, but a call slower
    than min_time / min_calls counts alone past 10 min_time: torch's int4 kernel takes seconds at M = 256),
    cycling through the cold weight copies."""
    weights, times, start = cell["weights"], [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_time:
        if times and time.perf_counter() - start > 10 * min_time:
            break
        w = weights[cell.setdefault("next", 0) % len(weights)]
        cell["next"] += 1
        t = time.perf_counter()
        call(cell["impl"], x, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_pass(impls: list[str], shapes: list[tuple[int, int]], ms: list[int], a, best: dict) -> None:
    """One pass over the table: per shape, every impl's cold weights, then every (M, impl) batch; best keeps each
    cell's fastest batch median over the passes."""
    for n, k in shapes:
        cells = [prepare(impl, n, k, a.working_set_mb) for impl in impls]
        for m in ms:
            x = torch.randn(m, k)
            for c in cells:
                call(c["impl"], x, c["weights"][0])  # warm-up (first-call allocations, thread pool)
                t = batch_median(c, x, a.min_time, a.min_calls)
                key = (n, k, m, c["impl"])
                if key not in best or t < best[key]["s"]:
                    best[key] = {"s": t, "bytes": c["bytes"], "copies": len(c["weights"])}
        del cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--m", default="1,8,64,256", help="token counts, comma-separated")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK, comma-separated")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--working-set-mb", type=int, default=128)
    p.add_argument("--min-time", type=float, default=0.1, help="seconds per batch")
    p.add_argument("--min-calls", type=int, default=5, help="calls per batch at least")
    p.add_argument("--repeats", type=int, default=3,
                   help="passes over the whole table: each cell reports its best batch median")
    p.add_argument("--output-json", default="")
    a = p.parse_args()
    if not ext.available() or not hasattr(torch.ops.graphinfer_cpu_quant, "wo_linear"):
        raise SystemExit("the cpu C++ kernels are not built: python -m graphinfer.ops.cpu.ext")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    retained = envs.GRAPHINFER_CPU_RETAIN_FREED_MEMORY != "0" and retain_freed_memory()
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.m.split(",")]
    impls = a.impls.split(",")
    best: dict = {}
    for i in range(a.repeats):
        t = time.perf_counter()
        run_pass(impls, shapes, ms, a, best)
        print(f"pass {i + 1}/{a.repeats}: {time.perf_counter() - t:.0f} s, load average {os.getloadavg()[0]:.2f}",
              flush=True)
    rows = [{"n": n, "k": k, "m": m, "impl": impl, "us": round(v["s"] * 1e6, 1), "weight_bytes": v["bytes"],
             "gb_per_s": round(v["bytes"] / v["s"] / 1e9, 2), "copies": v["copies"]}
            for (n, k, m, impl), v in best.items()]
    by_key = {(r["n"], r["k"], r["m"], r["impl"]): r for r in rows}
    print(f"{'N x K':>12} {'M':>4} " + " ".join(f"{i:>18}" for i in impls) + "   (us (weight GB/s))")
    for n, k in shapes:
        for m in ms:
            cells = [by_key[(n, k, m, impl)] for impl in impls]
            print(f"{f'{n}x{k}':>12} {m:>4} " + " ".join(f"{c['us']:>10.1f} ({c['gb_per_s']:>5.1f})" for c in cells))
    meta = {"cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": a.threads, "torch": torch.__version__, "group": GROUP, "working_set_mb": a.working_set_mb,
            "repeats": a.repeats, "min_time": a.min_time, "min_calls": a.min_calls, "retain_freed_memory": retained}
    try:
        with open("/proc/cpuinfo") as f:
            meta["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.output_json}")


if __name__ == "__main__":
    main()
