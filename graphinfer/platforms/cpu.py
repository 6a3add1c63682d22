"""CPU: the reference PyTorch ops, no device graphs (FULL_DECODE_ONLY is refused here).

kernels="triton" runs the Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1): slow, but it
checks the kernels inside a whole model on a machine without a GPU.
"""
import os

from graphinfer.errors import InvalidConfigError
from graphinfer.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def op_impls(self, kernels: str | None = None):
        if kernels in (None, "reference"):
            return {}
        if kernels != "triton":
            raise InvalidConfigError(f"kernels={kernels!r} on cpu: use 'reference' (default) or 'triton'.")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidConfigError("kernels='triton' on cpu runs Triton's interpreter: set TRITON_INTERPRET=1 "
                                     "in the environment before starting graphinfer.")
        from graphinfer.ops.triton import TRITON_OPS

        return dict(TRITON_OPS)

    def mem_get_info(self, device):
        import psutil

        mem = psutil.virtual_memory()
        return mem.available, mem.total
