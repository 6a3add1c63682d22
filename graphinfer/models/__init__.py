"""Model families, looked up by the HF `architectures` name in a checkpoint's config."""
from torch import nn

from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from graphinfer.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from graphinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """graphinfer's own model class for the architecture (UnsupportedArchitectureError without one)."""
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"Model architecture {architectures} has no graphinfer model (it has: {', '.join(sorted(MODEL_REGISTRY))}). "
        f"model_impl='auto' or 'transformers' runs it through transformers' own modeling code.")


def resolve_model_impl(architectures: list[str] | None, model_impl: str) -> str:
    """"graphinfer" or "transformers": which modeling code runs this architecture (vLLM's model_impl: "auto" takes
    graphinfer's own model where there is one)."""
    if model_impl == "auto":
        return "graphinfer" if any(a in MODEL_REGISTRY for a in architectures or []) else "transformers"
    if model_impl == "graphinfer":
        get_model_class(architectures)
    return model_impl
