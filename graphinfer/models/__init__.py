"""Model families, looked up by the HF `architectures` name in a checkpoint's config."""
from torch import nn

from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from graphinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"Model architecture {architectures} is not supported by graphinfer. "
        f"Supported architectures: {', '.join(sorted(MODEL_REGISTRY))}. "
        f"Use a checkpoint of one of these, or add a model family under graphinfer/models/.")
