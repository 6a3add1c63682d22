"""The batch-1 linears of a decode step on CPU: graphinfer's few-row kernel (csrc/cpu/gemv.cpp) against oneDNN's
prepacked matmul (what more rows run on), MKL's F.linear, and a plain read of the same bytes (the ceiling).

    PYTHONPATH=. .venv/bin/python tools/cpu_gemv_bench.py --output-json gemv.json [--rows 1,4] [--layers 30]

SmolLM2-135M's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; the LM head 49152x576 once): per
shape, --layers distinct random weights called one after the other as a decode step does, so each weight comes
from memory, not cache. Each method's best of --repeats passes (methods interleaved per pass) gives us a call and
GB/s of weight read; "step_ms" sums a whole step (30 layers + head). bf16 rows read a bf16 copy of the weights.
"call_us": the fixed cost of a call, timed on a 64x64 weight at one row (timeit's best of 3), and of a graphinfer op
whose cpu kernel is a Python function (add_rms_norm, one row of 576) called through the op, as the bound function
(compiler/bind_ops.py) and as its C++ kernel alone. SMOKE=1: 3 layers, 2 passes.
"""
import argparse
import json
import os
import time
import timeit

import torch
import torch.nn.functional as F

from graphinfer.ops.cpu import gemv as cpu_gemv
from graphinfer.ops.cpu.elementwise import add_rms_norm_cpu
from graphinfer.ops.norm import add_rms_norm
from graphinfer.platforms import get_platform

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-json", required=True)
    p.add_argument("--rows", default="1,4")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    if os.environ.get("SMOKE") == "1":
        a.layers, a.repeats = 3, 2
    if not cpu_gemv.available():
        raise SystemExit("the cpu C++ kernels are not built: python -m graphinfer.ops.cpu.ext")
    torch.manual_seed(0)
    results = []
    for rows in map(int, a.rows.split(",")):
        step = {}
        for name, (n, k) in SHAPES.items():
            count = 1 if name == "lm_head" else a.layers
            ws = [torch.randn(n, k) for _ in range(count)]
            methods = {
                "graphinfer_gemv": (ws, lambda w, x: cpu_gemv.gemv(x, w, None)),
                "graphinfer_gemv_bf16_weight": ([w.bfloat16() for w in ws], lambda w, x: cpu_gemv.gemv(x, w, None)),
                "onednn_prepacked": ([torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws],
                                     lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
                "mkl_f_linear": (ws, lambda w, x: F.linear(x, w)),
                "read_only_sum": (ws, lambda w, x: w.sum()),
            }
            x = torch.randn(rows, k)
            best = dict.fromkeys(methods, float("inf"))
            for _ in range(a.repeats):
                for m, (weights, fn) in methods.items():
                    t = time.perf_counter()
                    for w in weights:
                        fn(w, x)
                    best[m] = min(best[m], (time.perf_counter() - t) / count)
            for m, s in best.items():
                nbytes = n * k * (2 if m.endswith("bf16_weight") else 4)
                results.append({"rows": rows, "shape": name, "n": n, "k": k, "method": m, "us_per_call": s * 1e6,
                                "gb_s": nbytes / s / 1e9})
                step[m] = step.get(m, 0.0) + s * count * 1e3
            print(f"rows {rows} {name:8s} " + "  ".join(f"{m} {s * 1e6:.0f} us" for m, s in best.items()))
        print(f"rows {rows} step ms: " + "  ".join(f"{m} {v:.2f}" for m, v in step.items()))
        results.append({"rows": rows, "step_ms": step})
    call_us = call_costs(2000 if os.environ.get("SMOKE") == "1" else 20000)
    print("us a call: " + "  ".join(f"{m} {v:.1f}" for m, v in call_us.items()))
    with open(a.output_json, "w") as f:
        json.dump({"layers": a.layers, "repeats": a.repeats, "threads": torch.get_num_threads(),
                   "load_average": os.getloadavg(), "results": results, "call_us": call_us}, f, indent=1)


def call_costs(number: int) -> dict[str, float]:
    w, x = torch.randn(64, 64), torch.randn(1, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    h, r, g = torch.randn(1, 576), torch.randn(1, 576), torch.randn(576)
    get_platform("cpu").activate("eager")  # add_rms_norm's cpu kernel: add_rms_norm_cpu
    calls = {
        "linear_64x64_graphinfer_gemv": lambda: cpu_gemv.gemv(x, w, None),
        "linear_64x64_onednn_prepacked": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "linear_64x64_mkl_f_linear": lambda: F.linear(x, w),
        "add_rms_norm_through_the_op": lambda: add_rms_norm(h, r, g, 1e-6),
        "add_rms_norm_bound_function": lambda: add_rms_norm_cpu(h, r, g, 1e-6),
        "add_rms_norm_cpp_kernel_alone": lambda: torch.ops.graphinfer_cpu.add_rms_norm(h, r, g, 1e-6),
    }
    return {m: min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6 for m, fn in calls.items()}


if __name__ == "__main__":
    main()
