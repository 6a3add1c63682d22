"""graphinfer: a compiler-centric, graph-mode LLM inference runtime."""
from graphinfer.outputs import CompletionOutput, Logprob, RequestOutput
from graphinfer.runtime.llm import LLM
from graphinfer.runtime.llm_engine import LLMEngine
from graphinfer.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
