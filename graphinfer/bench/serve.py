"""`graphinfer bench serve`: load-test an OpenAI-compatible server (ours or vLLM) at several concurrency levels.

Each level sends num_prompts streaming /v1/completions requests with at most C in flight and reports
throughput plus TTFT / TPOT / E2E percentiles, like vLLM's benchmark_serving. Prompts are random token ids,
so no tokenizer is needed on either side; ignore_eos makes every request produce exactly max_tokens tokens.
"""
import asyncio
import json
import random
import time
from datetime import datetime, timezone

import httpx
import numpy as np

# Prompt token ids: the server exposes no vocab size, and the tiny presets have 512 (test checkpoints 256),
# so stay below 256 -- and above 100, clear of the special tokens real vocabularies put first.
TOKEN_IDS = (100, 256)


async def _request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming request: timings in seconds, completion tokens, and the error (status) if it failed."""
    res = {"ttft": None, "tpot": None, "e2e": None, "tokens": 0, "status": None, "error": None}
    chunks, first = 0, None
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        res["status"] = resp.status_code
        if resp.status_code != 200:
            res["error"] = (await resp.aread()).decode(errors="replace")[:200]
            return res
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                res["error"] = str(event["error"])[:200]
                return res
            if event.get("choices"):
                # With ignore_eos every choice chunk carries a token, even when its text is empty (no tokenizer,
                # or text held back for a stop string), so the first one marks the first token.
                chunks += 1
                first = first or time.perf_counter()
            if event.get("usage"):
                res["tokens"] = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    res["tokens"] = res["tokens"] or chunks  # servers that ignore include_usage: one chunk per token
    res["e2e"] = end - start
    if first is not None:
        res["ttft"] = first - start
        if res["tokens"] > 1:
            res["tpot"] = (end - first) / (res["tokens"] - 1)
    return res


async def _bounded(client, url, body, timeout: float) -> dict:
    # httpx's timeout is per read; wait_for bounds the whole request so a stuck stream cannot hang the run.
    try:
        return await asyncio.wait_for(_request(client, url, body), timeout)
    except asyncio.TimeoutError:
        return {"ttft": None, "tpot": None, "e2e": None, "tokens": 0, "status": None, "error": f"timeout {timeout}s"}
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return {"ttft": None, "tpot": None, "e2e": None, "tokens": 0, "status": None, "error": repr(e)[:200]}


def _stats(values: list, name: str, pcts=(50, 90, 99), mean=True) -> dict:
    ms = [v * 1000 for v in values if v is not None]
    out = {f"{name}_p{p}_ms": (float(np.percentile(ms, p)) if ms else None) for p in pcts}
    if mean:
        out[f"{name}_mean_ms"] = float(np.mean(ms)) if ms else None
    return out


async def _level(client, url: str, bodies: list[dict], c: int, timeout: float) -> dict:
    sem = asyncio.Semaphore(c)

    async def one(body):
        async with sem:
            return await _bounded(client, url, body, timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    duration = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": c, "requests": len(results), "errors": len(results) - len(ok),
            "error_statuses": sorted({str(r["status"]) for r in results if r["error"] is not None}),
            "first_error": next((r["error"] for r in results if r["error"] is not None), None),
            "duration_s": duration, "completion_tokens": tokens, "output_lens": [r["tokens"] for r in ok],
            "output_throughput_tok_s": tokens / duration, "request_throughput_req_s": len(ok) / duration,
            **_stats([r["ttft"] for r in ok], "ttft"), **_stats([r["tpot"] for r in ok], "tpot"),
            **_stats([r["e2e"] for r in ok], "e2e", (50, 99), mean=False)}


async def _run(base: str, concurrency, num_prompts, prompt_len, max_tokens, model, seed, timeout) -> tuple[str, list]:
    limits = httpx.Limits(max_connections=max(concurrency) + 1, max_keepalive_connections=max(concurrency) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            r = await client.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        rng = random.Random(seed)

        def body():
            # A fresh prompt per request so the prefix cache can't turn a later level's prefill into a cache hit.
            return {"model": model, "prompt": [rng.randrange(*TOKEN_IDS) for _ in range(prompt_len)],
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}

        url = f"{base}/v1/completions"
        warm = await _bounded(client, url, body(), timeout)  # first-request costs (lazy init) stay out of level 1
        if warm["error"] is not None:
            raise RuntimeError(f"warm-up request to {url} failed (status {warm['status']}): {warm['error']}")
        levels = [await _level(client, url, [body() for _ in range(num_prompts)], c, timeout) for c in concurrency]
    return model, levels


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(levels: list[dict]) -> None:
    print("| C | reqs | err | dur s | out tok/s | req/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lv in levels:
        ttft = "/".join(_fmt(lv[f"ttft_p{p}_ms"]) for p in (50, 90, 99))
        tpot = "/".join(_fmt(lv[f"tpot_p{p}_ms"], ".2f") for p in (50, 90, 99))
        e2e = "/".join(_fmt(lv[f"e2e_p{p}_ms"]) for p in (50, 99))
        print(f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | {lv['duration_s']:.2f} | "
              f"{lv['output_throughput_tok_s']:.1f} | {lv['request_throughput_req_s']:.2f} | {ttft} | {tpot} | {e2e} |")


def plot_levels(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on servers / CI
    import matplotlib.pyplot as plt

    lv = result["levels"]
    cs = [x["concurrency"] for x in lv]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(cs, [x["output_throughput_tok_s"] for x in lv], "o-", color="tab:blue")
    ax1.set(ylabel="output throughput (tok/s)", title="throughput")
    for key, label, color in (("ttft_p50_ms", "TTFT p50", "tab:orange"), ("tpot_p50_ms", "TPOT p50", "tab:green")):
        ys = [x[key] if x[key] is not None else np.nan for x in lv]
        ax2.plot(cs, ys, "o-", label=label, color=color)
    # Log y: TTFT grows with queueing by orders of magnitude while TPOT stays in single-digit ms.
    ax2.set(ylabel="latency (ms, log)", title="latency (p50)", yscale="log")
    ax2.legend()
    ax1.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"graphinfer bench serve: {result['model']}  (prompt {result['prompt_len']} tok, "
                 f"{result['max_tokens']} new tok, {result['num_prompts']} prompts/level)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(url: str, concurrency: list[int], num_prompts: int, prompt_len: int, max_tokens: int, model: str | None,
        output_json: str | None, plot: str | None, seed: int = 0, timeout: float = 600.0) -> dict:
    """Benchmark the server at `url` (with or without /v1) at each concurrency level; returns the JSON dict."""
    base = url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    model, levels = asyncio.run(_run(base, list(concurrency), num_prompts, prompt_len, max_tokens, model, seed, timeout))
    result = {"benchmark": "serve", "url": base, "model": model, "num_prompts": num_prompts, "prompt_len": prompt_len,
              "max_tokens": max_tokens, "levels": levels, "date": datetime.now(timezone.utc).isoformat()}
    print_table(levels)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    if plot:
        plot_levels(result, plot)
    return result
