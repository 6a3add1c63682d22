"""CPU: the reference PyTorch ops, no device graphs (FULL_DECODE_ONLY is refused here)."""
from graphinfer.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def mem_get_info(self, device):
        import psutil

        mem = psutil.virtual_memory()
        return mem.available, mem.total
