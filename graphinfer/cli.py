"""`graphinfer` command line: generate, bench generate (compile / serve / passes arrive with their issues)."""
import argparse
import sys

from graphinfer.errors import GraphinferError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="", help="HF checkpoint dir or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def _generate(args) -> None:
    from graphinfer import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=args.stop, seed=args.sampling_seed, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, device=args.device)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outs):
        c = out.outputs[0]
        print(f"--- prompt: {prompt!r}\n{c.text}\n--- [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
        if c.logprobs:
            for tid, entry in zip(c.token_ids, c.logprobs):
                print(f"  {entry[tid].decoded_token!r}: {entry[tid].logprob:.4f}")


def _bench_generate(args) -> None:
    from graphinfer.bench.generate import run

    result = run(args.model, args.dtype, [int(b) for b in args.batch_sizes.split(",")], args.max_tokens,
                 args.repeats, args.compare == "hf", args.output_json)
    print(f"\n| batch | new tokens | graphinfer tok/s |" + (" HF tok/s | ratio |" if args.compare else ""))
    print("|---|---|---|" + ("---|---|" if args.compare else ""))
    for r in result["rows"]:
        line = f"| {r['batch']} | {r['max_tokens']} | {r['graphinfer_tok_s']:.1f} |"
        if args.compare:
            line += f" {r['hf_tok_s']:.1f} | {r['speedup_vs_hf']:.2f}x |"
        print(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphinfer", description="graph-mode LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks (write JSON)").add_subparsers(dest="bench", required=True)
    bg = bench.add_parser("generate", help="offline generation throughput, optionally vs HF transformers' generate")
    bg.add_argument("--model", default="", help="HF checkpoint dir or .gguf file (default: bundled SmolLM2)")
    bg.add_argument("--dtype", default="auto")
    bg.add_argument("--batch-sizes", default="1,8")
    bg.add_argument("--max-tokens", type=int, default=64)
    bg.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the best is kept")
    bg.add_argument("--compare", choices=["hf"], default=None)
    bg.add_argument("--output-json", default=None)
    bg.set_defaults(func=_bench_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except GraphinferError as e:
        print(f"graphinfer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
