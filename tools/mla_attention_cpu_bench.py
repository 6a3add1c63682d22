"""graphinfer::mla_latent_attention on CPU (issue 49): the cpu platform's impl (ops/cpu/attention.py: the C++ paged
attention with the concatenated query, the latent cache as key and value) against the reference op (gather + SDPA
through the reference paged_attention), at DeepSeek-V3's latent shape: 16 heads, L 512, R 64, a decode batch of 8
over 512 tokens each (block size 16, shuffled blocks), bf16 and fp32, 2 threads; ms a call, best of --reps means of
20 calls. Prints the CPU model and one JSON line per dtype.

    PYTHONPATH=. .venv/bin/python tools/mla_attention_cpu_bench.py
"""
import argparse
import json
import platform
import time

import torch

import graphinfer.ops  # noqa: F401  (registers the ops; no platform activated: the op is the reference)
from graphinfer.ops.cpu import ext
from graphinfer.ops.cpu.attention import mla_latent_attention_cpu


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def best_ms(fn, reps: int, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e3)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    H, L, R, bs, B, ctx = a.heads, 512, 64, 16, a.batch, a.context
    print(f"CPU: {cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, C++ kernels: "
          f"{ext.problem() or 'loaded'}")
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        n_blocks = B * ctx // bs + 4
        cache = torch.randn(n_blocks, bs, 1, L + R, generator=g).to(dtype)
        tables = torch.randperm(n_blocks, generator=g)[:B * ctx // bs].view(B, -1).int()
        q_latent = torch.randn(H, B, L, generator=g).to(dtype).transpose(0, 1)  # as absorb_mla's bmm leaves it
        q_pe = torch.randn(B, H, R, generator=g).to(dtype)
        args = (q_latent, q_pe, cache, tables, torch.arange(B + 1, dtype=torch.int32),
                torch.full((B,), ctx, dtype=torch.int32), (192) ** -0.5)
        ref = torch.ops.graphinfer.mla_latent_attention
        diff = (ref(*args).float() - mla_latent_attention_cpu(*args).float()).abs().max().item()
        row = dict(dtype=str(dtype).removeprefix("torch."), heads=H, latent=L, rope=R, batch=B, context=ctx,
                   reference_ms=round(best_ms(lambda: ref(*args), a.reps), 2),
                   cpu_impl_ms=round(best_ms(lambda: mla_latent_attention_cpu(*args), a.reps), 2),
                   max_abs_diff=diff)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
