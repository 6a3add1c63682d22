"""`graphinfer bench latency`: decode step latency per batch size, NONE vs FULL_DECODE_ONLY.

For each graph mode one engine (max_num_seqs = the largest batch); for each batch size B, B requests
with a short random prompt, ignore_eos and enough max_tokens are added, the prefill step(s) run, and
then engine.step() is timed, device synchronised before and after, over pure decode steps of exactly
B rows: `warmup_steps` are dropped, the median of the next `num_steps` is the step latency. A graph
mode the platform cannot run (FULL_DECODE_ONLY on CPU) is reported as unavailable.

Speculative decoding (`speculative_config`: each graph mode is measured without, then with each config given, one
engine each): a step verifies up to k drafts per request and emits 1 + accepted tokens, so the step latency alone
misleads. Every batch (with or without) also reports the tokens the timed steps emitted: tokens_per_step (all rows),
tok_s = tokens_per_step / median step time, tpot_ms = median step time / (tokens_per_step / B) (time per output
token of one request), and the drafts' acceptance of those steps: acceptance_rate (accepted / drafted) and
mean_acceptance_length (1 + accepted / drafts, vLLM's definition; 1 without speculative decoding), with the
engine's counters over the timed steps in spec_decode.
dataset "random": prompts of `prompt_len` random token ids. "copy": bench/copy_workload.py's passages to repeat
(SmolLM2: a chat prompt asking to repeat a passage of the fixed text; presets: a literally repeated id passage),
where lookup finds its drafts; the passage is `prompt_len` tokens, raised to what the timed steps can emit
((warmup_steps + num_steps + 2) x (1 + the largest k)) so the measured steps copy rather than run past the passage.
"""
import random
import statistics

from graphinfer.bench import common
from graphinfer.errors import GraphinferError, InvalidConfigError


def measure_batch(llm, batch: int, prompt_len: int, warmup_steps: int, num_steps: int, temperature: float,
                  seed: int, dataset: str = "random", max_spec_tokens: int = 0) -> dict:
    from graphinfer import SamplingParams
    from graphinfer.bench.copy_workload import copy_prompts

    engine = llm.llm_engine
    rng = random.Random(seed + batch)  # fresh ids per batch: no prefix-cache hits from the previous one
    vocab = engine.hf_config.vocab_size
    # enough tokens for every step to emit all its drafts; the same prompts with and without speculative decoding.
    # A batch whose prompts take several prefill steps starts decoding its first requests while later ones still
    # prefill: those steps' tokens come on top (else the first requests finish before the timed steps).
    extra_prefill_steps = -(-batch * prompt_len // engine.config.scheduler_config.max_num_batched_tokens) - 1
    max_tokens = (warmup_steps + num_steps + 2 + extra_prefill_steps) * (1 + max_spec_tokens)
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens)
    if dataset == "copy":
        prompts = copy_prompts(engine.tokenizer, batch, max(prompt_len, max_tokens), seed + batch, vocab)[0]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    seqs = [engine.make_request(p, params) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    log = common.StepLog()
    need = warmup_steps + num_steps
    emitted = []  # tokens of the batch after each step
    spec_at = [common.spec_decode_snapshot(engine)] if warmup_steps == 0 else []  # the counters before the timed steps

    states = engine.output_processor.requests  # the tokens each request has got so far

    def until(_):
        emitted.append(sum(len(states[s.request_id].output_token_ids) for s in seqs))
        if len(log.of("decode")) == warmup_steps and not spec_at:
            spec_at.append(common.spec_decode_snapshot(engine))
        return len(log.of("decode")) >= need
    try:
        common.run_steps(engine, log, until=until, sync=engine.local_core.platform.synchronize)
    finally:
        for seq in seqs:
            engine.abort_request(seq.request_id)
    steps = log.of("decode")[warmup_steps:need]
    if len(steps) < num_steps or any(s.rows != batch for s in steps):
        raise GraphinferError(f"batch {batch}: got {len(steps)} decode steps with rows "
                              f"{sorted({s.rows for s in steps})}, wanted {num_steps} of {batch} rows; "
                              f"is the KV cache large enough?")
    ms = sorted(s.seconds * 1e3 for s in steps)
    med = statistics.median(ms)
    # the timed decode steps are the last ones run: their tokens are what the last `num_steps` steps added
    per_step = (emitted[-1] - emitted[-1 - num_steps]) / num_steps
    m = {"batch": batch, "median_ms": med, "mean_ms": statistics.fmean(ms), "min_ms": ms[0],
         "p90_ms": ms[int(0.9 * (len(ms) - 1))], "tok_s": per_step / med * 1e3, "tokens_per_step": per_step,
         "tpot_ms": med / (per_step / batch), "steps": len(ms), "prompt_tokens": sum(map(len, prompts)),
         "acceptance_rate": None, "mean_acceptance_length": 1.0}
    if engine.config.speculative_config is not None:  # the timed steps' drafts
        m["spec_decode"] = sd = common.spec_decode_delta(engine, spec_at[0])
        if sd["num_drafts"]:  # else: no draft proposed, every step emitted 1 token per row
            m["acceptance_rate"], m["mean_acceptance_length"] = sd["acceptance_rate"], sd["mean_acceptance_length"]
    return m


def run(model: str, *, dtype: str = "auto", device: str = "auto", batch_sizes=(1, 8, 64, 256),
        graph_modes=("NONE", "FULL_DECODE_ONLY"), capture_sizes: list[int] | None = None, passes: str = "default",
        prompt_len: int = 32, warmup_steps: int = 5, num_steps: int = 30, max_model_len: int = 4096,
        temperature: float = 0.6, seed: int = 0, output_json: str | None = None, plot_path: str | None = None,
        quantization: str | None = None, speculative_config=(None,), dataset: str = "random") -> dict:
    """Per graph mode and speculative config (None: without), every batch size."""
    from graphinfer import LLM
    from graphinfer.config import resolve_dtype
    from graphinfer.platforms import current_platform

    if device == "auto":
        device = current_platform().device_type
    batch_sizes = sorted(batch_sizes)
    max_model_len = common.clamp_max_model_len(model, max_model_len)  # as the throughput runs: same graph shapes
    result = {"benchmark": "latency", "model": model, "speculative_configs": list(speculative_config),
              "dtype": str(resolve_dtype(dtype, device)).replace("torch.", ""),
              "env": common.environment(device), "batch_sizes": batch_sizes, "graph_modes": list(graph_modes),
              "prompt_len": prompt_len, "warmup_steps": warmup_steps, "num_steps": num_steps,
              "temperature": temperature, "quantization": quantization, "dataset": dataset, "modes": {}}
    max_k = max((s.get("num_speculative_tokens", 0) for s in speculative_config if s), default=0)
    for mode, spec in [(m, s) for m in graph_modes for s in speculative_config]:
        name = mode + (f" + {spec.get('method') or 'draft_model'} k={spec.get('num_speculative_tokens')}" if spec else "")
        try:
            llm = LLM(model, dtype=dtype, device=device, graph_mode=mode, max_num_seqs=batch_sizes[-1],
                      capture_sizes=capture_sizes, passes=passes, max_model_len=max_model_len, seed=seed,
                      quantization=quantization, speculative_config=spec)
        except InvalidConfigError as e:  # FULL_DECODE_ONLY on a platform without device graphs
            result["modes"][name] = {"unavailable": str(e)}
            print(f"{name}: unavailable ({e})")
            continue
        engine = llm.llm_engine
        skinny = engine.worker.compiled.skinny_gemm
        entry = {"capture_s": common.capture_seconds(engine), "skinny_gemm": skinny.to_json() if skinny else None,
                 "batches": [],
                 "graph_mode": mode, "speculative_config": spec}
        for b in batch_sizes:
            m = measure_batch(llm, b, prompt_len, warmup_steps, num_steps, temperature, seed, dataset, max_k)
            entry["batches"].append(m)
            print(f"{name} batch {b}: decode step median {m['median_ms']:.3f} ms, {m['tokens_per_step']:.2f} tokens "
                  f"per step, {m['tok_s']:,.1f} tok/s, TPOT {m['tpot_ms']:.2f} ms" + _acceptance(m), flush=True)
        result["modes"][name] = entry
        common.write_json(output_json, result)  # so far: a run cut off by a time limit keeps its results
        del llm
        common.release(device)
    result["rows"] = _rows(result)
    print("\n" + table(result))
    common.write_json(output_json, result)
    common.save_plot(plot, result, plot_path)
    return result


def _rows(result: dict) -> list[dict]:
    """Per batch: each mode's median ms and, with both modes measured, NONE / FULL_DECODE_ONLY."""
    rows = []
    for i, b in enumerate(result["batch_sizes"]):
        row = {"batch": b}
        for mode, entry in result["modes"].items():
            row[f"{mode}_ms"] = entry["batches"][i]["median_ms"] if "batches" in entry else None
        if row.get("NONE_ms") and row.get("FULL_DECODE_ONLY_ms"):
            row["ratio_none_over_full"] = row["NONE_ms"] / row["FULL_DECODE_ONLY_ms"]
        rows.append(row)
    return rows


def _acceptance(b: dict) -> str:
    if "spec_decode" not in b:
        return ""
    if b.get("acceptance_rate") is None:
        return ", no drafts proposed"
    return f", acceptance {b['acceptance_rate']:.0%}, mean acceptance length {b['mean_acceptance_length']:.2f}"


def table(result: dict) -> str:
    """Per batch: each mode's median step ms (tok/s); with speculative decoding also tokens per step and TPOT."""
    modes = list(result["modes"])
    ratio = "NONE" in modes and "FULL_DECODE_ONLY" in modes
    spec = any(e.get("speculative_config") for e in result["modes"].values())
    headers = ["batch"] + [f"{m} step ms (tok/s)" + (", tokens/step, TPOT ms" if spec else "") for m in modes] + (
        ["NONE / FULL_DECODE_ONLY"] if ratio else [])
    rows = []
    for i, r in enumerate(result["rows"]):
        cells = [r["batch"]]
        for m in modes:
            e = result["modes"][m]
            if "unavailable" in e:
                cells.append("unavailable")
            else:
                b = e["batches"][i]
                cells.append(f"{b['median_ms']:.3f} ({b['tok_s']:,.0f})" + (
                    f", {b['tokens_per_step']:.2f}, {b['tpot_ms']:.2f}" if spec else ""))
        if ratio:
            cells.append(f"{r['ratio_none_over_full']:.2f}x" if "ratio_none_over_full" in r else None)
        rows.append(cells)
    return common.markdown_table(headers, rows)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on servers / CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bs = result["batch_sizes"]
    for mode, entry in result["modes"].items():
        if "batches" in entry:
            ax.plot(bs, [b["median_ms"] for b in entry["batches"]], "o-", label=mode)
    common.finish_plot(fig, ax, bs, "decode batch size", "decode step latency, median (ms)",
                       f"graphinfer bench latency: {result['model']} {result['dtype']} on "
                       f"{result['env']['device_name']}", path)
