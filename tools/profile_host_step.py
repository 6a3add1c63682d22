"""Where a decode step's host time goes: cProfile over engine.step() at a fixed decode batch.

    python tools/profile_host_step.py --model tiny-llama --batch 256 [--device cuda --graph-mode FULL_DECODE_ONLY]

B requests with prompts of 59..108 tokens are prefilled, then `--steps` pure-decode steps are profiled. The
model itself is tiny by default, so what remains is the runtime around it: scheduling, input preparation,
sampling, output bookkeeping. On a GPU add --torch-profile DIR for a torch.profiler trace of the same steps.

    python tools/profile_host_step.py --ops [--model qwen3-0.6b --batch 64 --forwards 20 --keep-dims]
    python tools/profile_host_step.py --launches [--batch 64]

--ops (CPU, no TRITON_INTERPRET): the host cost of one eager forward (a decode step of B rows), per op, in
three configurations: the reference ops (PyTorch on CPU, their compute included), and the Triton op wrappers
with every kernel launch stubbed (graphinfer.ops.triton.launch_stub: Triton's own JITFunction.run or the fast
Launcher path runs on the host, the compiled kernel's launcher is a no-op) through the normal `kernel[grid]`
launch and through the fast launch. Each graphinfer op node of the graph is timed from the call into the
dispatcher to its return; "other" is the rest of the forward (linears, embedding, views, glue). The model has
the preset's layer count and head shapes but hidden 64, intermediate 128 and vocab 512 (--keep-dims: the real
sizes, where the CPU compute of the linears then dominates "other"). --launches: each Triton op wrapper called
directly at Qwen3-0.6B decode shapes, launches stubbed, normal vs fast launch (no model, no dispatcher; needs only
torch and triton, so it also runs under Triton-Ascend's venv).
"""
import argparse
import cProfile
import os
import pstats
import tempfile
import time
from collections import defaultdict

import torch


def shrunk_checkpoint(preset: str, out_dir: str) -> str:
    """A random-weight HF checkpoint with the preset's layers and attention shapes but tiny hidden/MLP/vocab."""
    from transformers import AutoModelForCausalLM

    from graphinfer.models.presets import preset_config

    config = preset_config(preset)
    if config is None:
        raise SystemExit(f"--ops shrinks a preset; {preset!r} is not one")
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.hidden_size, config.intermediate_size, config.vocab_size = 64, 128, 512
    if hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


class _OpTimer:
    """Per graphinfer op: calls and seconds, timed around the op's call (dispatcher + implementation)."""

    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, op):
        calls, seconds, clock = self.calls, self.seconds, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            out = op(*args, **kwargs)
            seconds[name] += clock() - t0
            calls[name] += 1
            return out

        timed.__name__ = timed.__qualname__ = f"timed_{name}"
        return timed

    def reset(self):
        self.calls.clear()
        self.seconds.clear()


def _timed_graph(gm, timer: _OpTimer):
    """A GraphModule sharing gm's modules and buffers whose graphinfer op calls go through the timer."""
    from torch import fx

    graph = fx.Graph()
    env = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "graphinfer":
            new.target = timer.wrap(target._schema.name.split("::")[-1], target)
        env[node] = new
    return fx.GraphModule(gm, graph)


def ops_mode(args) -> None:
    """--ops: per-op host cost of one eager decode forward; reference ops vs stubbed Triton launches."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--ops stubs compiled launches: run it without TRITON_INTERPRET=1")
    if torch.cuda.is_available():
        raise SystemExit("--ops replaces the Triton runtime with a CPU stub: run it on a machine without a GPU")
    from graphinfer import LLM, SamplingParams
    from graphinfer.ops.triton import TRITON_OPS
    from graphinfer.ops.triton.launch import set_fast_launch
    from graphinfer.ops.triton.launch_stub import stub_triton_runtime

    torch.set_flush_denormal(True)  # stubbed kernels leave torch.empty garbage: keep denormals off the clock
    torch.set_num_threads(1)  # host cost is single-threaded Python; spare the clock OpenMP's spinning
    tmp = tempfile.TemporaryDirectory()
    model = args.model if args.keep_dims else shrunk_checkpoint(args.model, tmp.name)
    # kernels="reference": the graph keeps its torch.ops.graphinfer calls (the default CPU kernels bind them away)
    llm = LLM(model, max_num_seqs=args.batch, device="cpu", dtype=args.dtype, graph_mode="NONE", kernels="reference",
              max_model_len=1024, num_gpu_blocks_override=args.batch * 16)
    engine = llm.llm_engine
    runner = engine.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), list(range(1, 60 + i % 50)), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.local_core.scheduler.requests.values()):
        engine.step()
    seen = []
    graph = runner.graph
    runner.graph = lambda *a: seen.append(a) or graph(*a)
    engine.step()
    runner.graph = graph
    inputs = seen[-1]
    assert inputs[0].shape[0] == args.batch, "expected a pure decode step"

    timer = _OpTimer()
    timed = _timed_graph(graph, timer)
    results = {}

    def measure(label: str) -> None:
        with torch.inference_mode():
            for _ in range(3):  # warm-up: compiles (stubbed), bindings, caches
                timed(*inputs)
            timer.reset()
            start = time.perf_counter()
            for _ in range(args.forwards):
                timed(*inputs)
            total = (time.perf_counter() - start) / args.forwards
        if label not in results or total < results[label][0]:  # the best round counts (a shared, loaded VM)
            results[label] = (total, {k: (timer.calls[k] / args.forwards, timer.seconds[k] / args.forwards)
                                      for k in timer.calls})

    measure("reference")
    lib = torch.library.Library("graphinfer", "IMPL", "CPU")
    for name, fn in TRITON_OPS.items():
        lib.impl(name, fn)
    counts = {}
    try:
        with stub_triton_runtime() as rt:
            for _ in range(args.rounds):  # alternate the two launch paths
                for label, mode in (("triton, normal launch", "off"), ("triton, fast launch", "on")):
                    previous = set_fast_launch(mode)
                    measure(label)
                    runs0, launches0 = rt.jit_runs, rt.launches
                    with torch.inference_mode():
                        timed(*inputs)
                    counts[label] = (rt.launches - launches0, rt.jit_runs - runs0)
                    set_fast_launch(previous)
    finally:
        lib._destroy()

    labels = list(results)
    ops = sorted({k for _, per_op in (r[:2] for r in results.values()) for k in per_op})
    print(f"{args.model}{'' if args.keep_dims else ' (hidden 64, intermediate 128, vocab 512)'}: eager decode forward, "
          f"batch {args.batch}, {args.dtype}, {torch.get_num_threads()} thread; mean of {args.forwards} forwards, "
          f"the best of {args.rounds} alternating rounds for the two Triton columns (one for the reference)")
    print(f"| op | calls | {' | '.join(f'{lab} us/call' for lab in labels)} |")
    print(f"|---|---:|{'---:|' * len(labels)}")
    for op in ops:
        calls = next(r[1][op][0] for r in results.values() if op in r[1])
        cells = [f"{results[lab][1][op][1] / max(calls, 1) * 1e6:.1f}" if op in results[lab][1] else "-" for lab in labels]
        print(f"| {op} | {calls:g} | {' | '.join(cells)} |")
    ops_ms = {lab: sum(s for _, s in results[lab][1].values()) * 1e3 for lab in labels}
    print(f"| all graphinfer ops, ms | | {' | '.join(f'{ops_ms[lab]:.2f}' for lab in labels)} |")
    print(f"| other (linears, embedding, views), ms | | "
          f"{' | '.join(f'{results[lab][0] * 1e3 - ops_ms[lab]:.2f}' for lab in labels)} |")
    print(f"| forward, ms | | {' | '.join(f'{results[lab][0] * 1e3:.2f}' for lab in labels)} |")
    for lab in labels[1:]:
        launches, runs = counts[lab]
        print(f"{lab}: {launches} Triton launches per forward, {runs} through JITFunction.run")
    tmp.cleanup()


def launches_mode(args) -> None:
    """--launches: host cost of each Triton op wrapper called directly (no dispatcher, no model) at Qwen3-0.6B
    decode shapes, launches stubbed, normal vs fast launch. Needs only torch + triton: runs under Triton-Ascend."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--launches stubs compiled launches: run it without TRITON_INTERPRET=1")
    from graphinfer.ops.triton import TRITON_OPS
    from graphinfer.ops.triton.launch import set_fast_launch
    from graphinfer.ops.triton.launch_stub import stub_triton_runtime

    B, Hq, Hk, D, H, inter, bs = args.batch, 16, 8, 128, 1024, 3072, 16
    dt = torch.bfloat16
    qkv = torch.zeros(B, (Hq + 2 * Hk) * D, dtype=dt)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    x, res, w = torch.zeros(B, H, dtype=dt), torch.zeros(B, H, dtype=dt), torch.ones(H, dtype=dt)
    blocks = B * 8
    k_cache, v_cache = (torch.zeros(blocks, bs, Hk, D, dtype=dt) for _ in range(2))
    tables = torch.arange(blocks, dtype=torch.int32).view(B, 8)
    seq_lens = torch.full((B,), 100, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    slots = torch.arange(B, dtype=torch.int64) * bs + 99 % bs
    cos_sin = torch.zeros(4096, D)
    positions = torch.full((B,), 99)
    E, I_moe, K = 8, 64, 2
    gate_up = torch.zeros(B, 2 * inter, dtype=dt)
    moe_x, logits = torch.zeros(B, 64, dtype=dt), torch.zeros(B, E)
    w13, w2 = torch.zeros(E, 2 * I_moe, 64, dtype=dt), torch.zeros(E, 64, I_moe, dtype=dt)
    q_heads, q_rows, k_heads, v_heads = q.view(B, Hq, D), q.reshape(B, Hq, D), k.view(B, Hk, D), v.view(B, Hk, D)
    ops = TRITON_OPS
    calls = {
        "rms_norm (q heads of qkv)": lambda: ops["rms_norm"](q_heads, w[:D], 1e-6),
        "add_rms_norm": lambda: ops["add_rms_norm"](x, res, w, 1e-6),
        "rotary_embedding": lambda: ops["rotary_embedding"](positions, q, k, D, cos_sin, True),
        "reshape_and_cache": lambda: ops["reshape_and_cache"](k_heads, v_heads, k_cache, v_cache, slots),
        "paged_attention (decode)": lambda: ops["paged_attention"](q_rows, k_cache, v_cache, tables, qsl, seq_lens,
                                                                   D ** -0.5),
        "silu_and_mul": lambda: ops["silu_and_mul"](gate_up),
        "fused_moe (8 experts, top-2)": lambda: ops["fused_moe"](moe_x, logits, w13, w2, K, True),
    }
    n = args.forwards * 20
    best: dict[str, dict[str, float]] = defaultdict(dict)
    launches = {}
    with stub_triton_runtime() as rt:
        for _ in range(5):  # rounds alternating the two paths; the best round of each counts (a loaded VM)
            for mode in ("off", "on"):
                previous = set_fast_launch(mode)
                for name, call in calls.items():
                    for _ in range(5):
                        call()
                    before = rt.launches
                    start = time.perf_counter()
                    for _ in range(n):
                        call()
                    us = (time.perf_counter() - start) / n * 1e6
                    best[name][mode] = min(us, best[name].get(mode, float("inf")))
                    launches[name] = (rt.launches - before) / n
                set_fast_launch(previous)
    import triton

    print(f"Triton {triton.__version__}: op wrappers at Qwen3-0.6B decode shapes, batch {B}, launches stubbed; "
          f"best of 5 rounds of {n} calls")
    print("| op wrapper | launches | normal launch us/call | fast launch us/call |")
    print("|---|---:|---:|---:|")
    for name, per_mode in best.items():
        print(f"| {name} | {launches[name]:g} | {per_mode['off']:.1f} | {per_mode['on']:.1f} |")


def main() -> None:
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
    ap.add_argument("--ops", action="store_true", help="per-op host cost of an eager forward (CPU; see above)")
    ap.add_argument("--forwards", type=int, default=20, help="--ops: timed forwards per configuration and round")
    ap.add_argument("--rounds", type=int, default=3, help="--ops: alternating rounds of the two launch paths")
    ap.add_argument("--keep-dims", action="store_true", help="--ops: the preset's real hidden/MLP/vocab sizes")
    ap.add_argument("--launches", action="store_true", help="per-wrapper host cost without a model (see above)")
    args = ap.parse_args()
    if args.launches:
        args.batch = 64 if args.batch == 256 else args.batch
        return launches_mode(args)
    if args.ops:
        if args.model == "tiny-llama":
            args.model = "qwen3-0.6b"
        if args.batch == 256:
            args.batch = 64
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
        return ops_mode(args)
    from graphinfer import LLM, SamplingParams
    from graphinfer.sampling_params import RequestOutputKind

    llm = LLM(args.model, max_num_seqs=args.batch, device=args.device, dtype=args.dtype, graph_mode=args.graph_mode,
              max_model_len=1024, num_gpu_blocks_override=args.batch * 16, async_scheduling=args.async_scheduling)
    engine = llm.llm_engine
    params = SamplingParams(temperature=args.temperature, max_tokens=1000, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate
    for i in range(args.batch):
        engine.add_request(str(i), list(range(1, 60 + i % 50)), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.local_core.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    engine.local_core.platform.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    engine.local_core.platform.synchronize()
    prof.disable()
    print(f"{args.model} batch {args.batch} {args.graph_mode} on {engine.local_core.device}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.2f} ms per decode step (under cProfile)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    if args.torch_profile:
        with torch.profiler.profile() as tp:
            for _ in range(5):
                engine.step()
        tp.export_chrome_trace(args.torch_profile)


if __name__ == "__main__":
    main()
