"""graphinfer: a compiler-centric, graph-mode LLM inference runtime.

The public names load lazily, so `import graphinfer.ops` (the kernel tests under Triton-Ascend's
interpreter run in a venv with only torch and triton) does not pull in transformers and the runtime.
"""
import importlib
import importlib.util
import os

# torch >= 2.5 autoloads device backends at `import torch`; with torch_npu installed but CANN not sourced that
# import fails. NPU cannot work then anyway, so turn autoload off (the npu platform imports torch_npu itself).
if importlib.util.find_spec("torch_npu") and not any(
        os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")):
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# The CPUs this process may use, read before `import torch`: with OMP_PROC_BIND, OMP_PLACES or GOMP_CPU_AFFINITY
# set, libgomp pins the main thread to one CPU as torch loads (platforms/cpu.physical_cores).
STARTUP_CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()

# transformers' config classes import scikit-learn (through its generation package) for one function of assisted
# generation: ~1.2 s a process where lm-eval installed it. Deferred to that function's first call (lazy_imports.py).
from graphinfer.lazy_imports import defer_sklearn  # noqa: E402

defer_sklearn()

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "graphinfer.runtime.entrypoints.llm", "LLMEngine": "graphinfer.runtime.entrypoints.llm_engine",
    "SamplingParams": "graphinfer.sampling_params", "RequestOutput": "graphinfer.outputs",
    "CompletionOutput": "graphinfer.outputs", "Logprob": "graphinfer.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'graphinfer' has no attribute {name!r}")
