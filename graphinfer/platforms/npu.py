"""Ascend NPU: torch.npu devices and streams, ACL graphs (torch.npu.NPUGraph), HCCL.

torch_npu is imported only when this platform is used (is_available() looks for the package and a CANN
toolkit without importing it). Ops use the same Triton kernels as CUDA by default (they run through
Triton-Ascend; attention reads its lengths on device, so plain capture works).
Not run on NPU hardware by this project: written against the documented torch_npu APIs.
"""
import importlib.util
import os

from graphinfer.platforms.interface import Platform

_CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def import_torch_npu():
    import torch_npu  # noqa: F401  (registers the "npu" device and torch.npu)
    import torch

    return torch.npu


class NpuPlatform(Platform):
    name = "npu"
    device_type = "npu"
    dispatch_key = "PrivateUse1"  # torch_npu's device registers as the PrivateUse1 backend
    dist_backend = "hccl"
    supports_graph_capture = True

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("torch_npu") is not None and any(os.environ.get(v) for v in _CANN_ENV)

    @property
    def device_module(self):
        return import_torch_npu()

    def graph_class(self) -> type:
        return self.device_module.NPUGraph

    def graph_capture(self, graph, pool, stream):
        return self.device_module.graph(graph, pool=pool, stream=stream)

    def op_impls(self, kernels: str | None = None):
        if kernels == "reference":
            return {}
        from graphinfer.ops.triton import TRITON_OPS

        return dict(TRITON_OPS)
