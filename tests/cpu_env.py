"""The environment of a subprocess that must run on CPU, also on a machine with a GPU: Triton's interpreter on, CUDA
hidden. Tests that check the CPU path in a subprocess (Triton kernels interpreted, the launch stand-in) use it
instead of skipping where CUDA is present."""
import os


def cpu_subprocess_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", **extra}
