"""CUDA: Triton kernels for every graphinfer op, CUDA graphs for FULL_DECODE_ONLY, NCCL."""
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

    def graph_capture(self, graph, pool, stream):
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def op_impls(self, kernels: str | None = None):
        if kernels == "reference":  # debugging aid: PyTorch reference ops (not capture-safe: they sync the host)
            return {}
        from graphinfer.ops.triton import TRITON_OPS

        return dict(TRITON_OPS)
