"""`graphinfer bench throughput`: the offline workload of nano-vllm's bench.py (docs/benchmarks.md).

random.seed(0); 256 prompts of randint(100, 1024) tokens drawn from randint(0, 10000); then each
request's max_tokens = randint(100, 1024) (142,827 prompt / 133,966 output tokens); temperature 0.6,
ignore_eos, max_model_len 4096; one warm-up generate; throughput = output tokens / wall time of the
whole generate. The generate is LLM.generate's own loop over engine.step(), with each step timed and
classed as prefill (any prompt token scheduled) or decode, so the run also splits its time and gets
compared with a memory roofline (graphinfer/bench/roofline.py) at a bandwidth measured in the same run.
Several configurations (graph mode x async scheduling x max_num_seqs x tensor-parallel size x data-parallel size)
run one after another in one process, each engine shut down (its tensor-parallel ranks and data-parallel replicas
stopped) before the next starts.
At tp > 1 each step also records the host time rank 0 spends inside collective calls (the step message's
broadcast and the graph's all-reduces / all-gathers; on gloo they are synchronous, so this includes waiting
for the other ranks).
With data parallel (dp > 1) the output tokens and preemptions are every replica's, the step log and its
prefill/decode split are replica 0's (the front end's process), each row records the requests routed to each
replica, and a MoE model's expert load is summed over the replicas (DPEngine.expert_load).
Speculative decoding (speculative_config; the CLI's --sweep spec=off,ngram or num-speculative-tokens=0,3,5): a step
verifies up to k drafts per request and emits 1 + accepted tokens for it, so output tok/s stays the measure and
tokens_per_step (output tokens / steps, all rows) says how many a step yielded; such a row adds spec_decode, the
timed run's drafts (num_drafts, num_draft_tokens, num_accepted_tokens and per position, acceptance_rate,
mean_acceptance_length, as engine.spec_decode_stats()). The engine runs speculative steps synchronously: a row records the async scheduling
the engine actually used.
Structured outputs (--structured-output json, or --sweep structured-output=none,json): every request of the warm-up and
the timed run constrained to the JSON schema of bench/structured_output.py (which no output completes before its
max_tokens, so the token counts stay the unconstrained run's); such a row adds structured_output_stats, the timed run's
mask fill / copy + apply / accept time in all and per step (the model needs a tokenizer).
dataset "copy" (bench/copy_workload.py; its docstring says how the prompts are built): num_prompts passages of about
min_len tokens that the model is asked to repeat, max_tokens the passage length + 16; a real model's request ends at
its EOS (not ignored: past its answer's end nothing is copied, and a user's request would stop there; the timed run's
output_lens and the roofline count what was generated), a preset's (random weights) runs to max_tokens. Before the
timed run, besides the usual warm-up, up to 4 copy prompts of another seed, asked in other words (no prefix-cache
hits on the timed prompts past the chat template's opening) and cut at 48 tokens, so steps that verify drafts are
warm too.
LoRA (--lora-modules name=path ... --num-adapters 0,1,4,8; issue 52): the same workload once per N with its requests
spread round-robin over N distinct adapters (ids 1..N; with fewer paths than N the paths are reused under distinct ids,
as vLLM's benchmark does: to the slots and the scheduler a distinct id is a distinct adapter), N = 0 sending no adapter,
all in an enable_lora engine with max_loras = the largest N (unless given), and first the base model in an engine
without enable_lora, the reference each row's vs_base divides by. The warm-up runs with the row's adapters too, so they
are read and in their slots before the timed run (max_cpu_loras >= max_loras keeps them in host memory).
"""
import json
import os
import random
import time
import traceback
from dataclasses import dataclass

import torch

from graphinfer.bench import common, roofline
from graphinfer.bench import structured_output as structured
from graphinfer.bench.roofline import ModelShape, ideal_roofline, measure_bandwidth, step_bytes
from graphinfer.errors import InvalidConfigError

TOKEN_ID_MAX = 10000


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool = True  # False: a request ends at its EOS (the copy workload on a real model), max_tokens a cap

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def standard_workload(num_prompts: int = 256, min_len: int = 100, max_len: int = 1024,
                      fixed_output_len: int | None = None, seed: int = 0, vocab_size: int | None = None) -> Workload:
    """bench.py's draws, in its order (all prompts, then all max_tokens). A vocabulary smaller than the
    token-id range (tiny presets) takes ids modulo its size, so the lengths stay the standard's."""
    rng = random.Random(seed)  # the same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, TOKEN_ID_MAX) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]
    max_tokens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    if fixed_output_len is not None:
        max_tokens = [fixed_output_len] * num_prompts
    if vocab_size is not None and vocab_size <= TOKEN_ID_MAX:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload(prompts, max_tokens)


def warmup_workload(num: int, min_len: int, vocab_size: int, max_model_len: int, seed: int = 1) -> Workload:
    """Short prompts (other ids than the timed ones: no prefix-cache hits) whose decode batch shrinks 40..1
    after the first steps, plus one of 255 tokens (a 16-block table): Triton kernel variants that depend on
    the batch size (attention splits) or on block-table strides compile here, not in the timed run."""
    rng = random.Random(seed)
    lens = [min_len + i % 17 for i in range(num)]
    lens[0] = max(lens[0], min(255, max_model_len // 2))
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]
    return Workload(prompts, [2 + max(0, 40 - i) for i in range(num)])


def timed_generate(llm, workload: Workload, temperature: float,
                   structured_output: str | None = None, adapters: list | None = None) -> tuple[dict, common.StepLog]:
    """LLM.generate(prompts, params) timed as a whole and per engine step. With data parallel (a DPEngine) also per
    replica: the requests routed to it, their prompt / output tokens and its preemptions (log.replicas: each
    request's replica). structured_output "json": every request constrained to bench/structured_output.py's schema,
    and the structured-output counters of the run in stats["structured_output"]. adapters: LoRARequests, request i
    running with adapters[i % len(adapters)] (None / empty: none)."""
    from graphinfer import SamplingParams
    from graphinfer.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    dp = engine.config.parallel_config.data_parallel_size
    sync = engine.local_core.platform.synchronize
    log = common.StepLog()
    before = engine.stats()  # summed over the replicas (data parallel), each under "engines"
    constraint = structured.structured_params(structured_output)
    so_before = structured.snapshot(engine) if constraint is not None else None
    sync()
    start = time.perf_counter()
    seqs = [engine.make_request(p, SamplingParams(temperature=temperature, ignore_eos=workload.ignore_eos,
                                                   max_tokens=m, output_kind=RequestOutputKind.FINAL_ONLY,
                                                   structured_outputs=constraint),  # as LLM.generate
                                lora_request=adapters[i % len(adapters)] if adapters else None)
            for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens))]
    for seq in seqs:
        engine.add(seq)
    if dp > 1:
        log.replicas = [engine.engine_core.replica_of(seq.request_id) for seq in seqs]
    try:
        # Async scheduling overlaps a step's host work with the previous step's device work: no per-step sync.
        finished = common.run_steps(engine, log, sync=None if engine.local_core.async_scheduling else sync)
    finally:  # as LLM.generate: an interrupted run must not leak KV blocks
        for seq in seqs:
            engine.abort_request(seq.request_id)
    sync()
    total = time.perf_counter() - start
    after = engine.stats()  # a replica reports its load with its outputs: current once all are in
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    stats = {"total_s": total, "output_tokens": out_tokens, "output_tok_s": out_tokens / total,
             **({} if workload.ignore_eos else {"output_lens": _output_lens(seqs, finished)}),
             "num_preemptions": after["preemptions"] - before["preemptions"], **log.summary()}
    if so_before is not None:
        stats["structured_output_stats"] = structured.delta(engine, so_before, stats["num_steps"], total)
    if dp > 1:
        replica = {seq.request_id: d for seq, d in zip(seqs, log.replicas)}
        stats["replicas"] = [
            {"dp_rank": d, "requests_routed": log.replicas.count(d),
             "prompt_tokens": sum(len(p) for p, r in zip(workload.prompts, log.replicas) if r == d),
             "output_tokens": sum(len(o.outputs[0].token_ids) for o in finished if replica[o.request_id] == d),
             "preemptions": a["preemptions"] - b["preemptions"]}
            for d, (b, a) in enumerate(zip(before["engines"], after["engines"]))]
        stats["requests_routed"] = [r["requests_routed"] for r in stats["replicas"]]
    return stats, log


def _output_lens(seqs, finished) -> list[int]:
    """Each request's output length, in the workload's order."""
    n = {o.request_id: len(o.outputs[0].token_ids) for o in finished}
    return [n.get(seq.request_id, 0) for seq in seqs]


def roofline_report(engine, shape: ModelShape, workload: Workload, log: common.StepLog, stats: dict,
                    bandwidth: float) -> dict:
    mnbt = engine.config.scheduler_config.max_num_batched_tokens
    lens = list(map(len, workload.prompts))
    if "output_lens" in stats:  # requests that stopped at EOS: the ideal schedule of what they generated
        workload = Workload(workload.prompts, stats["output_lens"])
    if log.replicas is None:
        ideal = ideal_roofline(shape, lens, workload.max_tokens, mnbt, bandwidth)
    else:  # data parallel: each replica its own requests on its own device; the run takes the slowest one's time
        per = [ideal_roofline(shape, [n for n, r in zip(lens, log.replicas) if r == d],
                              [m for m, r in zip(workload.max_tokens, log.replicas) if r == d], mnbt, bandwidth)
               for d in sorted(set(log.replicas))]
        seconds = max(p["seconds"] for p in per)
        ideal = {"seconds": seconds, "bytes": sum(p["bytes"] for p in per),
                 "output_tok_s": workload.output_tokens / seconds}
    ran = sum(step_bytes(shape, s.kv_tokens) for s in log.steps if s.kind != "idle") / bandwidth
    decode = sum(step_bytes(shape, s.kv_tokens) for s in log.of("decode")) / bandwidth
    pc = engine.config.parallel_config
    if pc.data_parallel_size > 1:
        scope = ("data parallel: each replica's requests (as routed) on its own device at this bandwidth with rank "
                 "0's weights (its tp / ep shard), the ideal time being the slowest replica's; schedule_s and "
                 "decode_steps_s cover replica 0's steps only; cpu replicas share one memory bus, so there the bound "
                 "is optimistic")
    elif pc.replica_size == 1:
        scope = "the whole model"
    else:
        scope = ("rank 0's shard at one device's bandwidth (every rank reads its own in parallel; cpu ranks share one "
                 "memory bus, so there the bound is optimistic)")
    return {"ideal_s": ideal["seconds"], "ideal_tok_s": ideal["output_tok_s"], "ideal_bytes": ideal["bytes"],
            "fraction": ideal["seconds"] / stats["total_s"],  # = achieved tok/s / ideal tok/s
            # The same model over the steps that actually ran (all, and the pure-decode ones vs their time).
            "schedule_s": ran, "schedule_fraction": ran / stats["total_s"],
            "decode_steps_s": decode, "decode_fraction": decode / stats["decode_s"] if stats["decode_s"] else None,
            "bandwidth_bytes_per_s": bandwidth, "scope": scope}


def collective_measure(engine) -> str:
    """What the collective fields of a row measured (the JSON says so next to them)."""
    pc = engine.config.parallel_config
    lockstep = engine.local_core.dp_lockstep  # MoE + expert parallel replicas (replica 0's engine)
    if pc.tensor_parallel_size == 1 and not lockstep:
        return "none: tp 1 runs no collectives" + (
            " (and data-parallel replicas of a dense model share none)" if pc.data_parallel_size > 1 else "")
    what = "host time of rank 0 inside collective calls (parallel_state.comm_counters), per engine step"
    if lockstep:
        what += ("; data parallel + expert parallel: the replicas' per-step all-reduce (lockstep) and the MoE "
                 "layers' token exchanges included")
    backend = engine.local_core.platform.dist_backend
    if backend == "gloo":
        return what + "; gloo collectives are synchronous: this is their whole time, waits for the other ranks included"
    return (what + f"; {backend} collectives return once enqueued, so this is launch time only "
            f"(none while a captured graph replays), plus the step message's gloo broadcast, which is synchronous")


def run_config(model: str, engine_kwargs: dict, workload: Workload, temperature: float, bandwidth: float,
               min_len: int, extra_warmup: Workload | None = None, structured_output: str | None = None,
               adapters: list | None = None) -> dict:
    from graphinfer import LLM

    t = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    try:
        engine = llm.llm_engine
        row = {"init_s": time.perf_counter() - t,
               "capture_s": common.capture_seconds(engine),
               "num_kv_blocks": engine.worker.model_runner.num_blocks,  # data parallel: replica 0's (each has its own)
               # rank 0's; on cpu every rank of a node takes the same share of its cores (runtime/executor.join_group)
               "threads_per_rank": torch.get_num_threads()}
        warm = warmup_workload(min(len(workload.prompts), engine.config.scheduler_config.max_num_seqs), min_len,
                               engine.hf_config.vocab_size, engine.max_model_len)
        t = time.perf_counter()
        # structured: the grammar compiles here; LoRA: the adapters are read and put in their slots here
        timed_generate(llm, warm, temperature, structured_output, adapters)
        if extra_warmup is not None:  # the copy workload: steps that verify drafts run before the timed ones too
            timed_generate(llm, extra_warmup, temperature, structured_output, adapters)
        row["warmup_s"] = time.perf_counter() - t
        engine.reset_expert_load()  # the timed run's routing only
        spec_before = common.spec_decode_snapshot(engine)
        busy_before = engine.local_core.pipeline_busy()
        stats, log = timed_generate(llm, workload, temperature, structured_output, adapters)
        if busy_before:  # pipeline parallel: each stage's share of the wall time spent computing (the bubble: the rest)
            row["pipeline_busy"] = [(b - a) / stats["total_s"] for a, b in
                                    zip(busy_before, engine.local_core.pipeline_busy())]
            row["max_batches_in_flight"] = engine.local_core.max_batches_in_flight
        shape = ModelShape.from_engine(engine)  # at tp > 1: rank 0's shard
        row.update(stats, **log.collective_summary(), collective_measure=collective_measure(engine),
                   tokens_per_step=stats["output_tokens"] / max(1, stats["num_steps"]),
                   async_scheduling=engine.local_core.async_scheduling,
                   roofline=roofline_report(engine, shape, workload, log, stats, bandwidth),
                   model_shape=shape.to_dict())
        if engine.config.speculative_config is not None:  # the timed run's drafts (warm-up excluded)
            row["spec_decode"] = common.spec_decode_delta(engine, spec_before)
        if engine.worker.model_runner.moe_layers:  # tokens per expert per MoE layer, and their imbalance
            row["expert_load"] = engine.expert_load_summary()  # data parallel: summed over the replicas
            row["expert_parallel_size"] = row["expert_load"]["ep_size"]
        return row
    finally:  # the next configuration starts on free memory, and a tp > 1 engine's other ranks exit here
        llm.shutdown()


def _mode(r: dict) -> str:
    return r["graph_mode"] + (" + async" if r.get("async_scheduling") else "") + (
        f" {r['quantization']}" if r.get("quantization") else "") + _spec(r) + (
        f" + {r['structured_output']} outputs" if r.get("structured_output") not in (None, "none") else "") + _lora(r)


def _lora(r: dict) -> str:
    """" + LoRA x4" (an enable_lora engine, 4 adapters in the batch), " + LoRA x0" (no adapter sent), " (no LoRA)" (the
    reference engine of a LoRA run); "" outside a LoRA run."""
    if "enable_lora" not in r:
        return ""
    return f" + LoRA x{r['num_adapters']}" if r["enable_lora"] else " (no LoRA)"


def _spec(r: dict) -> str:
    """" + ngram k=3" (drafts and acceptance rate where measured) for a run with speculative decoding."""
    sd = r.get("speculative_config")
    if not sd:
        return ""
    name = sd.get("method") or "draft_model"
    stats = r.get("spec_decode") or {}
    acc = (" (no drafts)" if not stats.get("num_drafts") else f" (accept {stats['acceptance_rate']:.0%})") if stats else ""
    return f" + {name} k={sd.get('num_speculative_tokens')}" + acc


def _tp(runs: list[dict]) -> bool:
    """Whether the tables show the tensor-parallel columns (some run has tp > 1)."""
    return any(r.get("tensor_parallel_size", 1) > 1 for r in runs)


def _dp(runs: list[dict]) -> bool:
    """Whether the tables show the data-parallel columns (some run has dp > 1)."""
    return any(r.get("data_parallel_size", 1) > 1 for r in runs)


def _ep(r: dict) -> str:
    """" + EP" where expert parallel was asked for (the row's expert_parallel_size says whether it split anything)."""
    return " + EP" if r.get("enable_expert_parallel") else ""


def _label(runs: list[dict]):
    """A run's name in the plot: its graph mode, and its tp / dp when some run of the sweep has them > 1."""
    tp, dp = _tp(runs), _dp(runs)
    return lambda r: (_mode(r) + (f" tp {r.get('tensor_parallel_size', 1)}" if tp else "")
                      + (f" dp {r.get('data_parallel_size', 1)}{_ep(r)}" if dp else ""))


def _fmt_row(r: dict) -> str:
    tp, dp, pp = r.get("tensor_parallel_size", 1), r.get("data_parallel_size", 1), r.get("pipeline_parallel_size", 1)
    name = (f"{_mode(r)} max_num_seqs={r['max_num_seqs']}" + (f" tp={tp}" if tp > 1 else "")
            + (f" pp={pp}" if pp > 1 else "")
            + (f" model_impl={r['model_impl']}" if r.get("model_impl", "auto") != "auto" else "")
            + (f" passes={r['passes']}" if r.get("passes", "default") != "default" else "")
            + (f" dp={dp}" if dp > 1 else "") + _ep(r))
    if "unavailable" in r:
        return f"{name}: unavailable ({r['unavailable']})"
    rf = r["roofline"]
    dec = f", decode steps at {rf['decode_fraction']:.1%} of their roofline" if rf["decode_fraction"] else ""
    if tp > 1 or dp > 1 or pp > 1:
        dec += (f"; {r['threads_per_rank']} thread(s) per rank, {r['collective_s']:.2f} s in collective calls "
                f"({(r['collective_fraction'] or 0):.1%} of the step time)")
    if busy := r.get("pipeline_busy"):
        dec += (f"; pipeline stages busy {', '.join(f'{b:.0%}' for b in busy)} of the wall time (up to "
                f"{r['max_batches_in_flight']} batches in flight)")
    if dp > 1:
        dec += (f"; requests per replica {r['requests_routed']}, replica 0 idle {r['idle_s']:.2f} s / "
                f"{r['num_idle_steps']} steps")
    if so := r.get("structured_output_stats"):
        dec += (f"; structured outputs per step: mask fill {so['fill_ms_per_step']:.3f} ms (host), copy + apply "
                f"{so['apply_ms_per_step']:.3f} ms (device), accept {so['accept_ms_per_step']:.3f} ms (host)")
    return (f"{name}: {r['output_tokens']:,} output tokens in "
            f"{r['total_s']:.2f} s = {r['output_tok_s']:,.1f} tok/s (prefill {r['prefill_s']:.2f} s / "
            f"{r['num_prefill_steps']} steps, decode {r['decode_s']:.2f} s / {r['num_decode_steps']} steps, mean "
            f"decode batch {r['mean_decode_batch'] or 0:.1f}); {rf['fraction']:.1%} of the memory roofline "
            f"({rf['ideal_tok_s']:,.0f} tok/s){dec}; KV cache {r['model_shape']['kv_bytes_per_token']:,} bytes per "
            f"token")


def table(result: dict) -> str:
    """One row per run; the tp / dp columns (and the collective time) where some run has tp > 1 or dp > 1. With data
    parallel the step split is replica 0's (its steps; "idle s": its steps with nothing of its own)."""
    hf = result.get("hf") if "output_tok_s" in result.get("hf", {}) else None
    tp, dp = _tp(result["runs"]), _dp(result["runs"])
    par = tp or dp
    spec = any(r.get("speculative_config") for r in result["runs"])  # tokens per step: > 1 with accepted drafts
    impl = len({r.get("model_impl") for r in result["runs"]}) > 1  # a --sweep model-impl run
    passes = len({r.get("passes") for r in result["runs"]}) > 1  # a --sweep mla-form run
    headers = ["graph mode", "max_num_seqs"] + (["model impl"] if impl else []) + (["passes"] if passes else []) + (["tp"] if tp else []) + (["dp", "EP"] if dp else []) + (
        ["threads/rank"] if par else []) + [
        "time (s)", "output tok/s", "prefill s", "decode s", "steps"] + (["tokens/step"] if spec else []) + [
        "mean decode batch"] + (
        ["idle s", "requests per replica"] if dp else []) + (
        ["median decode step ms", "collective s", "% of step time"] if par else []) + ["roofline %"] + (
        ["vs HF"] if hf else [])
    rows = []
    for r in result["runs"]:
        head = [_mode(r), r["max_num_seqs"]] + ([r.get("model_impl")] if impl else []) + (
            [r.get("passes")] if passes else []) + (
            [r.get("tensor_parallel_size", 1)] if tp else []) + (
            [r.get("data_parallel_size", 1), _ep_cell(r)] if dp else [])
        if "unavailable" in r:
            why = "failed" if r["unavailable"].startswith("failed") else "unavailable"
            rows.append(head + [why] + [None] * (len(headers) - len(head) - 1))
            continue
        rows.append(head + ([r["threads_per_rank"]] if par else []) + [
            f"{r['total_s']:.2f}", f"{r['output_tok_s']:,.2f}", f"{r['prefill_s']:.2f}", f"{r['decode_s']:.2f}",
            r["num_steps"]] + ([f"{r['tokens_per_step']:.2f}"] if spec else []) + [r["mean_decode_batch"]] + (
            [f"{r.get('idle_s', 0):.2f}",  # dp 1: every request on the one engine
             " / ".join(map(str, r.get("requests_routed") or [result["workload"]["num_prompts"]]))] if dp else []) + (
            [r["median_decode_step_ms"], f"{r['collective_s']:.2f}", f"{100 * (r['collective_fraction'] or 0):.1f}"]
            if par else []) + [f"{100 * r['roofline']['fraction']:.1f}"] + ([f"{r['vs_hf']:.2f}x"] if hf else []))
    if hf:
        lead = ["HF generate_batch", "-"] + ["-"] * (int(tp) + 2 * int(dp) + int(par))
        rows.append(lead + [f"{hf['total_s']:.2f}", f"{hf['output_tok_s']:,.2f}"]
                    + [None] * (len(headers) - len(lead) - 2))
    return common.markdown_table(headers, rows)


def lora_table(result: dict) -> str:
    """A LoRA run (--num-adapters): one row per engine and adapter count; output and total (prompt + output) tok/s,
    and the ratio of output tok/s to the engine without enable_lora (of the same other settings)."""
    runs = result["runs"]
    label = _label(runs)
    base = lambda r: {k: v for k, v in r.items() if k != "enable_lora"}  # noqa: E731 (its settings less LoRA's)
    other = len({_mode(base(r)) for r in runs}) > 1 or _tp(runs) or _dp(runs)
    headers = (["configuration"] if other else []) + ["engine", "adapters", "time (s)", "output tok/s", "total tok/s",
                                                      "vs base"]
    rows = []
    for r in runs:
        lead = [label(base(r))] if other else []
        if r["enable_lora"]:
            engine = f"enable_lora (max_loras {r['max_loras']}, max_lora_rank {r['max_lora_rank']})"
            adapters = "0 (base model)" if r["num_adapters"] == 0 else str(r["num_adapters"])
        else:
            engine, adapters = "without LoRA", "-"
        if "unavailable" in r:
            rows.append(lead + [engine, adapters, "failed" if r["unavailable"].startswith("failed") else "unavailable",
                                None, None, None])
            continue
        vs = r.get("vs_base")
        rows.append(lead + [engine, adapters, f"{r['total_s']:.2f}", f"{r['output_tok_s']:,.2f}",
                            f"{r['total_tok_s']:,.2f}", f"{vs:.3f}x" if vs is not None else None])
    return common.markdown_table(headers, rows)


def _ep_cell(r: dict) -> str:
    """The EP column: off, or on with the expert-parallel size it ran at (1: nothing to split over, e.g. tp 1 dp 1)."""
    if not r.get("enable_expert_parallel"):
        return "off"
    return f"on ({r['expert_parallel_size']})" if "expert_parallel_size" in r else "on"


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on servers / CI
    import matplotlib.pyplot as plt

    if result.get("lora"):
        return _plot_lora(result, path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = [r for r in result["runs"] if "unavailable" not in r]
    xs = sorted({r["max_num_seqs"] for r in runs})
    label = _label(runs)
    for mode in dict.fromkeys(map(label, runs)):
        pts = sorted((r["max_num_seqs"], r["output_tok_s"]) for r in runs if label(r) == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"graphinfer {mode}")
    if "output_tok_s" in result.get("hf", {}):
        ax.axhline(result["hf"]["output_tok_s"], color="gray", ls="--", label="HF generate_batch")
    if runs:
        ideal = runs[0]["roofline"]["ideal_tok_s"]
        ax.set_title(f"memory roofline {ideal:,.0f} tok/s at {result['bandwidth']['bytes_per_s'] / 1e9:,.0f} GB/s "
                     f"(copy)", fontsize=9)
    w = result["workload"]
    common.finish_plot(fig, ax, xs, "max_num_seqs", "output throughput (tok/s)",
                       f"graphinfer bench throughput: {result['model']} {result['dtype']} on "
                       f"{result['env']['device_name']}\n{w['num_prompts']} prompts, {w['prompt_tokens']:,} prompt / "
                       f"{w['output_tokens']:,} output tokens", path)


def _plot_lora(result: dict, path: str) -> None:
    """A LoRA run: output tok/s per row (bars), the engine without LoRA first; vs base over each bar."""
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "unavailable" not in r]
    label = _label(runs)
    names = [label(r).replace(" + LoRA x", "\nLoRA x").replace(" (no LoRA)", "\nno LoRA") for r in runs]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs) + 2), 4.5))
    bars = ax.bar(range(len(runs)), [r["output_tok_s"] for r in runs],
                  color=["gray" if not r["enable_lora"] else "C0" for r in runs])
    for bar, r in zip(bars, runs):
        if r.get("vs_base") is not None:
            ax.annotate(f"{r['vs_base']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)), names, fontsize=8)
    ax.set(ylabel="output throughput (tok/s)", ylim=(0, None))
    ax.grid(True, axis="y", alpha=0.3)
    w, lo = result["workload"], result["lora"]
    fig.suptitle(f"graphinfer bench throughput, LoRA (rank <= {lo['max_lora_rank']}, max_loras {lo['max_loras']}): "
                 f"{result['model'] or 'SmolLM2'} {result['dtype']} on {result['env']['device_name']}\n"
                 f"{w['num_prompts']} prompts, {w['prompt_tokens']:,} prompt / {w['output_tokens']:,} output tokens",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- HF transformers' continuous batching (generate_batch) on the same weights and prompts -----
def same_weights_checkpoint(model: str, dtype: torch.dtype, seed: int, tmp: str) -> str:
    """A checkpoint every engine (HF, graphinfer's models, the transformers path) loads: a preset becomes a saved
    random HF model, a GGUF the HF model transformers dequantizes it to; directories are used as they are."""
    from transformers import AutoModelForCausalLM

    from graphinfer.models.presets import preset_config

    config = preset_config(model)
    if config is not None:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(tmp)
        print(f"note: preset {model} saved with random weights to {tmp} for both engines")
    elif model.endswith(".gguf"):
        from transformers import AutoTokenizer

        folder, name = os.path.split(model)
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        del gguf.config.quantization_config  # dequantized: saved as plain weights
        hf = AutoModelForCausalLM.from_config(gguf.config, dtype=dtype)
        hf.load_state_dict(gguf.state_dict())
        hf.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        print(f"note: {model} saved, dequantized, as an HF checkpoint in {tmp} for every engine")
    else:
        return model
    return tmp


def run_hf(path: str, dtype: torch.dtype, device: str, workload: Workload, temperature: float,
           cuda_graph: bool) -> dict:
    """model.generate_batch on the workload (one max_new_tokens for all, EOS disabled), after a small warm-up."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from graphinfer.errors import GraphinferError

    kw = dict(dtype=dtype, attn_implementation="paged|sdpa")
    if path.endswith(".gguf"):
        path, kw["gguf_file"] = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(path, **kw).to(device).eval()
    if not hasattr(hf, "generate_batch"):
        raise GraphinferError("--compare hf needs transformers' continuous batching (model.generate_batch, "
                              "transformers >= 4.56); upgrade transformers.")
    new = workload.max_tokens[0]
    gen = GenerationConfig(max_new_tokens=new, do_sample=temperature > 0, temperature=temperature or None,
                           eos_token_id=-1, pad_token_id=0)  # eos -1: none, like ignore_eos

    def cb_config():
        if device != "cpu":  # the defaults, as measured in docs/benchmarks.md (CUDA graphs: opt-in)
            return ContinuousBatchingConfig(use_cuda_graph=True, max_memory_percent=0.5) if cuda_graph else None
        # On CPU the defaults size the cache from host memory (minutes); size it to the workload instead.
        blocks = sum(-(-(len(p) + new) // 16) for p in workload.prompts) + 16
        return ContinuousBatchingConfig(block_size=16, num_blocks=blocks, max_batch_tokens=2048)

    sync = common.synchronize
    warm = [p[:16] for p in workload.prompts[:2]]
    hf.generate_batch(inputs=warm, generation_config=gen, continuous_batching_config=cb_config(), max_new_tokens=8)
    sync(device)
    start = time.perf_counter()
    res = hf.generate_batch(inputs=workload.prompts, generation_config=gen, continuous_batching_config=cb_config())
    sync(device)
    total = time.perf_counter() - start
    failed = [r.error for r in res.values() if r.error is not None]
    if len(res) < len(workload.prompts) or failed:
        raise GraphinferError(f"transformers generate_batch finished {len(res) - len(failed)} of "
                              f"{len(workload.prompts)} requests (first error: {failed[:1]}); see its log above.")
    tokens = sum(len(r.generated_tokens) for r in res.values())
    del hf
    return {"total_s": total, "output_tokens": tokens, "output_tok_s": tokens / total, "max_new_tokens": new,
            "attn_implementation": "paged|sdpa", "use_cuda_graph": cuda_graph, "do_sample": temperature > 0,
            "temperature": temperature}


def run(model: str, *, dtype: str = "auto", device: str = "auto", graph_modes=("NONE",), max_num_seqs=(256,),
        async_scheduling=(False,), tensor_parallel_size=(1,), data_parallel_size=(1,), quantization=(None,),
        speculative_config=(None,), structured_output=("none",), model_impl=("auto",), dataset: str = "random",
        parallel: dict | None = None,
        capture_sizes: list[int] | None = None, passes=("default",),
        num_prompts: int = 256, min_len: int = 100, max_len: int = 1024, fixed_output_len: int | None = None, max_model_len: int = 4096,
        max_num_batched_tokens: int = 8192, temperature: float = 0.6, seed: int = 0, compare_hf: bool = False,
        hf_cuda_graph: bool = False, output_json: str | None = None, plot_path: str | None = None,
        hf_dtype: str | None = None, kernels: str | None = None, block_size: int | None = None,
        enable_prefix_caching: bool = True, lora_modules: dict[str, str] | None = None, num_adapters: list[int] | None = None, max_loras: int | None = None,
        max_lora_rank: int | None = None, max_cpu_loras: int | None = None, command: str | None = None) -> dict:
    """Every (graph mode, async scheduling, max_num_seqs, tensor_parallel_size, data_parallel_size, quantization,
    speculative_config, structured_output, model_impl) configuration on the same workload (dataset "random": the standard one; "copy":
    bench/copy_workload.py, num_prompts passages of about min_len tokens to repeat) (the roofline counts unquantized
    weights); optionally HF too. parallel: the other parallel flags (enable_expert_parallel; nnodes, node_rank,
    master_addr, master_port for tp > 1). LoRA: num_adapters (e.g. [0, 1, 4, 8]) with lora_modules {name: PEFT
    adapter dir}: each configuration without enable_lora, then with it once per N (the module docstring); max_loras
    defaults to the largest N, max_lora_rank to the adapters' largest rank. command: the command line, for the JSON."""
    import tempfile

    from graphinfer.config import resolve_dtype
    from graphinfer.platforms import current_platform, platform_for_device

    if device == "auto":
        device = current_platform().device_type
    block_size = block_size or platform_for_device(device).default_block_size
    torch_dtype = resolve_dtype(dtype, device)
    lora = _lora_plan(lora_modules, num_adapters, max_loras, max_lora_rank, max_cpu_loras)
    if compare_hf and fixed_output_len is None:  # transformers' generate_batch takes one max_new_tokens
        print("note: --compare hf runs the fixed-output variant; using --fixed-output-len 512")
        fixed_output_len = 512
    with tempfile.TemporaryDirectory(prefix="graphinfer-bench-") as tmp:
        # HF needs a checkpoint with graphinfer's weights; a sweep saves re-drawing a preset's random weights.
        passes = [passes] if isinstance(passes, str) else list(passes)  # a sweep: e.g. MLA absorbed / expanded
        configs = [(mode, a, mns, tp, dp, q, sd, so, mi, pa, n) for mode in graph_modes for a in async_scheduling
                   for mns in max_num_seqs for tp in tensor_parallel_size for dp in data_parallel_size
                   for q in quantization for sd in speculative_config for so in structured_output for mi in model_impl
                   for pa in passes for n in (lora["rows"] if lora else [None])]
        # (the transformers path runs an HF checkpoint directory: a GGUF or a preset is saved as one)
        gi_model = same_weights_checkpoint(model, torch_dtype, seed, tmp) \
            if compare_hf or len(configs) > 1 or "transformers" in model_impl else model
        max_model_len = common.clamp_max_model_len(gi_model, max_model_len)
        vocab = _vocab_size(gi_model)
        extra_warmup = None
        if dataset == "copy":
            workload = copy_workload(gi_model, num_prompts, min_len, seed, vocab)
            extra_warmup = copy_workload(gi_model, min(num_prompts, 4), min_len, seed + 1, vocab, warmup=True)
        else:
            workload = standard_workload(num_prompts, min_len, max_len, fixed_output_len, seed, vocab)
        bandwidth = measure_bandwidth(device)  # before any engine: the copy buffers need free memory
        common.release(device)
        result = {"benchmark": "throughput", "model": model, "dtype": str(torch_dtype).replace("torch.", ""),
                  "env": common.environment(device), "machine": common.machine(), **common.git_commit(),
                  "command": command, "bandwidth": bandwidth, "roofline_model": roofline.MODEL,
                  "workload": {"dataset": dataset, "num_prompts": num_prompts, "min_len": min_len, "max_len": max_len,
                               "fixed_output_len": fixed_output_len, "seed": seed, "temperature": temperature,
                               "ignore_eos": workload.ignore_eos, "max_model_len": max_model_len, "kernels": kernels,
                               "block_size": block_size, "enable_prefix_caching": enable_prefix_caching,
                               "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens},
                  "runs": []}
        if lora:
            result["lora"] = {k: v for k, v in lora.items() if k != "rows"}
        print(f"workload: {num_prompts} prompts, {workload.prompt_tokens:,} prompt / {workload.output_tokens:,} output "
              f"tokens; copy bandwidth {bandwidth['bytes_per_s'] / 1e9:,.1f} GB/s on {result['env']['device_name']}")
        for mode, a, mns, tp, dp, q, sd, so, mi, pa, n in configs:
            sizes = capture_sizes  # the engine keeps the sizes each kind of graph can use
            kw = dict(dtype=dtype, device=device, graph_mode=mode, max_num_seqs=mns, capture_sizes=sizes,
                      async_scheduling=a, passes=pa, max_model_len=max_model_len,
                      max_num_batched_tokens=max_num_batched_tokens, seed=seed, kernels=kernels, block_size=block_size,
                      enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tp, data_parallel_size=dp,
                      quantization=q, speculative_config=sd, model_impl=mi, **(parallel or {}))
            row = {"graph_mode": mode, "async_scheduling": a, "max_num_seqs": mns, "tensor_parallel_size": tp,
                   "data_parallel_size": dp, "pipeline_parallel_size": kw.get("pipeline_parallel_size", 1),
                   "enable_expert_parallel": bool(kw.get("enable_expert_parallel")),
                   "quantization": q, "speculative_config": sd, "structured_output": so, "model_impl": mi,
                   "passes": pa, "capture_sizes": sizes}
            adapters = None
            if lora:  # n: None = the engine without enable_lora, else the number of adapters in the batch
                row["enable_lora"] = n is not None
                if n is not None:
                    kw.update(lora["engine"])
                    adapters = lora_requests(lora_modules or {}, n)
                    row.update(num_adapters=n, max_loras=lora["max_loras"], max_lora_rank=lora["max_lora_rank"],
                               adapters=[{"name": x.lora_name, "id": x.lora_int_id, "path": x.lora_path}
                                         for x in adapters])
            try:
                row.update(run_config(gi_model, kw, workload, temperature, bandwidth["bytes_per_s"], min_len,
                                      extra_warmup, so, adapters))
                if lora:
                    row["total_tok_s"] = (workload.prompt_tokens + row["output_tokens"]) / row["total_s"]
            except InvalidConfigError as e:  # e.g. PIECEWISE on CPU: no device graphs there
                row["unavailable"] = str(e)
            except Exception as e:  # noqa: BLE001 (a sweep keeps going, e.g. past an OOM, and still writes its JSON)
                if len(configs) == 1:
                    raise
                traceback.print_exc()
                row["unavailable"] = f"failed: {type(e).__name__}: {e}"
            common.release(device)
            result["runs"].append(row)
            print(_fmt_row(row), flush=True)
            common.write_json(output_json, result)  # so far: a run cut off by a time limit keeps its results
        if lora:
            _vs_base(result["runs"])
        if compare_hf:
            try:
                hf = run_hf(gi_model, resolve_dtype(hf_dtype or dtype, device), device, workload, temperature, hf_cuda_graph)
                print(f"HF generate_batch: {hf['output_tokens']:,} output tokens in {hf['total_s']:.2f} s "
                      f"= {hf['output_tok_s']:,.1f} tok/s")
                for r in result["runs"]:
                    if "unavailable" not in r:
                        r["vs_hf"] = r["output_tok_s"] / hf["output_tok_s"]
            except Exception as e:  # noqa: BLE001 (keep graphinfer's numbers: the JSON is still written)
                traceback.print_exc()
                hf = {"error": f"{type(e).__name__}: {e}"}
            hf["dtype"] = str(resolve_dtype(hf_dtype or dtype, device)).replace("torch.", "")
            result["hf"] = hf
            common.release(device)
    print("\n" + table(result))
    if lora:
        print("\n" + lora_table(result))
    common.write_json(output_json, result)
    if not any("unavailable" not in r for r in result["runs"]):
        raise InvalidConfigError("; ".join(dict.fromkeys(r["unavailable"] for r in result["runs"])))
    common.save_plot(plot, result, plot_path)
    return result


# ----- LoRA (issue 52): the same workload over N distinct adapters -----
def _lora_plan(lora_modules: dict[str, str] | None, num_adapters: list[int] | None, max_loras: int | None,
               max_lora_rank: int | None, max_cpu_loras: int | None) -> dict | None:
    """None without num_adapters / lora_modules; else the rows to run (None: the engine without enable_lora, then each
    N) and the enable_lora engine's settings (max_loras: the largest N unless given; max_lora_rank: the adapters'
    largest rank unless given)."""
    if not num_adapters and not lora_modules:
        return None
    if not num_adapters:  # --lora-modules alone: the base model, and every adapter given in one batch
        num_adapters = [0, len(lora_modules)]
    if any(n < 0 for n in num_adapters):
        raise InvalidConfigError(f"--num-adapters {','.join(map(str, num_adapters))}: counts must be >= 0.")
    if max(num_adapters) > 0 and not lora_modules:
        raise InvalidConfigError(f"--num-adapters {','.join(map(str, num_adapters))} needs adapters: pass "
                                 f"--lora-modules name=path ... (PEFT adapter directories; tools/make_lora_adapter.py "
                                 f"writes random ones).")
    largest = max(num_adapters)
    if max_loras is None:
        max_loras = max(1, largest)
    elif max_loras < largest:
        raise InvalidConfigError(f"--max-loras {max_loras} < {largest} adapters (--num-adapters): a step holds at most "
                                 f"max_loras adapters; give --max-loras >= {largest} or leave it unset.")
    if max_lora_rank is None:
        max_lora_rank = max([_adapter_rank(p) for p in (lora_modules or {}).values()] or [16])
    engine = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank,
              **({"max_cpu_loras": max_cpu_loras} if max_cpu_loras is not None else {})}
    return {"rows": [None, *num_adapters], "num_adapters": list(num_adapters), "max_loras": max_loras,
            "max_lora_rank": max_lora_rank, "max_cpu_loras": max_cpu_loras, "modules": dict(lora_modules or {}),
            "engine": engine}


def _adapter_rank(path: str) -> int:
    """The largest rank adapter_config.json gives (r and rank_pattern); 16 where it cannot be read (the engine's
    loader then says what is wrong with the adapter)."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 16


def lora_requests(lora_modules: dict[str, str], n: int) -> list:
    """N distinct adapters, ids 1..N, over the given name -> path pairs in order; past the last pair the paths are
    reused under new ids and names (name-K for id K), as vLLM's benchmark does."""
    from graphinfer.lora import LoRARequest

    pairs = list(lora_modules.items())
    out = []
    for i in range(1, n + 1):
        name, path = pairs[(i - 1) % len(pairs)]
        out.append(LoRARequest(name if i <= len(pairs) else f"{name}-{i}", i, path))
    return out


def _vs_base(runs: list[dict]) -> None:
    """Each measured row's output tok/s over that of the row without enable_lora of the same other settings."""
    key = lambda r: tuple(str(r.get(k)) for k in ("graph_mode", "async_scheduling", "max_num_seqs",  # noqa: E731
                                                  "tensor_parallel_size", "data_parallel_size", "quantization",
                                                  "speculative_config", "structured_output", "model_impl", "passes"))
    base = {key(r): r["output_tok_s"] for r in runs if not r.get("enable_lora") and "output_tok_s" in r}
    for r in runs:
        if "output_tok_s" in r and key(r) in base:
            r["vs_base"] = r["output_tok_s"] / base[key(r)]


def copy_workload(model: str, num_prompts: int, passage_tokens: int, seed: int, vocab_size: int | None,
                  warmup: bool = False) -> Workload:
    """bench/copy_workload.py's prompts, with the model's tokenizer where it has one. warmup: the warm-up's (its
    own instruction, so no prefix-cache hits on the timed prompts; at most 48 tokens each)."""
    from graphinfer.bench.copy_workload import INSTRUCTION, WARMUP_INSTRUCTION, copy_prompts, load_copy_tokenizer

    tokenizer = load_copy_tokenizer(model)
    prompts, max_tokens = copy_prompts(tokenizer, num_prompts, passage_tokens, seed, vocab_size or TOKEN_ID_MAX,
                                       WARMUP_INSTRUCTION if warmup else INSTRUCTION)
    # a real model's answer ends at its EOS, as a user's request would (past it, nothing is copied any more);
    # random weights (no tokenizer) run to max_tokens
    return Workload(prompts, [min(m, 48) for m in max_tokens] if warmup else max_tokens, ignore_eos=tokenizer is None)


def _vocab_size(model: str) -> int | None:
    from graphinfer.models.presets import preset_config

    config = preset_config(model)
    if config is not None:
        return config.vocab_size
    try:
        from graphinfer.models.loader import load_hf_config

        return load_hf_config(model).vocab_size
    except Exception:  # noqa: BLE001 (a .gguf: its vocabulary is larger than the standard's ids anyway)
        return None
