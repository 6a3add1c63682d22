"""graphinfer: a compiler-centric, graph-mode LLM inference runtime.

The public names load lazily, so `import graphinfer.ops` (the kernel tests under Triton-Ascend's
interpreter run in a venv with only torch and triton) does not pull in transformers and the runtime.
"""
import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "graphinfer.runtime.llm", "LLMEngine": "graphinfer.runtime.llm_engine",
    "SamplingParams": "graphinfer.sampling_params", "RequestOutput": "graphinfer.outputs",
    "CompletionOutput": "graphinfer.outputs", "Logprob": "graphinfer.outputs",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'graphinfer' has no attribute {name!r}")
