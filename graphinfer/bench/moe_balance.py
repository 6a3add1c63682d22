"""`graphinfer bench moe-balance`: how evenly a MoE model's router spreads the standard workload's tokens over
its experts, and over the ranks of expert parallelism of a given size.

A statistic of the routing, not a parallel run: the experts' token counts (runtime/expert_load.py) of one
engine are partitioned as vLLM places experts by default (contiguously: EP rank r owns experts
[r * E / N, (r + 1) * E / N)), so any EP size is evaluated on one device, even a CPU. Imbalance is max / mean
tokens per rank (per expert): 1.0 is perfect balance, and the slowest rank of an EP step does that many times
the average work. This is the input EPLB (vLLM-Ascend's expert load balancer) rebalances from.

--eplb runs it for real instead: ep_size ranks (tensor parallel x expert parallel, processes over gloo on a CPU), EPLB
on (eplb_config; default num_redundant_experts = ep_size, a rearrangement every 20 steps on the last 10), and reports
beside the whole run's contiguous-placement imbalance the last EPLB window's measured EP-rank imbalance, the same
window's under the contiguous placement, and the cost of rebalancing: rearrangements, bytes moved between ranks and
seconds per rearrangement (runtime/worker/eplb_state.py).
"""
from graphinfer.bench import common
from graphinfer.bench.throughput import _vocab_size, standard_workload, timed_generate
from graphinfer.errors import InvalidConfigError
from graphinfer.runtime.worker.expert_load import tokens_per_rank


def table(summary: dict) -> str:
    """Per layer: tokens per EP rank, the rank and expert imbalance; then tokens per expert."""
    n = summary["ep_size"]
    rows = [[layer, v["tokens"], " ".join(map(str, v["tokens_per_rank"])), f"{v['rank_imbalance']:.3f}",
             f"{v['expert_imbalance']:.3f}"] for layer, v in summary["layers"].items()]
    out = common.markdown_table(["layer", "tokens x top_k", f"tokens per EP rank (ep_size {n})", "rank imbalance",
                                 "expert imbalance"], rows)
    experts = "\n".join(f"layer {layer}: {' '.join(map(str, v['tokens_per_expert']))}"
                        for layer, v in summary["layers"].items())
    return (f"{out}\nmean rank imbalance {summary['mean_rank_imbalance']:.3f}, worst layer "
            f"{summary['max_rank_imbalance']:.3f}\n\ntokens per expert:\n{experts}")


def eplb_table(stats: dict) -> str:
    """The last EPLB window's EP-rank imbalance with and without EPLB, and what rebalancing cost."""
    last, n = stats["last"], stats["rearrangements"]
    if not n:
        return "EPLB: no rearrangement ran (the workload took fewer steps than step_interval)"
    later = stats["history"][1:]  # windows counted under a placement EPLB chose (the first: the initial one)
    mean = (lambda key: sum(h[key] for h in later) / len(later)) if later else None
    rows = [[n, f"{last['rank_imbalance']:.3f}", f"{last['rank_imbalance_without_eplb']:.3f}",
             f"{mean('rank_imbalance'):.3f} / {mean('rank_imbalance_without_eplb'):.3f}" if mean else "-",
             f"{stats['moved_bytes_total'] / n / 2**20:.2f}", f"{stats['seconds_total'] / n:.4f}"]]
    return "EPLB:\n" + common.markdown_table(
        ["rearrangements", "last window's EP-rank imbalance", "same load, contiguous",
         "mean over EPLB-placed windows: with / contiguous", "MiB moved / rearrangement", "s / rearrangement"], rows)


def run(model: str, *, ep_size: int = 1, dtype: str = "auto", device: str = "auto", num_prompts: int = 64,
        min_len: int = 100, max_len: int = 1024, fixed_output_len: int | None = None, max_model_len: int = 4096,
        max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, graph_mode: str = "NONE",
        temperature: float = 0.6, seed: int = 0, output_json: str | None = None, eplb: bool = False,
        eplb_config: dict | None = None, **engine_kwargs) -> dict:
    """Run the standard workload (bench throughput's draws) once and return (and print, and write as JSON) the
    expert load of every MoE layer at ep_size; eplb: on ep_size expert-parallel ranks with EPLB, and its statistics."""
    from graphinfer import LLM
    from graphinfer.platforms import current_platform

    if device == "auto":
        device = current_platform().device_type
    max_model_len = common.clamp_max_model_len(model, max_model_len)
    workload = standard_workload(num_prompts, min_len, max_len, fixed_output_len, seed, _vocab_size(model))
    if eplb:
        if ep_size < 2:
            raise InvalidConfigError("bench moe-balance --eplb runs ep_size expert-parallel ranks: give --ep-size >= 2.")
        eplb_config = {"window_size": 10, "step_interval": 20, "num_redundant_experts": ep_size, **(eplb_config or {})}
        engine_kwargs.update(tensor_parallel_size=ep_size, enable_expert_parallel=True, enable_eplb=True,
                             eplb_config=eplb_config)
    llm = LLM(model, dtype=dtype, device=device, graph_mode=graph_mode, max_num_seqs=max_num_seqs,
              max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
    try:
        engine = llm.llm_engine
        if not engine.worker.model_runner.moe_layers:
            raise InvalidConfigError(f"{model!r} has no MoE layers, so there is no expert load to measure; use a MoE "
                                     f"model (e.g. tiny-qwen3-moe, a Qwen3-MoE checkpoint).")
        tokens_per_rank([0] * next(iter(engine.worker.model_runner.moe_layers.values())).global_num_experts,
                        ep_size)  # fits?
        engine.reset_expert_load()
        stats, _ = timed_generate(llm, workload, temperature)
        summary = engine.expert_load_summary(ep_size)
        eplb_stats = engine.eplb_stats() if eplb else None
    finally:
        llm.shutdown()
    result = {"benchmark": "moe_balance", "model": model, "env": common.environment(device),
              "workload": {"num_prompts": num_prompts, "min_len": min_len, "max_len": max_len,
                           "fixed_output_len": fixed_output_len, "seed": seed, "temperature": temperature,
                           "prompt_tokens": workload.prompt_tokens, "output_tokens": stats["output_tokens"]},
              "placement": "contiguous (EP rank r owns experts [r*E/ep_size, (r+1)*E/ep_size))",
              "expert_load": summary}
    print(table(summary))
    if eplb_stats is not None:
        result["eplb"] = eplb_stats
        print(eplb_table(eplb_stats))
    common.write_json(output_json, result)
    return result
