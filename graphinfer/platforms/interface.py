"""The Platform interface: what graphinfer needs to know about a device family.

A platform names its torch device type and device module, makes streams and device graphs, says which
collective backend to use, and picks the implementation of each `graphinfer::` op. Activating a platform
registers those implementations under its dispatch key, so the same fx graph runs the reference ops on
CPU tensors and the platform's kernels on its device tensors.
"""
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphinfer.config import GRAPH_MODES, default_capture_sizes


@dataclass(frozen=True)
class KernelBackend:
    """What a platform runs with one kernel choice (CompileConfig.kernels), as Platform.activate returns it: the
    compile pipeline, the graph dispatcher and the sampler ask it, not the platform with a kernels string."""
    name: str | None  # the kernel choice (None: the platform's default; "reference": the PyTorch reference ops)
    op_impls: dict[str, Callable] = field(default_factory=dict)  # registered under the platform's dispatch key
    sample_kernel: Callable | None = None  # the fused sampling kernel; None: the Sampler's torch path
    default_graph_mode: str = "NONE"
    graph_modes: tuple[str, ...] = ("NONE",)  # the graph modes it can run (config.GRAPH_MODES where it captures)
    skinny_gemm: bool = False  # the Triton skinny GEMM may serve decode linears (compiler/skinny_gemm.py measures)
    prepacked_linears: bool = False  # float linears on weights prepacked for the platform's GEMM library
    binds_op_impls: bool = False  # the runner's graph calls op_impls' functions directly (compiler/bind_ops.py)
    graph_compiler: str | None = None  # "inductor": the fused graph goes through compiler/inductor.py first
    mixed_kv_cache: bool = False  # the attention ops take a KV cache of another dtype than the model's (kv_cache_dtype)


class Platform:
    name: str = ""  # what GRAPHINFER_PLATFORM selects: "cpu", "cuda", "npu", or a plugin's name
    device_type: str = ""  # torch device type
    dispatch_key: str = ""  # the dispatch key its op implementations register under ("CUDA", "PrivateUse1")
    dist_backend: str = ""  # torch.distributed backend: gloo / nccl / hccl
    supports_graph_capture: bool = False  # whether graph modes other than NONE can capture device graphs here
    max_capture_graphs: int | None = None  # device graphs capturable in all (Ascend: its stream budget); None: no limit
    mc2_group: bool = False  # expert parallel wants parallel_state.MC2_GROUP (Ascend's MC2 ops)
    default_block_size: int = 16  # KV cache block size (tokens) when block_size is not given

    def __init__(self):
        self._impl_lib: torch.library.Library | None = None
        self.kernels: dict[str, str] = {}  # op name -> which implementation is registered (for reports)

    @classmethod
    def is_available(cls) -> bool:
        """Detection: can this platform run here? Must not import heavy vendor modules it does not need."""
        raise NotImplementedError

    # ----- device -----
    @property
    def device_module(self):
        """torch.cuda / torch.npu; None for cpu."""
        return None

    def synchronize(self) -> None:
        if self.device_module is not None:
            self.device_module.synchronize()

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return self.device_module.mem_get_info(device)

    def memory_allocated(self, device: torch.device) -> int:
        return self.device_module.memory_allocated(device) if self.device_module is not None else 0

    def memory_reserved(self, device: torch.device) -> int:
        """Bytes the caching allocator holds (allocated or kept for reuse)."""
        return self.device_module.memory_reserved(device) if self.device_module is not None else 0

    def max_memory_allocated(self, device: torch.device) -> int:
        """The allocator's peak allocated bytes since reset_peak_memory_stats (memory_allocated where the device
        module keeps no peak)."""
        peak = getattr(self.device_module, "max_memory_allocated", None)
        return peak(device) if peak is not None else self.memory_allocated(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        if (reset := getattr(self.device_module, "reset_peak_memory_stats", None)) is not None:
            reset(device)

    def empty_cache(self) -> None:
        """Give the caching allocator's unused memory back to the device (after an engine shut down)."""
        if self.device_module is not None:
            self.device_module.empty_cache()

    def populate_in_background(self, t: torch.Tensor) -> threading.Thread | None:
        """Start committing t's memory (the KV cache) in a thread; returns it (join() waits, stop() ends it early), or
        None where there is nothing to do (a device allocator commits memory as it allocates)."""
        return None

    def record_event(self, device: torch.device):
        """An event recorded on the current stream, for waiting on the work issued so far alone (async
        scheduling); None where work is done when the call returns (a cpu device)."""
        if device.type == "cpu":
            return None
        event = self.device_module.Event()
        event.record()
        return event

    # ----- device graphs -----
    def default_graph_mode(self, kernels: str | None = None) -> str:
        """vLLM's default where graphs can be captured: full graphs for decode, pieces for everything else."""
        return "FULL_AND_PIECEWISE" if self.supports_graph_capture and kernels != "reference" else "NONE"

    def graph_modes(self, kernels: str | None = None) -> tuple[str, ...]:
        """The graph modes this platform runs with these kernels: all where it captures device graphs."""
        return GRAPH_MODES if self.supports_graph_capture and kernels != "reference" else ("NONE",)

    def default_capture_sizes(self, max_size: int) -> list[int]:
        """The capture sizes when none are given: vLLM's list up to max_size."""
        return default_capture_sizes(max_size)

    def new_stream(self):
        return self.device_module.Stream()

    def graph_class(self) -> type:
        raise NotImplementedError(f"the {self.name} platform has no device graphs")

    def capture_session(self) -> contextlib.AbstractContextManager:
        """Around a loop that captures many graphs (one per size, or per piece and size)."""
        return contextlib.nullcontext()

    def graph_pool_handle(self):
        return self.device_module.graph_pool_handle()

    def graph_capture(self, graph, pool, stream) -> contextlib.AbstractContextManager:
        """Context manager that records the work issued inside it into `graph` (torch.cuda.graph and its kin)."""
        raise NotImplementedError(f"the {self.name} platform has no device graphs")

    def capture_graph(self, fn: Callable[..., object], args: tuple, pool, stream):
        """A graph of what fn(*args) issues, its replay() doing it again on the same tensors (graph_capture's)."""
        graph = self.graph_class()()
        with self.graph_capture(graph, pool, stream):
            fn(*args)
        return graph

    def capture_budget(self, comm_groups: int, graphs_per_size: int) -> int | None:
        """Device graphs capturable in all when the graphs hold collectives of `comm_groups` process groups (tensor
        parallel: 1), for sizes costing `graphs_per_size` graphs each; None: no limit."""
        return self.max_capture_graphs

    def before_graph_replay(self, graph, seq_lens) -> None:
        """Called right before `graph.replay()` with the step's host seq_lens for the graph's batch (numpy,
        padded rows 0). For kernels whose captured launches bake host-side arguments (Ascend FIA's lengths):
        patch them here. Default: nothing (CUDA kernels read their lengths from the static device buffers)."""

    # ----- ops -----
    def op_impls(self, kernels: str | None = None) -> dict[str, Callable]:
        """graphinfer op name -> implementation for this platform's tensors; ops left out use the reference.
        `kernels` is a platform-specific choice (e.g. npu: "triton" or "torch_npu", or per op)."""
        return {}

    def sampler_kernel(self, kernels: str | None = None) -> Callable | None:
        """The fused sampling kernel for this platform's tensors (graphinfer.ops.triton.sampling.sample, the
        Sampler's fast path), or None: the Sampler's torch path alone. Default: None."""
        return None

    def supports_skinny_gemm(self, kernels: str | None = None) -> bool:
        """Whether the Triton skinny GEMM (ops/triton/skinny_gemm.py) may serve this platform's decode linears
        (compiler/skinny_gemm.py decides where, by measurement). Default: no."""
        return False

    def has_fp8_gemm(self, device: torch.device) -> bool:
        """Whether fp8 x fp8 GEMMs run on `device` (tensor cores for float8_e4m3fn): block-FP8 checkpoints are then
        kept in fp8 (graphinfer::block_fp8_linear), else dequantized at load. Default: no."""
        return False

    def block_fp8_plan(self, device: torch.device) -> tuple[bool, str]:
        """(keep block-FP8 weights in fp8?, why): has_fp8_gemm, unless GRAPHINFER_BLOCK_FP8 forces either way."""
        from graphinfer import envs

        choice = envs.GRAPHINFER_BLOCK_FP8
        if choice not in ("auto", "fp8", "dequantize"):
            from graphinfer.errors import InvalidConfigError

            raise InvalidConfigError(f"GRAPHINFER_BLOCK_FP8={choice!r}: use auto, fp8 or dequantize.")
        if choice != "auto":
            return choice == "fp8", f"GRAPHINFER_BLOCK_FP8={choice}"
        if self.has_fp8_gemm(device):
            return True, f"the {self.name} platform has an fp8 GEMM on {device}"
        return False, f"the {self.name} platform has no fp8 GEMM on {device}"

    def prepacks_linear_weights(self, kernels: str | None = None) -> bool:
        """Whether the graph's float linears run on weights prepacked for the platform's GEMM library (cpu: oneDNN,
        compiler/cpu_packed_linear.py), a lowering step of the compile pipeline. Default: no."""
        return False

    def binds_op_impls(self, kernels: str | None = None) -> bool:
        """Whether the runner's graph calls op_impls(kernels)' functions directly, not through the graphinfer ops
        (compiler/bind_ops.py): for graphs that run eagerly, where each op's trip into Python costs. Default: no."""
        return False

    def graph_compiler(self, kernels: str | None = None) -> str | None:
        """The compiler the fused graph goes through on this platform before it runs ("inductor": cpu's
        compiler/inductor.py; the compile pipeline applies it), or None: the graph runs as is, eagerly or
        captured. A name, not a function: platforms sit below the compiler and import none of it."""
        return None

    def supports_kv_cache_dtype(self, kernels: str | None = None) -> bool:
        """Whether the attention ops (and every fused op writing the KV cache) read and write a cache of another
        dtype than the model's (CacheConfig.kv_cache_dtype), converting as they go. Default: no (the Triton and
        torch_npu kernels assume one dtype)."""
        return False

    def activate(self, kernels: str | None = None) -> KernelBackend:
        """Register op_impls(kernels) under dispatch_key (replacing an earlier activation's choice); returns what
        this kernel choice runs with. The capability methods above are what a platform (or plugin) overrides;
        everything past activation reads the returned backend."""
        import graphinfer.ops  # noqa: F401  (the op schemas must exist before impls attach to them)

        impls = self.op_impls(kernels)
        if self._impl_lib is not None:
            self._impl_lib._destroy()
            self._impl_lib = None
        if impls:
            self._impl_lib = torch.library.Library("graphinfer", "IMPL", self.dispatch_key)
            for name, fn in impls.items():
                self._impl_lib.impl(name, fn)
        self.kernels = {name: getattr(fn, "__module__", "?") for name, fn in impls.items()}
        return KernelBackend(kernels, impls, self.sampler_kernel(kernels), self.default_graph_mode(kernels),
                             self.graph_modes(kernels), self.supports_skinny_gemm(kernels),
                             self.prepacks_linear_weights(kernels), self.binds_op_impls(kernels),
                             self.graph_compiler(kernels), self.supports_kv_cache_dtype(kernels))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
