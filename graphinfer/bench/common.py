"""Shared by the offline benchmarks: engine lifecycle, a recorded engine-step loop, environment, tables."""
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from graphinfer.bench.roofline import row_kv_tokens


def model_context_len(model: str) -> int | None:
    """The model's own context length (max_position_embeddings), when it can be read without loading weights."""
    from graphinfer.models.presets import preset_config

    config = preset_config(model)
    if config is None and os.path.isfile(os.path.join(model, "config.json")):
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    return getattr(config, "max_position_embeddings", None)


def clamp_max_model_len(model: str, requested: int) -> int:
    """The standard 4096 unless the model's context is shorter (tiny presets: 1024)."""
    ctx = model_context_len(model)
    if ctx is not None and ctx < requested:
        print(f"note: max_model_len {requested} > {model}'s context {ctx}; using {ctx}")
        return ctx
    return requested


def release(device: torch.device | str) -> None:
    """Call after dropping the last reference to an LLM: collect it and return its device memory."""
    gc.collect()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "npu" and hasattr(torch, "npu"):
        torch.npu.empty_cache()


def synchronize(device: torch.device | str) -> None:
    from graphinfer.platforms import platform_for_device

    platform_for_device(torch.device(device).type).synchronize()


def environment(device: torch.device | str) -> dict:
    import graphinfer

    device = torch.device(device)
    name = platform.processor() or platform.machine()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "npu" and hasattr(torch, "npu"):
        name = torch.npu.get_device_name(device)
    return {"device": str(device), "device_name": name, "torch": torch.__version__,
            "graphinfer": graphinfer.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # shared machines: others' load
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# CPU features a CPU benchmark depends on (the VM's host changes: AVX2 only, AVX-512 with avx512_bf16, AMX)
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> dict:
    """The host: cpu model, the CPU_FLAGS it has, logical cores (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == (platform.processor() or platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cpu_count": os.cpu_count()}


def git_commit() -> dict:
    """The graphinfer checkout's commit (None outside a git checkout) and whether tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        return {"commit": head.stdout.strip(), "dirty": git("diff", "--quiet", "HEAD").returncode != 0}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


@dataclass
class StepRecord:
    kind: str  # "prefill" (any row computes prompt tokens or more than one token), "decode", "idle"
    seconds: float
    rows: int
    tokens: int
    kv_tokens: int  # roofline.row_kv_tokens summed over rows
    comm_seconds: float = 0.0  # host time of this process inside collective calls (parallel_state.comm_counters)
    comm_calls: int = 0


@dataclass
class StepLog:
    steps: list[StepRecord] = field(default_factory=list)
    # Data parallel: steps in which replica 0 (this process) scheduled nothing while other replicas had work (it
    # waited for their outputs, or in lockstep ran a padding-only step beside them); not in `steps`.
    idle: list[StepRecord] = field(default_factory=list)
    replicas: list[int] | None = None  # data parallel: the replica each request of the run was routed to

    def seconds(self, kind: str) -> float:
        return sum(s.seconds for s in self.steps if s.kind == kind)

    def comm_seconds(self, kind: str) -> float:
        return sum(s.comm_seconds for s in self.steps if s.kind == kind)

    def of(self, kind: str) -> list[StepRecord]:
        return [s for s in self.steps if s.kind == kind]

    def summary(self) -> dict:
        dec, pre = self.of("decode"), self.of("prefill")
        med = lambda xs: statistics.median(xs) * 1e3 if xs else None  # noqa: E731
        return {"num_steps": len(self.steps), "num_prefill_steps": len(pre), "num_decode_steps": len(dec),
                "prefill_s": self.seconds("prefill"), "decode_s": self.seconds("decode"),
                "mean_decode_batch": sum(s.rows for s in dec) / len(dec) if dec else None,
                "median_decode_step_ms": med([s.seconds for s in dec]),
                "median_prefill_step_ms": med([s.seconds for s in pre]),
                "idle_s": sum(s.seconds for s in self.idle), "num_idle_steps": len(self.idle)}

    def collective_summary(self) -> dict:
        """Time in collective calls (tensor parallel), split like the steps, and its share of the step time."""
        dec = self.of("decode")
        pre_s, dec_s = self.comm_seconds("prefill"), self.comm_seconds("decode")
        idle_s = sum(s.comm_seconds for s in self.idle)  # data parallel: replica 0's rounds with nothing of its own
        step_s = self.seconds("prefill") + self.seconds("decode") + sum(s.seconds for s in self.idle)
        return {"collective_s": pre_s + dec_s + idle_s, "collective_prefill_s": pre_s, "collective_decode_s": dec_s,
                "collective_idle_s": idle_s, "collective_calls": sum(s.comm_calls for s in self.steps + self.idle),
                "collective_fraction": (pre_s + dec_s + idle_s) / step_s if step_s else None,
                "collective_decode_fraction": dec_s / self.seconds("decode") if dec else None,
                "median_decode_step_collective_ms":
                    statistics.median(s.comm_seconds for s in dec) * 1e3 if dec else None}


def spec_decode_snapshot(engine) -> dict:
    """engine.spec_decode_stats() (a copy; {} without speculative decoding)."""
    return engine.spec_decode_stats()


def capture_seconds(engine) -> float | None:
    """Seconds rank 0's worker spent capturing device graphs (None: it captured none)."""
    d = engine.worker.dispatcher
    return sum(s.seconds for s in (d.capture_stats, d.piecewise_capture_stats) if s) or None


def spec_decode_delta(engine, before: dict) -> dict:
    """engine.spec_decode_stats() since `before` (an earlier spec_decode_snapshot), rates recomputed."""
    from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats

    return SpecDecodingStats.since(engine.spec_decode_stats(), before).as_dict()


def run_steps(engine, log: StepLog, until=None, sync=None) -> list:
    """LLM.generate's loop over engine.step(), timing each step and classifying it by what was scheduled.

    The classification wraps this engine's scheduler.schedule (an instance attribute, undone on exit), so
    the runtime is measured as is. engine.step() ends with the sampled ids' .tolist(), a device sync, so a
    step's wall time covers its device work; `sync` (the device's synchronize) also brackets each step.
    (With async scheduling a step ends by waiting for the previous step's tokens, so its time is that of
    the device work it overlapped; pass no `sync` then.)
    Each step also records the host time this process spent inside collective calls (tensor parallel; 0 at tp 1).
    A data-parallel engine (runtime/engine/dp_core.py) is seen through replica 0's scheduler: the steps in which
    it scheduled nothing while other replicas had work go to log.idle, not log.steps.
    `until(outputs)` may stop the loop early. Returns the finished RequestOutputs."""
    from graphinfer.distributed.parallel_state import comm_counters

    sched = engine.local_core.scheduler  # data parallel: replica 0's
    data_parallel = engine.config.parallel_config.data_parallel_size > 1
    current: list = []

    def schedule():
        out = sched.__class__.schedule(sched)
        # a decode row computes one token, plus its drafts with speculative decoding
        rows = [(s.start, s.num_tokens, s.seq.num_prompt_tokens, len(s.seq.spec_token_ids)) for s in out.scheduled]
        prefill = any(start < prompt or n > 1 + k for start, n, prompt, k in rows)
        kind = "prefill" if prefill else "decode" if rows else "idle"
        current.append(StepRecord(kind, 0.0, len(rows), out.num_tokens,
                                  sum(row_kv_tokens(start, n) for start, n, _, _ in rows)))
        return out

    finished = []
    sched.schedule = schedule
    try:
        while engine.has_unfinished_requests():
            if sync:
                sync()
            comm_s, comm_n = comm_counters()
            t = time.perf_counter()
            outs = engine.step()
            if sync:
                sync()
            dt = time.perf_counter() - t
            # none: a data-parallel front end whose replica 0 has no work only waited for the other replicas' outputs
            rec = current.pop() if current else StepRecord("idle", 0.0, 0, 0, 0)
            rec.seconds = dt
            comm_s2, comm_n2 = comm_counters()
            rec.comm_seconds, rec.comm_calls = comm_s2 - comm_s, comm_n2 - comm_n
            if rec.kind == "idle" and data_parallel:
                log.idle.append(rec)
            elif rec.kind == "idle" and log.steps:  # it only waited for the step before (async scheduling)
                prev = log.steps[-1]
                prev.seconds += dt
                prev.comm_seconds += rec.comm_seconds
                prev.comm_calls += rec.comm_calls
            else:
                log.steps.append(rec)
            finished.extend(o for o in outs if o.finished)
            if until is not None and until(outs):
                break
    finally:
        del sched.schedule
    return finished


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at |x| (bf16: 1.0 for |x| in [128, 256))."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(abs(x))) if abs(x) >= info.tiny else info.tiny


def compare_tie_aware(ref: list[list[int]], ref_logprobs: list, got: list[list[int]], tie: float = 1e-3,
                      logits_dtype: torch.dtype | None = None) -> dict:
    """Requests whose tokens are identical, or first differ where the reference's top-2 are tied and the other
    token is the reference's runner-up (random bf16 weights give exact ties: either token is right, and the
    sequences then diverge). ref_logprobs: the reference's per-position {token: Logprob} (>= 2). Tied: within
    `tie` (log-probs), or, with logits_dtype (ref_logprobs from logprobs_mode="raw_logits"), within one ulp of
    the larger logit in that dtype: the compute dtype cannot order two logits closer than that."""
    identical = ties = 0
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            identical += 1
            continue
        pos = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        top = sorted((lp.logprob for lp in ref_logprobs[i][pos].values()), reverse=True)[:2]
        limit = tie if logits_dtype is None or len(top) < 2 else ulp(max(abs(top[0]), abs(top[1])), logits_dtype)
        if len(top) == 2 and top[0] - top[1] <= limit and b[pos] in ref_logprobs[i][pos]:
            ties += 1
        else:
            mismatches.append(dict(request=i, position=pos, ref_top2=top, tie_limit=limit))
    return dict(identical=identical, tie_divergences=ties, mismatches=mismatches, ok=not mismatches)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """Cells as given (strings), None as '-', floats with one decimal."""
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def finish_plot(fig, ax, xs: list, xlabel: str, ylabel: str, title: str, path: str) -> None:
    """The benchmarks' shared axes (log2 x over the measured points, y from 0), legend, title, PNG."""
    import matplotlib.pyplot as plt

    if len(xs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set(xlabel=xlabel, ylabel=ylabel, ylim=(0, None))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_plot(plot_fn, result: dict, path: str | None) -> None:
    """plot_fn(result, path), or a note when matplotlib is missing (device images): the JSON can be plotted later."""
    if not path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"note: matplotlib is not installed, no {path}; plot the JSON later with "
              f"{plot_fn.__module__}.{plot_fn.__name__}(json.load(open(JSON)), PNG)")
        return
    plot_fn(result, path)
