"""`graphinfer` command line: serve, generate, compile, passes (list / show / diff / verify), bench."""
import argparse
import logging
import os
import sys

from graphinfer import engine_args, envs
from graphinfer.config import GRAPH_MODES
from graphinfer.errors import GraphinferError
from graphinfer.server.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT, TOOL_CALL_PARSERS
from graphinfer.server.serving_models import parse_lora_module


# Engine settings are EngineConfig's fields (graphinfer/config.py): their flags and defaults come from there
# (graphinfer/engine_args.py); this file writes none of those defaults again. The groups below pick which settings
# a subcommand takes.
PARALLEL_ARGS = ("tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port", "distributed_timeout",
                 "enable_expert_parallel", "data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank",
                 "data_parallel_address", "data_parallel_rpc_port", "headless", "pipeline_parallel_size",
                 "pp_layer_partition")
GRAPH_ARGS = ("graph_mode", "capture_sizes", "max_capture_size", "splitting_ops")
# `graphinfer compile`: what shapes the artifact (the KV cache is a placeholder; nothing is served)
COMPILE_ARGS = ("dtype", "quantization", "model_impl", "device", "passes", "max_num_seqs", *GRAPH_ARGS,
                "speculative_config", "enable_lora", *PARALLEL_ARGS)
# the offline benchmarks (throughput, latency): the engine settings each run takes from the command line
OFFLINE_BENCH_ARGS = ("model", "dtype", "quantization", "model_impl", "device", "passes", "capture_sizes",
                      "max_model_len", "seed")
# The benchmarks' workloads: where a bench subcommand starts from other values than the engine's defaults, and why.
BENCH_DEFAULTS = {
    "model": "qwen3-0.6b",  # nano-vllm's workload model (random weights of its shape: no download)
    "max_model_len": 4096,  # the workload's longest request (clamped to the model's context)
    "graph_mode": "NONE",  # the eager baseline; the graph modes are compared with --sweep graph-mode=...
    # bench throughput --num-adapters: None = derived, max_loras from the largest N, max_lora_rank from the adapters
    "max_loras": None,
    "max_lora_rank": None,
}


def _add_engine_args(p: argparse.ArgumentParser, with_model: bool = True, serving: bool = False) -> None:
    g = p.add_argument_group("engine (EngineConfig's fields; docs/configuration.md)")
    exclude = [*PARALLEL_ARGS, *(() if with_model else ("model", "artifact"))]
    if serving:  # a smaller step budget online, per platform (graphinfer.server.defaults): None = derive at start
        from graphinfer.server.defaults import SERVE_BATCHED_TOKENS_HELP

        engine_args.add_cli_args(g, exclude=exclude, defaults={"max_num_batched_tokens": None}, helps={
            "max_num_batched_tokens": f"tokens per engine step, which bounds a stream's inter-token gap while a long "
                                      f"prompt is prefilled; {SERVE_BATCHED_TOKENS_HELP}"})
    else:
        engine_args.add_cli_args(g, exclude=exclude)
    _add_parallel_args(p)


def _add_dataset_arg(p) -> None:
    p.add_argument("--dataset", default="random", choices=["random", "copy"],
                   help="random: random token ids (the standard workload); copy: passages the model is asked to repeat "
                        "(speculative decoding's favourable case; throughput: --num-prompts passages of about "
                        "--min-len tokens; graphinfer/bench/copy_workload.py)")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tensor, expert and data parallel (vLLM's / torchrun's flags)")
    engine_args.add_cli_args(g, PARALLEL_ARGS)


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


def _engine_kwargs(args) -> dict:
    """The engine settings the subcommand parsed (its flags are EngineConfig's fields), for LLM(**kwargs)."""
    return engine_args.kwargs_from_args(args)


def _parallel_config(args):
    """compile's, or (--node-rank > 0) another node's: the tensor-parallel size as given, else the artifact's as
    node 0 takes it, else 1."""
    kwargs = engine_args.kwargs_from_args(args, PARALLEL_ARGS)
    # an artifact is one replica's; another node runs no replica of its own
    kwargs.update(data_parallel_size=1, data_parallel_size_local=None, data_parallel_start_rank=0, headless=False)
    if art := getattr(args, "artifact", None) or getattr(args, "target", None):  # generate --artifact, serve ART
        from graphinfer.server.serve import is_artifact

        if is_artifact(art):
            kwargs = engine_args.with_artifact_defaults({**kwargs, "artifact": art})
    from graphinfer.config import ParallelConfig

    return ParallelConfig(**{k: kwargs[k] for k in PARALLEL_ARGS})


def _serve(args) -> None:
    from graphinfer.server.serve import serve

    serve(args.target, args.host, args.port, args.api_key, args.served_model_name, args.max_waiting_requests,
          shutdown_timeout=args.shutdown_timeout, max_request_body_bytes=args.max_request_body_bytes,
          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
          trust_request_chat_template=args.trust_request_chat_template, lora_modules=args.lora_modules,
          **_engine_kwargs(args))


def _generate(args) -> None:
    from graphinfer import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=args.stop, seed=args.sampling_seed, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    llm = LLM(**_engine_kwargs(args))
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
    if args.report:
        from graphinfer.compiler.report import pass_table

        origin = f"artifact {args.artifact}" if args.artifact else f"passes={args.passes}"
        print(f"\n## Pass report ({origin})\n\n{pass_table(llm.llm_engine.worker.compiled.pass_reports)}")


def _bench_generate(args) -> None:
    from graphinfer.bench.generate import run

    passes = args.pass_lists.split(";")
    result = run(args.model, args.dtype, [int(b) for b in args.batch_sizes.split(",")], args.max_tokens,
                 args.repeats, args.compare == "hf", args.output_json, passes)
    head = " | ".join(f"graphinfer passes={p} tok/s" for p in passes)
    print(f"\n| batch | new tokens | {head} |" + (" HF tok/s | ratio |" if args.compare else ""))
    print("|---|---|" + "---|" * len(passes) + ("---|---|" if args.compare else ""))
    for r in result["rows"]:
        line = f"| {r['batch']} | {r['max_tokens']} | " + " | ".join(f"{r[f'passes={p}_tok_s']:.1f}" for p in passes) + " |"
        if args.compare:
            line += f" {r['hf_tok_s']:.1f} | {r['speedup_vs_hf']:.2f}x |"
        print(line)


def _compile(args) -> None:
    import torch

    from graphinfer.compiler import artifact, kernel_cache
    from graphinfer.compiler.artifact import WEIGHTS, rank_file
    from graphinfer.compiler.artifact_export import export_artifact
    from graphinfer.compiler.report import pass_table
    from graphinfer.models.loader import load_tokenizer
    from graphinfer.platforms import platform_for_device
    from graphinfer.platforms.cpu import CpuPlatform
    from graphinfer.runtime.executor.factory import make_executor
    from graphinfer.runtime.executor.parallel_layout import check_parallel_config

    kwargs = {**engine_args.kwargs_from_args(args, COMPILE_ARGS), "model": args.model}
    # an artifact is one replica's
    kwargs.update(data_parallel_size=1, data_parallel_size_local=None, data_parallel_start_rank=0, headless=False)
    kwargs["num_gpu_blocks_override"] = 1  # a placeholder KV cache: compile serves nothing
    kwargs["keep_failed_passes"] = True  # compile judges the check itself (its tolerances; refuse or override)
    config = engine_args.create_engine_config(kwargs)
    device = torch.device(config.model_config.device)
    if device.type != "cpu" or CpuPlatform.resolve_kernels(None) == "inductor":  # compiled kernels go into the artifact
        kernel_cache.collect(args.output, device)
    else:  # the reference ops compile nothing
        kernel_cache.clear(args.output)
    platform = platform_for_device(device.type)
    backend = platform.activate(config.compile_config.kernels)
    if config.parallel_config.world_size > 1:
        check_parallel_config(config)
    executor = make_executor(config, platform, backend)  # Workers only: on a GPU every bucket is captured (warm-up)
    try:
        worker = executor.driver_worker
        print(pass_table(worker.compiled.pass_reports.rejudge(args.atol, args.rtol)))
        tokenizer = load_tokenizer(config.model_config.model)
        manifest = export_artifact(args.output, worker.compiled, config, tokenizer, worker.device, atol=args.atol,
                                   rtol=args.rtol, allow_check_failure=args.allow_check_failure,
                                   write_ranks=lambda d: executor.collective_rpc("save_rank_files", d))
    finally:
        executor.shutdown()
    if manifest["check"]["overridden"]:
        print("\nwarning: the numeric check failed; written anyway (--allow-check-failure, recorded in the manifest)",
              file=sys.stderr)
    tp, pp = manifest["tensor_parallel_size"], artifact.pipeline_parallel_size(manifest)
    print(f"\ncompiled {manifest['model']['path']} ({manifest['platform']}, {manifest['dtype']}, "
          f"{manifest['graph_mode']}, tensor_parallel_size {tp}"
          + (f", pipeline_parallel_size {pp} (layers per stage {manifest['pp_layer_partition']})" if pp > 1 else "")
          + f") -> {args.output}")
    for rank in range(tp * pp) if tp * pp > 1 else ():
        print(f"  rank {rank} weights: {os.path.join(args.output, rank_file(WEIGHTS, rank, tp * pp))}")


def _passes(args) -> int:
    from graphinfer.compiler import pass_tools as tools

    if args.action == "list":
        print(tools.list_passes())
    elif args.action == "show":
        print(tools.show(args.model, args.after, args.dtype, args.onnx, split=args.split, passes=args.passes,
                         dump_dir=args.dump_dir, tp=args.tp, ep=args.ep, quantization=args.quantization))
    elif args.action == "diff":
        print(tools.diff(args.model, args.pass_name, args.dtype, passes=args.passes or "default",
                         dump_dir=args.dump_dir, tp=args.tp, ep=args.ep, quantization=args.quantization))
    else:
        text, reports = tools.verify(args.model, args.passes, args.dtype, args.onnx, atol=args.atol, rtol=args.rtol,
                                     dump_dir=args.dump_dir, quantization=args.quantization)
        print(text)
        if not reports.passed:
            print("graphinfer: numeric check failed:\n  " + "\n  ".join(reports.failures()), file=sys.stderr)
            return 1
    return 0


def _add_tolerance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--atol", type=float, default=None,
                   help="numeric check: max abs error allowed (default: by the outputs' dtype, 1e-4 for float32)")
    p.add_argument("--rtol", type=float, default=None,
                   help="numeric check: max error relative to the outputs' magnitude (default: by dtype, 1e-4 for "
                        "float32); a check passes within atol or rtol")


def _bench_serve(args) -> None:
    import httpx

    from graphinfer.bench.serve import run

    try:
        run(args.url, [int(c) for c in args.concurrency.split(",")], args.num_prompts, args.prompt_len,
            args.max_tokens, args.model, args.output_json, args.plot, args.prompt_seed)
    except (RuntimeError, httpx.HTTPError) as e:  # the warm-up request failed: no server, wrong model, ...
        raise GraphinferError(f"{args.url}: {e!r}. Is `graphinfer serve` running there?") from None


def _csv(text: str, cast=str) -> list:
    return [cast(v.strip()) for v in text.split(",") if v.strip()]


def _on_off(value: str) -> bool:
    if value.lower() not in ("on", "off", "true", "false", "1", "0"):
        raise GraphinferError(f"{value!r}: use on or off.")
    return value.lower() in ("on", "true", "1")


DEFAULT_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}

_SWEEPS = {"max-num-seqs": ("max_num_seqs", int), "graph-mode": ("graph_mode", str),
           "async-scheduling": ("async_scheduling", _on_off), "tensor-parallel-size": ("tensor_parallel_size", int),
           "data-parallel-size": ("data_parallel_size", int),
           "quantization": ("quantization", lambda v: None if v == "none" else v),
           "spec": ("speculative_config", lambda v: _spec_sweep_value(v)),
           "num-speculative-tokens": ("speculative_config", lambda v: _spec_sweep_value(v, tokens=True)),
           "structured-output": ("structured_output", str), "model-impl": ("model_impl", str)}


def _spec_sweep_value(value: str, tokens: bool = False):
    """--sweep spec=off,ngram (or off,on): False / True, without / with the --speculative-config given (default
    DEFAULT_NGRAM); --sweep num-speculative-tokens=0,3,5: that config with k drafts a step, 0 = without."""
    v = value.lower()
    if tokens:
        if not v.isdigit():
            raise GraphinferError(f"--sweep num-speculative-tokens: {value!r} is not a number (0: without).")
        return int(v) or False
    if v in ("off", "none", "false", "0"):
        return False
    if v in ("on", "true", "1", "ngram", "draft", "draft_model"):
        return v
    raise GraphinferError(f"--sweep spec: {value!r}: use off, or on / ngram (with --speculative-config, default "
                          f"ngram k=3, lookup 1..4).")


def _spec_configs(values: list, given: dict | None) -> list:
    """The sweep's spec values as engine speculative configs (None: without)."""
    base = given or DEFAULT_NGRAM
    method = base.get("method") or ("draft_model" if base.get("model") else "ngram")
    out = []
    for v in values:
        if v is False:
            out.append(None)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append({**base, "num_speculative_tokens": v})
        elif v in ("ngram", "draft", "draft_model") and (v == "ngram") != (method == "ngram"):
            raise GraphinferError(f"--sweep spec={v}, but --speculative-config is {base}: use spec=off,on.")
        else:
            out.append(base)
    return out


def _mla_form(value: str, passes: str) -> str:
    if value not in ("absorbed", "expanded"):
        raise GraphinferError(f"--sweep mla-form: {value!r}: use absorbed and/or expanded.")
    return passes if value == "absorbed" else f"{passes},-absorb_mla"


def _bench_throughput(args) -> None:
    from graphinfer.bench.throughput import run

    grid = {"max_num_seqs": [args.max_num_seqs], "graph_mode": [args.graph_mode],
            "async_scheduling": [args.async_scheduling], "tensor_parallel_size": [args.tensor_parallel_size or 1],
            "data_parallel_size": [args.data_parallel_size], "quantization": [args.quantization],
            "speculative_config": [args.speculative_config], "structured_output": [args.structured_output],
            "model_impl": [args.model_impl], "passes": [args.passes]}
    for spec in args.sweep or []:  # --sweep max-num-seqs=16,32 --sweep graph-mode=NONE,FULL_DECODE_ONLY: a grid
        key, _, values = spec.partition("=")
        if key == "mla-form":  # MLA (DeepSeek) absorbed (absorb_mla, the default) or expanded (without it)
            grid["passes"] = [_mla_form(v, args.passes) for v in values.split(",")]
            continue
        if key not in _SWEEPS or not values:
            raise GraphinferError(f"--sweep {spec!r}: use {' or '.join(k + '=V1,V2,...' for k in _SWEEPS)} or "
                                  f"mla-form=absorbed,expanded.")
        name, cast = _SWEEPS[key]
        grid[name] = _csv(values, cast)
    if bad := [m for m in grid["graph_mode"] if m not in GRAPH_MODES]:
        raise GraphinferError(f"graph modes {bad}: use {', '.join(GRAPH_MODES)}.")
    if bad := [k for k in grid["structured_output"] if k not in ("none", "json")]:
        raise GraphinferError(f"--sweep structured-output={','.join(bad)}: use none and/or json.")
    if grid["speculative_config"] != [args.speculative_config]:  # --sweep spec=off,ngram / num-speculative-tokens=0,3
        grid["speculative_config"] = _spec_configs(grid["speculative_config"], args.speculative_config)
    run(args.model, dtype=args.dtype, device=args.device, graph_modes=grid["graph_mode"],
        max_num_seqs=grid["max_num_seqs"], async_scheduling=grid["async_scheduling"],
        tensor_parallel_size=grid["tensor_parallel_size"], data_parallel_size=grid["data_parallel_size"],
        quantization=grid["quantization"], speculative_config=grid["speculative_config"],
        structured_output=grid["structured_output"], model_impl=grid["model_impl"], dataset=args.dataset,
        parallel={k: v for k, v in engine_args.kwargs_from_args(args, PARALLEL_ARGS).items()
                  if k not in ("tensor_parallel_size", "data_parallel_size")},
        capture_sizes=args.capture_sizes, passes=grid["passes"], num_prompts=args.num_prompts, min_len=args.min_len,
        max_len=args.max_len,
        fixed_output_len=args.fixed_output_len, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, temperature=args.temperature, seed=args.seed,
        compare_hf=args.compare == "hf", hf_cuda_graph=args.hf_cuda_graph, output_json=args.output_json,
        plot_path=args.plot, hf_dtype=args.hf_dtype, kernels=args.kernels, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, lora_modules=_lora_modules(args.lora_modules),
        num_adapters=args.num_adapters, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, command=_command_line(args))


def _lora_modules(specs: list[str] | None) -> dict[str, str] | None:
    """vLLM's --lora-modules name=path ... as {name: path} (a bare path is named after its directory)."""
    if not specs:
        return None
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if not name or not path:
            raise GraphinferError(f"--lora-modules {spec!r}: use name=path (a PEFT adapter directory).")
        if name in out:
            raise GraphinferError(f"--lora-modules: the name {name!r} is given twice.")
        out[name] = path
    return out


def _command_line(args) -> str:
    """The command as typed (for a benchmark's JSON): `graphinfer` and the arguments main() parsed."""
    import shlex

    return shlex.join(["graphinfer", *getattr(args, "argv", sys.argv[1:])])


def _bench_moe_balance(args) -> None:
    from graphinfer.bench.moe_balance import run

    run(args.model, ep_size=args.ep_size, dtype=args.dtype, device=args.device, num_prompts=args.num_prompts,
        min_len=args.min_len, max_len=args.max_len, fixed_output_len=args.fixed_output_len,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, graph_mode=args.graph_mode,
        temperature=args.temperature, seed=args.seed, output_json=args.output_json, passes=args.passes,
        eplb=args.eplb, eplb_config=args.eplb_config)


def _bench_accuracy(args) -> None:
    if args.lm_eval:
        from graphinfer.bench.lm_eval_harness import run as run_lm_eval

        tasks = None if args.lm_eval == "default" else _csv(args.lm_eval)
        schemes = _csv(args.schemes) if args.schemes else []
        run_lm_eval(args.model, tasks, _csv(args.backends), args.limit, args.dtype,
                    {"max_model_len": args.max_model_len} if args.max_model_len else {}, schemes,
                    _csv(args.also_dtypes) if args.also_dtypes else [], args.output_json)
        return
    from graphinfer.bench.accuracy import run

    run(args.model, schemes=_csv(args.schemes or "int8_wo,int4_wo,w8a8"), dtype=args.dtype, device=args.device,
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, seed=args.seed, output_json=args.output_json,
        kernels=args.kernels)


def _bench_latency(args) -> None:
    from graphinfer.bench.latency import run

    run(args.model, dtype=args.dtype, device=args.device, batch_sizes=_csv(args.batch_sizes, int),
        graph_modes=_csv(args.graph_modes), capture_sizes=args.capture_sizes,
        passes=args.passes, prompt_len=args.prompt_len, warmup_steps=args.warmup_steps, num_steps=args.num_steps,
        max_model_len=args.max_model_len, temperature=args.temperature, seed=args.seed,
        output_json=args.output_json, plot_path=args.plot, quantization=args.quantization,
        speculative_config=_latency_spec_configs(args), dataset=args.dataset)


def _latency_spec_configs(args) -> tuple:
    """bench latency: without, then the --speculative-config (one per --num-speculative-tokens k)."""
    if args.num_speculative_tokens:
        ks = [k for k in _csv(args.num_speculative_tokens, int) if k > 0]
        return (None, *_spec_configs(ks, args.speculative_config))
    return (None, args.speculative_config) if args.speculative_config else (None,)


def _bench_startup(args) -> None:
    from graphinfer.bench.startup import run

    run(args.artifact, runs=args.runs, caches=_csv(args.caches), extra_args=args.serve_args.split(),
        output_json=args.output_json)


def _add_offline_bench_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_cli_args(p, OFFLINE_BENCH_ARGS, defaults=BENCH_DEFAULTS, helps={
        "model": "HF checkpoint dir, .gguf, or a preset shape with random weights (qwen3-0.6b, smollm2-135m, "
                 "tiny-llama, ...)", "max_model_len": "clamped to the model's context"})
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphinfer", description="graph-mode LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--report", action="store_true", help="also print the pass report (matches, numeric checks)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible server, from an artifact (or a model compiled in memory)")
    srv.add_argument("target", nargs="?", default="", help="artifact dir, HF checkpoint dir, .gguf or preset "
                                                           "(default: bundled SmolLM2)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-waiting-requests", type=int, default=1024, help="beyond this (+ max_num_seqs), answer 503")
    srv.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                     help="larger request bodies get 413 (default: %(default)s, 4 MiB)")
    srv.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                     help="on SIGTERM / Ctrl-C, new requests get 503 and those in flight get this many seconds to "
                          "finish; streams still running then end with an error event (default: %(default)s)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let requests use tool_choice "auto" (the default when they send tools): the model\'s '
                          'tool calls are read from its text by --tool-call-parser')
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="how tool calls are written in the model's output: hermes (Hermes, Qwen2.5, Qwen3: "
                          "<tool_call>{...}</tool_call>) or llama3_json / llama4_json (Llama 3.x / 4 JSON)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="render a chat_template sent with a chat request (vLLM's flag; without it such a request "
                          "gets 400); chat_template_kwargs reach the model's template either way")
    srv.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) to serve, each as NAME=PATH or vLLM's JSON "
                          "'{\"name\": NAME, \"path\": PATH, \"base_model_name\": BASE}' (needs --enable-lora): a "
                          "request's \"model\": NAME runs with that adapter; each is read and checked at start-up")
    _add_engine_args(srv, with_model=False, serving=True)
    srv.set_defaults(func=_serve)

    comp = sub.add_parser("compile", help="trace + optimise a model and write an artifact that generate/serve start from")
    comp.add_argument("model", nargs="?", default=engine_args.default("model"),
                      help="HF checkpoint dir, .gguf file or preset (default: bundled SmolLM2)")
    comp.add_argument("-o", "--output", required=True, help="artifact directory to write")
    _add_tolerance_args(comp)
    comp.add_argument("--allow-check-failure", action="store_true",
                      help="write the artifact even if a pass fails its numeric check (recorded in the manifest)")
    engine_args.add_cli_args(comp.add_argument_group("engine (EngineConfig's fields; docs/configuration.md)"),
                             [n for n in COMPILE_ARGS if n not in PARALLEL_ARGS])
    _add_parallel_args(comp)
    comp.set_defaults(func=_compile)

    ps = sub.add_parser("passes", help="tooling for pass developers").add_subparsers(dest="action", required=True)
    ps.add_parser("list", help="every pass: name, description, origin (built-in or plugin)")
    for name, help_ in (("show", "readable graph code and op histogram"), ("diff", "nodes a pass removed and added"),
                        ("verify", "every pass's numeric check, max abs error and matches, as a table")):
        p = ps.add_parser(name, help=help_)
        p.add_argument("model", help="checkpoint path or preset (tiny-llama, tiny-qwen2, tiny-qwen3, ...)")
        engine_args.add_cli_args(p, ["dtype"])
        if name == "show":
            p.add_argument("--after", default=None, help="show the graph after this pass (default: as traced)")
            p.add_argument("--passes", default=None, help="the pipeline to run (default: none; with --after, the "
                                                          "default pipeline up to that pass)")
            p.add_argument("--split", action="store_true",
                           help="also split the graph at attention as PIECEWISE capture does and show the pieces")
        if name == "diff":
            p.add_argument("--pass", dest="pass_name", required=True)
            p.add_argument("--passes", default=None, help="the pipeline the pass sits in (default: 'default'); a "
                                                          "pass not in it runs after all of it")
        if name == "verify":
            p.add_argument("--passes", default=engine_args.default("passes"),
                           help="'default', 'none', 'a,b,c' or 'default,my_pass'")
            _add_tolerance_args(p)
        p.add_argument("--dump-dir", default=None,
                       help="write the graph as traced and after each pass there (NN-<pass>.py code, .txt nodes)")
        engine_args.add_cli_args(p, ["quantization"])
        if name != "diff":
            p.add_argument("--onnx", default=None, help="also export the graph as ONNX for Netron")
        if name != "verify":
            p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                           help="the graph of rank 0 of N tensor-parallel ranks: its shard, the collectives as nodes "
                                "(built here, nothing runs; `compile -tp N` checks the passes on every rank)")
            p.add_argument("--ep", "--enable-expert-parallel", dest="ep", action="store_true",
                           help="with --tp N: MoE experts partitioned over the N ranks (expert parallel)")
    sub.choices["passes"].set_defaults(func=_passes)

    bench = sub.add_parser("bench", help="benchmarks (write JSON)").add_subparsers(dest="bench", required=True)
    bg = bench.add_parser("generate", help="offline generation throughput, optionally vs HF transformers' generate")
    engine_args.add_cli_args(bg, ["model", "dtype"])
    bg.add_argument("--batch-sizes", default="1,8")
    bg.add_argument("--max-tokens", type=int, default=64)
    bg.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the best is kept")
    bg.add_argument("--compare", choices=["hf"], default=None)
    bg.add_argument("--passes", dest="pass_lists", default=engine_args.default("passes"),
                    help="pass lists to compare, separated by ';' (e.g. 'default;none')")
    bg.add_argument("--output-json", default=None)
    bg.set_defaults(func=_bench_generate)
    bs = bench.add_parser("serve", help="load an OpenAI-compatible server: throughput, TTFT / TPOT percentiles")
    bs.add_argument("--url", default="http://127.0.0.1:8000")
    bs.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels of requests in flight")
    bs.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    bs.add_argument("--prompt-len", type=int, default=128, help="prompt length in (random) tokens")
    bs.add_argument("--max-tokens", type=int, default=64)
    bs.add_argument("--model", default=None, help="default: the server's first model")
    bs.add_argument("--seed", dest="prompt_seed", type=int, default=0, help="seed of the random prompts (a client "
                                                                        "setting, not the server's engine seed)")
    bs.add_argument("--output-json", default=None)
    bs.add_argument("--plot", default=None, help="PNG: throughput and latency vs concurrency")
    bs.set_defaults(func=_bench_serve)

    bt = bench.add_parser("throughput", help="nano-vllm's offline workload (256 prompts, 100-1024 in/out): tok/s, "
                                             "prefill/decode split, memory roofline; sweeps; vs HF generate_batch")
    _add_offline_bench_args(bt)
    engine_args.add_cli_args(bt, ["graph_mode", "max_num_seqs", "async_scheduling", "max_num_batched_tokens", "kernels",
                                  "block_size", "enable_prefix_caching", "speculative_config"], defaults=BENCH_DEFAULTS)
    bt.add_argument("--num-prompts", type=int, default=256)
    bt.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (tokens)")
    bt.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (tokens)")
    bt.add_argument("--fixed-output-len", type=int, default=None, help="every request generates N tokens "
                                                                       "(the fixed-512 variant)")
    bt.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2",
                    help="max-num-seqs=16,32,..., graph-mode=NONE,FULL_AND_PIECEWISE,..., async-scheduling=off,on, "
                         "tensor-parallel-size=1,2, data-parallel-size=1,2, quantization=none,w8a8,..., spec=off,ngram "
                         "(without / with --speculative-config, default ngram k=3, lookup 1..4; off,on alike) or "
                         "num-speculative-tokens=0,3,5 (that config with k drafts, 0: without), "
                         "structured-output=none,json, model-impl=graphinfer,transformers (repeat for a grid)")
    bt.add_argument("--structured-output", default="none", choices=["none", "json"],
                    help="json: every request constrained to a JSON schema that no output completes before its "
                         "max_tokens (bench/structured_output.py), with the mask fill / apply time per step in the "
                         "JSON (the model needs a tokenizer: e.g. --model '' for the bundled SmolLM2)")
    _add_dataset_arg(bt)
    bt.add_argument("--compare", choices=["hf"], default=None, help="also run transformers' generate_batch "
                                                                    "(fixed output length: 512 unless given)")
    bt.add_argument("--hf-cuda-graph", action="store_true", help="HF: use_cuda_graph=True, max_memory_percent=0.5")
    bt.add_argument("--hf-dtype", default=None, help="dtype of the HF run (default: --dtype); the CPU comparison "
                                                    "of docs/benchmarks.md runs HF in float32")
    lg = bt.add_argument_group("LoRA (issue 52): the workload over N distinct adapters vs the base model")
    lg.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapter directories (vLLM's syntax; tools/make_lora_adapter.py writes random ones)")
    lg.add_argument("--num-adapters", type=lambda v: _csv(v, int), default=None, metavar="N1,N2",
                    help="e.g. 0,1,4,8: per N the requests round-robin over N distinct adapters (ids 1..N; paths "
                         "reused under new ids when fewer are given), 0 = none, in an enable_lora engine; first the "
                         "base model in an engine without enable_lora (default with --lora-modules: 0,<their count>)")
    engine_args.add_cli_args(lg, ["max_loras", "max_lora_rank", "max_cpu_loras"],
                             defaults=BENCH_DEFAULTS,
                             helps={"max_loras": "device slots (default: the largest --num-adapters)",
                                    "max_lora_rank": "the slots' rank (default: the adapters' largest r)"})
    _add_parallel_args(bt)
    bt.set_defaults(func=_bench_throughput)

    ba = bench.add_parser(
        "accuracy", help="each quantization scheme vs the unquantized model: greedy agreement, KL, perplexity",
        description="Scores a fixed prompt set (teacher-forced on the unquantized model's greedy continuation) and a "
                    "fixed text with the unquantized model and with each --quantization scheme: greedy-token "
                    "agreement, mean KL of the next-token distributions, perplexity, and the weights' bytes.")
    ba.add_argument("--quantization", dest="schemes", default=None,
                    help="comma-separated schemes to compare with the unquantized model (gguf: a .gguf kept quantized; "
                         "default int8_wo,int4_wo,w8a8; with --lm-eval: none unless given)")
    # float32: the unquantized reference the schemes are scored against
    engine_args.add_cli_args(ba, ["model", "dtype", "device", "kernels", "seed"], defaults={"dtype": "float32"})
    ba.add_argument("--num-prompts", type=int, default=8)
    ba.add_argument("--max-tokens", type=int, default=32, help="greedy continuation scored per prompt")
    ba.add_argument("--output-json", default=None)
    ba.add_argument("--lm-eval", default=None, metavar="TASKS",
                    help="run lm-eval instead: comma-separated task names, or 'default' (graphinfer's shipped tasks: "
                         "graphinfer/bench/lm_eval_tasks); per backend (--backends), then the offline engine per "
                         "--quantization scheme given and per --also-dtypes")
    ba.add_argument("--backends", default="server,llm,hf",
                    help="lm-eval: server (local-completions against graphinfer serve), chat "
                         "(local-chat-completions), llm (lm-eval's Python API over graphinfer.LLM), hf (lm-eval's hf "
                         "backend, the reference)")
    ba.add_argument("--limit", type=int, default=None, help="lm-eval: items per task")
    ba.add_argument("--also-dtypes", default=None, help="lm-eval: more dtypes for the offline engine (bfloat16)")
    ba.add_argument("--max-model-len", type=int, default=None)
    ba.set_defaults(func=_bench_accuracy)

    bm = bench.add_parser(
        "moe-balance", help="tokens per expert and per expert-parallel rank of each MoE layer on the standard "
                            "workload, and their imbalance (EPLB's input)",
        description="Runs bench throughput's standard workload once and prints, per MoE layer, the tokens routed to "
                    "each expert, the tokens per EP rank when --ep-size N ranks own the experts contiguously (rank r: "
                    "experts [r*E/N, (r+1)*E/N), vLLM's default placement) and imbalance = max / mean tokens per rank. "
                    "It is a statistic of the routing: any --ep-size is evaluated in one process, on one device "
                    "(a CPU works), without starting N ranks.")
    engine_args.add_cli_args(bm, ["model", "dtype", "device", "passes", "max_model_len", "seed", "graph_mode",
                                  "max_num_seqs", "eplb_config"], defaults={**BENCH_DEFAULTS, "model": "tiny-qwen3-moe"},
                             helps={"model": "a MoE model: HF checkpoint dir or a preset (tiny-qwen3-moe, ...)",
                                    "max_model_len": "clamped to the model's context"})
    bm.add_argument("--temperature", type=float, default=0.6)
    bm.add_argument("--output-json", default=None)
    bm.add_argument("--ep-size", type=int, default=1, help="expert-parallel size to partition the experts for")
    bm.add_argument("--eplb", action="store_true",
                    help="run on --ep-size expert-parallel ranks with EPLB (--eplb-config; default "
                         "num_redundant_experts = ep size, a rearrangement every 20 steps from the last 10) and report "
                         "the last window's EP-rank imbalance with and without it and the moved bytes / seconds")
    bm.add_argument("--num-prompts", type=int, default=64)
    bm.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (tokens)")
    bm.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (tokens)")
    bm.add_argument("--fixed-output-len", type=int, default=None, help="every request generates N tokens")
    bm.set_defaults(func=_bench_moe_balance)

    bl = bench.add_parser("latency", help="decode step latency per batch size and graph mode")
    _add_offline_bench_args(bl)
    bl.add_argument("--batch-sizes", default="1,8,64,256")
    bl.add_argument("--graph-modes", default="NONE,FULL_DECODE_ONLY")
    bl.add_argument("--prompt-len", type=int, default=32)
    bl.add_argument("--warmup-steps", type=int, default=5, help="decode steps dropped before timing")
    bl.add_argument("--num-steps", type=int, default=30, help="decode steps timed (the median is reported)")
    _add_dataset_arg(bl)
    engine_args.add_cli_args(bl, ["speculative_config"], helps={"speculative_config": engine_args.engine_args()[
        "speculative_config"].help + "; each graph mode is measured without it, then with it, in the same run"})
    bl.add_argument("--num-speculative-tokens", default=None, metavar="K1,K2",
                    help="with --speculative-config (default ngram, lookup 1..4): one run per k, e.g. 3,5")
    bl.set_defaults(func=_bench_latency)

    bsu = bench.add_parser("startup", help="`graphinfer serve ART` until /health answers, in fresh processes, with cold, "
                                           "artifact-only and warm caches; the start-up phases each run logged")
    bsu.add_argument("artifact", help="a `graphinfer compile` output directory")
    bsu.add_argument("--runs", type=int, default=3, help="fresh processes per cache state")
    bsu.add_argument("--caches", default="cold,artifact,warm",
                     help="cache states, comma-separated: cold (every cache empty, the artifact's kernels ignored), "
                          "artifact (a fresh machine: caches outside the artifact empty), warm (a restart)")
    bsu.add_argument("--serve-args", default="", help="more `graphinfer serve` arguments, e.g. '--max-model-len 4096'")
    bsu.add_argument("--output-json", default=None)
    bsu.set_defaults(func=_bench_startup)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # Start-up facts (KV cache size, decode-graph capture time and memory) are INFO logs, on stderr.
    logging.basicConfig(level=envs.GRAPHINFER_LOG_LEVEL,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "node_rank", 0) > 0:  # another node's ranks: workers only, node 0 does the rest
            from graphinfer.runtime.executor.worker_proc import run_node

            return run_node(_parallel_config(args))
        if getattr(args, "headless", False):  # data-parallel replicas only; node 0's front end drives them
            from graphinfer.config import ParallelConfig
            from graphinfer.runtime.engine.headless import run_headless

            return run_headless(ParallelConfig(**engine_args.kwargs_from_args(args, PARALLEL_ARGS)))
        return args.func(args) or 0
    except GraphinferError as e:
        print(f"graphinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
