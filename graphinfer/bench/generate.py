"""`graphinfer bench generate`: offline generation throughput, graphinfer vs HF transformers' generate.

Same model file, dtype, prompts and number of new tokens, in one process, so the comparison is fair:
both generate exactly max_tokens tokens per prompt (graphinfer: ignore_eos; HF: min_new_tokens).
"""
import json
import os
import platform
import time

import torch

PROMPTS = [
    "The capital of France is",
    "Write a Python function that checks whether a number is prime.",
    "Explain in simple words why the sky is blue.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "List five fruits and their colours:",
    "What are the main differences between a list and a tuple in Python? Answer briefly.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Translate to French: 'The weather is nice today, and I would like to take a walk along the river.'",
]


def _prompts(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_graphinfer(llm, batch: int, max_tokens: int, repeats: int) -> float:
    from graphinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return _time(lambda: llm.generate(_prompts(batch), params, use_tqdm=False), repeats)


def load_hf(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path.endswith(".gguf"):
        d, name = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.eval()


def bench_hf(model, tokenizer, batch: int, max_tokens: int, repeats: int) -> float:
    tokenizer.padding_side = "left"
    enc = tokenizer(_prompts(batch), return_tensors="pt", padding=True)

    def run():
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    return _time(run, repeats)


def run(model: str, dtype: str, batch_sizes: list[int], max_tokens: int, repeats: int, compare_hf: bool,
        output_json: str | None, passes: list[str] = ("default",)) -> dict:
    """graphinfer with each pass list in `passes` (the first is the headline), and optionally HF, per batch size."""
    from graphinfer import LLM

    llms = {p: LLM(model, dtype=dtype, passes=p) for p in passes}
    engine = llms[passes[0]].llm_engine
    hf = load_hf(engine.config.model_config.model, engine.config.model_config.torch_dtype) if compare_hf else None
    rows = []
    for batch in batch_sizes:
        row = {"batch": batch, "max_tokens": max_tokens}
        for p, llm in llms.items():
            secs = bench_graphinfer(llm, batch, max_tokens, repeats)
            row[f"passes={p}_tok_s"] = batch * max_tokens / secs
        row["graphinfer_tok_s"] = row[f"passes={passes[0]}_tok_s"]
        if hf is not None:
            secs = bench_hf(hf, engine.tokenizer, batch, max_tokens, repeats)
            row["hf_s"], row["hf_tok_s"] = secs, batch * max_tokens / secs
            row["speedup_vs_hf"] = row["graphinfer_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(json.dumps(row))
    result = {
        "benchmark": "generate", "model": engine.config.model_config.model,
        "dtype": str(engine.config.model_config.torch_dtype), "device": engine.config.model_config.device,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "repeats": repeats, "passes": list(passes), "rows": rows,
    }
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
