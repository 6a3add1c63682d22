"""Where a decode step's host time goes: cProfile over engine.step() at a fixed decode batch.

    python tools/profile_host_step.py --model tiny-llama --batch 256 [--device cuda --graph-mode FULL_DECODE_ONLY]

B requests with prompts of 59..108 tokens are prefilled, then `--steps` pure-decode steps are profiled. The
model itself is tiny by default, so what remains is the runtime around it: scheduling, input preparation,
sampling, output bookkeeping. On a GPU add --torch-profile DIR for a torch.profiler trace of the same steps.
"""
import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    from graphinfer import LLM, SamplingParams
    from graphinfer.sampling_params import RequestOutputKind

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--graph-mode", default="NONE")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--torch-profile", default=None, help="also write a torch.profiler trace (chrome JSON) here")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, device=args.device, dtype=args.dtype, graph_mode=args.graph_mode,
              max_model_len=1024, num_gpu_blocks_override=args.batch * 16, async_scheduling=args.async_scheduling)
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, max_tokens=1000, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate
    for i in range(args.batch):
        engine.add_request(str(i), list(range(1, 60 + i % 50)), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    engine.platform.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    engine.platform.synchronize()
    prof.disable()
    print(f"{args.model} batch {args.batch} {args.graph_mode} on {engine.device}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.2f} ms per decode step (under cProfile)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    if args.torch_profile:
        with torch.profiler.profile() as tp:
            for _ in range(5):
                engine.step()
        tp.export_chrome_trace(args.torch_profile)


if __name__ == "__main__":
    main()
