"""CUDA: Triton kernels for every graphinfer op, CUDA graphs (full decode graphs and pieces), NCCL."""
import contextlib
import gc
from unittest import mock

import torch

from graphinfer.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dispatch_key = "CUDA"
    dist_backend = "nccl"
    supports_graph_capture = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @property
    def device_module(self):
        return torch.cuda

    def graph_class(self) -> type:
        return torch.cuda.CUDAGraph

    def empty_cache(self) -> None:
        # cuBLAS keeps a workspace per (handle, stream) in the caching allocator (32 MiB each on an H100, one per
        # stream an engine used): measured as the 96 MiB an engine left allocated after shutdown. They come
        # back on the next GEMM.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()

    def graph_capture(self, graph, pool, stream):
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    @contextlib.contextmanager
    def capture_session(self):
        """Empty the caches once for the whole loop: torch.cuda.graph empties the allocator's cache (and, where
        force_cudagraph_gc is set, runs gc.collect) on entering every capture, which adds up over the ~1,500
        piecewise graphs of the default sizes. vLLM patches the same two calls while it captures."""
        gc.collect()
        torch.cuda.empty_cache()
        with mock.patch("gc.collect", lambda *args, **kwargs: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            yield

    def op_impls(self, kernels: str | None = None):
        if kernels == "reference":  # debugging aid: PyTorch reference ops (not capture-safe: they sync the host)
            return {}
        from graphinfer.ops.triton import TRITON_OPS

        return dict(TRITON_OPS)

    def has_fp8_gemm(self, device: torch.device) -> bool:
        """float8e4nv tl.dot needs compute capability 8.9+ (Ada, Hopper: H100 / H200 are 9.0)."""
        return torch.cuda.get_device_capability(device) >= (8, 9)

    def supports_skinny_gemm(self, kernels: str | None = None) -> bool:
        return kernels != "reference"

    def sampler_kernel(self, kernels: str | None = None):
        if kernels == "reference":
            return None
        from graphinfer.ops.triton.sampling import sample

        return sample
