"""Quantized weights: schemes (scheme.py), the quantized linear layer and online quantizers (linear.py), and the
readers of pre-quantized checkpoints (gguf.py, compressed_tensors.py; fp8.py: DeepSeek's block FP8, kept in fp8 as
block-scheme QuantizedLinears where the platform has an fp8 GEMM, else dequantized as it loads).

`quantization=` (LLM, --quantization; vLLM's names): an online scheme ("w8a8", "fp8", "int8_wo", "int4_wo")
quantizes an unquantized checkpoint's linear layers after loading; "gguf" keeps a GGUF file's quantized blocks;
a compressed-tensors checkpoint (config.json's quantization_config) is read as quantized whatever is passed
("compressed-tensors" names it explicitly). The LM head, embeddings, MoE experts and routers stay in float
(vLLM's default), except that "gguf" keeps what the file quantized.
"""
from torch import nn

from graphinfer.errors import InvalidConfigError, UnsupportedQuantizationError
from graphinfer.quantization.linear import QuantizedEmbedding, QuantizedLinear, tie_quantized_head
from graphinfer.quantization.scheme import ONLINE_SCHEMES, QuantScheme

PREQUANTIZED = ("gguf", "compressed-tensors")
METHODS = tuple(ONLINE_SCHEMES) + PREQUANTIZED


def check_method(method: str | None, device_type: str) -> None:
    """Refuse an unknown method, or one this device cannot run, with what to use instead."""
    if method is None:
        return
    if method not in METHODS:
        raise InvalidConfigError(f"quantization={method!r} is not supported; use one of {', '.join(METHODS)}.")
    if method == "fp8" and device_type != "cuda":
        raise InvalidConfigError(f"quantization='fp8' needs a CUDA GPU with FP8 tensor cores (compute capability "
                                 f"8.9+: Ada, Hopper); this device is {device_type!r}. Use 'w8a8' (int8) or "
                                 f"'int8_wo' / 'int4_wo' here.")


def quantizable_linears(model: nn.Module):
    """(name, module) of the linear layers a scheme quantizes: the column / row-parallel projections, but those a
    model marks `quantizable = False` (an op reads their weight itself: MLA's kv_b_proj)."""
    from graphinfer.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and getattr(m, "quantizable", True)]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def quantize_model(model: nn.Module, method: str) -> dict[str, QuantScheme]:
    """Quantize the loaded model's linear layers in place with an online scheme; returns name -> scheme."""
    schemes = {}
    for name, linear in quantizable_linears(model):
        q = QuantizedLinear.from_linear(linear, ONLINE_SCHEMES[method])
        _replace(model, name, q)
        schemes[name] = q.scheme
    return schemes


def install_quantized_linears(model: nn.Module, schemes: dict[str, QuantScheme], device, dtype=None,
                              tied: bool = False) -> None:
    """Put empty QuantizedLinears (on `device`, or meta) where `schemes` names a layer, before a pre-quantized
    checkpoint's or an artifact's tensors are loaded into them: each keeps its layer's features, bias and
    tensor-parallel role; dtype: the activations' (default: the layer's). An embedding becomes a
    QuantizedEmbedding, and with `tied` the LM head shares its tensors. Names the model lacks (a fused
    projection) are skipped."""
    for name, scheme in schemes.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            old = None
        if old is None or isinstance(old, (QuantizedLinear, QuantizedEmbedding)):
            continue
        if not getattr(old, "quantizable", True):
            raise UnsupportedQuantizationError(
                f"{name} is quantized in this checkpoint, but an op reads its weight itself (e.g. MLA's kv_b_proj, "
                f"split by absorb_mla): graphinfer keeps it in the model dtype. Use a checkpoint that leaves it "
                f"unquantized.")
        if isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, scheme, device, dtype or old.weight.dtype)
        else:
            new = QuantizedLinear(old.in_features, old.out_features, scheme, old.bias is not None,
                                  getattr(old, "has_collective", False), device=device, dtype=dtype or old.weight.dtype)
        _replace(model, name, new)
    if tied and isinstance(getattr(getattr(model, "model", None), "embed_tokens", None), QuantizedEmbedding):
        tie_quantized_head(model)


def model_schemes(model: nn.Module) -> dict[str, dict]:
    """name -> scheme dict of every QuantizedLinear (an artifact's manifest records them)."""
    return {n: m.scheme.to_dict() for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
