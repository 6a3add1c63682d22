"""Where a decode step's device time goes: torch.profiler over replayed FULL_DECODE_ONLY decode steps, per op.

    python tools/profile_decode.py --output-json decode_profile.json [--model qwen3-0.6b] [--batch-sizes 1,256]
        [--prompt-len 512] [--steps 20] [--async-scheduling] [--trace-dir DIR]

One engine (max_num_seqs = the largest batch, max_model_len 4096 as the standard workload). For each batch size
B: B requests with random prompts of --prompt-len tokens are prefilled, --warmup pure-decode steps of B rows
run, then --steps more run under torch.profiler. Every device activity of those steps (the kernels inside the
decode-graph replays included: CUPTI reports them) is attributed to an op by its kernel name (`op_of`), and the
JSON gives, per batch: the step's median wall time (device synchronised around each step), device busy time per
step, per op the time per step, launches per step and share, and the top kernels by time. --trace-dir also
writes a Chrome trace per batch.

On CPU (SMOKE=1 tools/h100_bench.sh decode_profile) the same command runs graph mode NONE and lists the CPU
ops' self time instead: a rehearsal of the command and the JSON, not a measurement.
"""
import argparse
import json
import os
import random
import re
import statistics
import sys
from collections import defaultdict

import torch

# Kernel name -> op. Triton kernels are named after their function; anything unmatched keeps its own name.
_OPS = [
    (r"^_decode_kernel", "paged_attention (split-K decode)"),
    (r"^_combine_kernel", "paged_attention (combine)"),
    (r"^_flash_kernel", "paged_attention (flash)"),
    (r"^_add_rms_norm_kernel", "add_rms_norm"),
    (r"^_rms_norm_kernel", "rms_norm"),
    (r"^_rotary_kernel", "rotary_embedding"),
    (r"^_reshape_and_cache_kernel", "reshape_and_cache"),
    (r"^_qk_norm_rope_kernel", "qk_norm_rope(_cache)"),  # one kernel for both ops (WRITE_CACHE is a constexpr)
    (r"^_silu_and_mul_kernel", "silu_and_mul"),
    (r"^_gelu_and_mul_kernel", "gelu_and_mul"),
    (r"^_moe_", "fused_moe"),
    (r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitK|sm90_|Kernel2", "linear (cuBLAS)"),
    (r"^Memcpy HtoD|Memcpy HtoD", "copy host to device"),
    (r"^Memcpy|^Memset", "copy / memset on device"),
    (r"argmax|[Rr]educe", "argmax / reductions (sampler)"),
    (r"elementwise|vectorized|unrolled|index|gather|scatter|copy", "torch elementwise / indexing"),
]


def op_of(kernel: str) -> str:
    for pattern, op in _OPS:
        if re.search(pattern, kernel):
            return op
    return kernel


def device_events(prof, device_type: str) -> list[tuple[str, float, int]]:
    """(name, microseconds, count) of every device activity (CUDA), or the CPU ops' self time (cpu rehearsal)."""
    from torch.autograd import DeviceType

    if device_type == "cuda":
        return [(e.name, e.time_range.elapsed_us(), 1) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0]


def summarise(events: list[tuple[str, float, int]], steps: int, top: int = 15) -> dict:
    by_op, by_kernel = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for name, us, count in events:
        for table, key in ((by_op, op_of(name)), (by_kernel, name)):
            table[key][0] += us
            table[key][1] += count
    total = sum(us for us, _ in by_op.values())

    def rows(table, n=None):
        items = sorted(table.items(), key=lambda kv: -kv[1][0])[:n]
        return [dict(name=k, us_per_step=us / steps, launches_per_step=c / steps, us_per_launch=us / c,
                     share=us / total if total else 0.0) for k, (us, c) in items]

    return dict(device_us_per_step=total / steps, launches_per_step=sum(c for _, c in by_op.values()) / steps,
                ops=rows(by_op), top_kernels=rows(by_kernel, top))


def profile_batch(llm, batch: int, prompt_len: int, warmup: int, steps: int, trace_dir: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from graphinfer import SamplingParams
    from graphinfer.bench import common

    engine = llm.llm_engine
    device = engine.local_core.platform.device_type
    rng = random.Random(batch)
    vocab = engine.hf_config.vocab_size
    # Generous max_tokens: the first prompts decode while later ones still prefill (chunked), and no request may
    # finish inside the profiled window (aborted afterwards).
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=warmup + steps + 256)
    seqs = [engine.make_request([rng.randrange(vocab) for _ in range(prompt_len)], params) for _ in range(batch)]
    for seq in seqs:
        engine.add(seq)
    sync = None if engine.local_core.async_scheduling else engine.local_core.platform.synchronize  # see common.run_steps
    log = common.StepLog()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        # Warm up until `warmup` steps in a row are full decode steps of B rows (every prompt done).
        common.run_steps(engine, log, sync=sync, until=lambda _: len(log.steps) >= warmup and all(
            s.kind == "decode" and s.rows == batch for s in log.steps[-warmup:]))
        engine.local_core.platform.synchronize()
        with profile(activities=activities) as prof:
            n = len(log.steps)
            common.run_steps(engine, log, until=lambda _: len(log.steps) >= n + steps, sync=sync)
            engine.local_core.platform.synchronize()
        states = engine.output_processor.requests  # at the end of the profiled steps
        context = statistics.fmean(len(s.prompt_token_ids) + len(s.output_token_ids) for s in states.values())
    finally:
        for seq in seqs:
            engine.abort_request(seq.request_id)
    measured = log.steps[-steps:]
    if any(s.kind != "decode" or s.rows != batch for s in measured):
        raise SystemExit(f"batch {batch}: the profiled steps were not {steps} pure decode steps of {batch} rows "
                         f"({[(s.kind, s.rows) for s in log.steps]}); is the KV cache large enough?")
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"decode_b{batch}.json"))
    step_ms = [s.seconds * 1e3 for s in measured]
    return dict(batch=batch, steps=steps, mean_context_tokens=context, step_ms_median=statistics.median(step_ms),
                step_ms_min=min(step_ms), **summarise(device_events(prof, device), steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--graph-mode", default=None, help="default: FULL_DECODE_ONLY on a GPU, NONE on cpu")
    ap.add_argument("--batch-sizes", default="1,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--output-json", default="decode_profile.json")
    args = ap.parse_args()

    from graphinfer import LLM
    from graphinfer.bench import common
    from graphinfer.platforms import current_platform

    device = current_platform().device_type if args.device == "auto" else args.device
    graph_mode = args.graph_mode or ("FULL_DECODE_ONLY" if device != "cpu" else "NONE")
    batches = sorted(int(b) for b in args.batch_sizes.split(","))
    llm = LLM(args.model, dtype=args.dtype, device=device, graph_mode=graph_mode, max_num_seqs=batches[-1],
              max_model_len=common.clamp_max_model_len(args.model, args.max_model_len),
              async_scheduling=args.async_scheduling)
    result = dict(tool="profile_decode", model=args.model, graph_mode=graph_mode, async_scheduling=args.async_scheduling,
                  env=common.environment(device), prompt_len=args.prompt_len,
                  note="cpu: CPU op self times (a rehearsal), not device kernels" if device == "cpu" else None,
                  batches=[])
    for b in batches:
        r = profile_batch(llm, b, args.prompt_len, args.warmup, args.steps, args.trace_dir)
        result["batches"].append(r)
        common.write_json(args.output_json, result)  # as it goes: a run cut off keeps what it measured
        print(f"batch {b}: step {r['step_ms_median']:.3f} ms (median), device busy {r['device_us_per_step']:.0f} us "
              f"in {r['launches_per_step']:.0f} launches per step", flush=True)
        for o in r["ops"][:12]:
            print(f"    {o['name'][:60]:60s} {o['us_per_step']:9.1f} us/step {o['launches_per_step']:6.1f} launches "
                  f"{o['us_per_launch']:7.2f} us each {100 * o['share']:5.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
