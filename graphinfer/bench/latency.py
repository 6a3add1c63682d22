"""`graphinfer bench latency`: decode step latency per batch size, NONE vs FULL_DECODE_ONLY.

For each graph mode one engine (max_num_seqs = the largest batch); for each batch size B, B requests
with a short random prompt, ignore_eos and enough max_tokens are added, the prefill step(s) run, and
then engine.step() is timed, device synchronised before and after, over pure decode steps of exactly
B rows: `warmup_steps` are dropped, the median of the next `num_steps` is the step latency. A graph
mode the platform cannot run (FULL_DECODE_ONLY on CPU) is reported as unavailable.

With speculative decoding a step emits up to 1 + k tokens per request, so each batch also reports the tokens the
timed steps emitted: tok/s (emitted / time), TPOT (time per emitted token of a request) and the drafts' acceptance.
dataset "copy": the requests are bench/copy_workload.py's passages to repeat (prompt_len ~ the passage length), where
lookup finds its drafts; "random": random token ids.
"""
import random
import statistics

from graphinfer.bench import common
from graphinfer.errors import GraphinferError, InvalidConfigError


def measure_batch(llm, batch: int, prompt_len: int, warmup_steps: int, num_steps: int, temperature: float,
                  seed: int, dataset: str = "random") -> dict:
    from graphinfer import SamplingParams
    from graphinfer.bench.copy_workload import copy_prompts

    engine = llm.llm_engine
    rng = random.Random(seed + batch)  # fresh ids per batch: no prefix-cache hits from the previous one
    vocab = engine.hf_config.vocab_size
    spec = engine.config.speculative_config
    per_step = 1 + (spec.num_speculative_tokens if spec else 0)  # enough tokens for every timed step to emit all
    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=(warmup_steps + num_steps + 2) * per_step)
    if dataset == "copy":
        prompts = copy_prompts(engine.tokenizer, batch, prompt_len, seed + batch, vocab)[0]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    seqs = [engine.make_sequence(p, params) for p in prompts]
    for seq in seqs:
        engine.add_sequence(seq)
    log = common.StepLog()
    need = warmup_steps + num_steps
    emitted = []  # tokens of the batch after each step

    def until(_):
        emitted.append(sum(len(s.output_token_ids) for s in seqs))
        return len(log.of("decode")) >= need
    try:
        common.run_steps(engine, log, until=until, sync=engine.platform.synchronize)
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
    # the decode steps are the last ones run: their tokens are what the last `num_steps` steps added
    tokens = emitted[-1] - emitted[-1 - num_steps]
    seconds = sum(s.seconds for s in steps)
    return {"batch": batch, "median_ms": med, "mean_ms": statistics.fmean(ms), "min_ms": ms[0],
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "tok_s": tokens / seconds, "tokens_per_step": tokens / len(ms),
            "tpot_ms": seconds * 1e3 / (tokens / batch), "steps": len(ms)}


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
    result = {"benchmark": "latency", "model": model, "dtype": str(resolve_dtype(dtype, device)).replace("torch.", ""),
              "env": common.environment(device), "batch_sizes": batch_sizes, "graph_modes": list(graph_modes),
              "prompt_len": prompt_len, "warmup_steps": warmup_steps, "num_steps": num_steps,
              "temperature": temperature, "quantization": quantization, "dataset": dataset, "modes": {}}
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
        entry = {"capture_s": sum(s.seconds for s in (engine.capture_stats, engine.piecewise_capture_stats) if s) or None,
                 "skinny_gemm": engine.skinny_gemm.to_json() if engine.skinny_gemm else None, "batches": [],
                 "graph_mode": mode, "speculative_config": spec}
        for b in batch_sizes:
            before = dict(engine.spec_decode_stats())
            m = measure_batch(llm, b, prompt_len, warmup_steps, num_steps, temperature, seed, dataset)
            if spec:
                m["spec_decode"] = common.spec_decode_delta(engine, before)
            entry["batches"].append(m)
            print(f"{name} batch {b}: decode step median {m['median_ms']:.3f} ms, {m['tokens_per_step']:.2f} tokens "
                  f"per step, {m['tok_s']:,.1f} tok/s, TPOT {m['tpot_ms']:.2f} ms", flush=True)
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


def table(result: dict) -> str:
    modes = list(result["modes"])
    ratio = "NONE" in modes and "FULL_DECODE_ONLY" in modes
    headers = ["batch"] + [f"{m} step ms (tok/s)" for m in modes] + (["NONE / FULL_DECODE_ONLY"] if ratio else [])
    rows = []
    for i, r in enumerate(result["rows"]):
        cells = [r["batch"]]
        for m in modes:
            e = result["modes"][m]
            if "unavailable" in e:
                cells.append("unavailable")
            else:
                b = e["batches"][i]
                cells.append(f"{b['median_ms']:.3f} ({b['tok_s']:,.0f})")
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
