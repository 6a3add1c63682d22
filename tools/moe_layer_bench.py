"""One Qwen3-30B-A3B-shaped MoE layer (128 experts, top-8, hidden 2048, expert dim 768, bf16): tokens/s
unfused vs fused, at T = 1 / 4 / 16 / 64 / 256 tokens, plus HF transformers' own block on the same weights.

- unfused: graphinfer's Qwen3MoeSparseMoeBlock as the model writes it (router -> softmax -> top-k ->
  renormalise -> moe_dispatch -> moe_grouped_mlp -> moe_combine; reference ops, capture-safe on a GPU);
- fused: graphinfer::fused_moe with the platform's kernel (Triton on CUDA), what the fuse_moe pass produces
  (the small-T path up to DECODE_MAX_TOKENS tokens, the grouped path above), called eagerly;
- *_graph_ms (CUDA only): each fused variant captured in a CUDA graph and replayed, as a FULL_DECODE_ONLY step
  runs it (no host time: the device time the issue's T=1 target is about);
- fused_grouped / fused_decode: the Triton experts with the path forced (routing in torch, as the op does;
  fused_decode up to T=64), to place DECODE_MAX_TOKENS at the measured crossover;
- hf: transformers' Qwen3MoeSparseMoeBlock (eager).

    python tools/moe_layer_bench.py --output-json moe.json [--tokens 1,4,16,64,256] [--quick]

--quick: a tiny layer (also runs on CPU, Triton under TRITON_INTERPRET=1). Checks fused == unfused first.
"""
import argparse
import json
import os
import sys
import time

import torch

from gpu_check import graph_ms  # tools/ is this script's directory

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def bench_ms(fn, device) -> float:
    if device.type != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> int:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

    from graphinfer.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from graphinfer.ops.triton.fused_moe import DECODE_MAX_TOKENS, fused_experts
    from graphinfer.platforms import current_platform

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-json", default="moe_layer_bench.json")
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    platform = current_platform()
    device = torch.device(platform.device_type)
    platform.activate("triton" if device.type == "cpu" else None)
    shape = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    if args.quick:
        shape = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Qwen3MoeConfig(**shape, norm_topk_prob=True)
    torch.manual_seed(0)
    ours = Qwen3MoeSparseMoeBlock(config).to(device, dtype)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf = hf_moe.Qwen3MoeSparseMoeBlock(config).to(device, dtype)
    hf.load_state_dict({"gate.weight": ours.gate.weight, "experts.gate_up_proj": ours.experts.w13_weight,
                        "experts.down_proj": ours.experts.w2_weight}, strict=False)
    K, renorm = config.num_experts_per_tok, config.norm_topk_prob

    def fused(h):
        return torch.ops.graphinfer.fused_moe(h, ours.gate(h), ours.experts.w13_weight, ours.experts.w2_weight,
                                              K, renorm)

    def forced(decode):
        def run(h):
            w, ids = torch.topk(torch.softmax(ours.gate(h).float(), dim=-1), K, dim=-1)
            w = w / w.sum(dim=-1, keepdim=True) if renorm else w
            return fused_experts(h, w.to(h.dtype), ids, ours.experts.w13_weight, ours.experts.w2_weight,
                                 decode=decode)
        return run

    def hf_block(h):
        out = hf(h.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).squeeze(0)

    rows, ok = [], True
    with torch.inference_mode():
        for T in [int(t) for t in args.tokens.split(",")]:
            h = torch.randn(T, config.hidden_size, device=device, dtype=dtype)
            ref, out, out_hf = ours(h), fused(h), hf_block(h)
            err = (out.float() - ref.float()).abs().max().item()
            err_hf = (out_hf.float() - ref.float()).abs().max().item()
            tol = 2e-2 * max(ref.float().abs().max().item(), 1e-6)
            ok &= err <= tol and err_hf <= tol
            r = dict(tokens=T, fused_vs_unfused_err=err, hf_vs_unfused_err=err_hf)
            runs = [("unfused", ours), ("fused", fused), ("fused_grouped", forced(False))]
            if T <= 64:
                runs.append(("fused_decode", forced(True)))
            for name, fn in runs + [("hf", hf_block)]:
                if name.startswith("fused_"):
                    e = (fn(h).float() - ref.float()).abs().max().item()
                    r[f"{name}_err"] = e
                    ok &= e <= tol
                ms = bench_ms(lambda: fn(h), device)
                r[f"{name}_ms"], r[f"{name}_tok_s"] = ms, T / (ms * 1e-3)
            r["fused_path"] = "decode" if T <= DECODE_MAX_TOKENS else "grouped"
            r["fused_speedup"] = r["unfused_ms"] / r["fused_ms"]
            if device.type == "cuda":
                for name, fn in runs[1:]:
                    r[f"{name}_graph_ms"] = graph_ms(lambda: fn(h), calls=5)
            rows.append(r)
            eager = ", ".join(f"{n} {r[n + '_ms']:.3f}" for n, _ in runs + [("hf", None)])
            graph = ", ".join(f"{n} {r[n + '_graph_ms']:.3f}" for n, _ in runs[1:] if n + "_graph_ms" in r)
            print(f"T={T:4d} [fused path: {r['fused_path']}] eager ms: {eager}" + (f"; in a CUDA graph ms: {graph}" if graph
                  else "") + f"; fused x{r['fused_speedup']:.1f} vs unfused, err {err:.1e}", flush=True)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dtype=str(dtype),
                  shape=shape, torch=torch.__version__, decode_max_tokens=DECODE_MAX_TOKENS, rows=rows)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
