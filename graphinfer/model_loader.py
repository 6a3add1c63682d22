"""load_model: a model with its weights, quantized as asked, from an HF checkpoint directory, a .gguf file or a
named preset (vLLM's model_loader). It puts graphinfer/models/loader.py's pieces together with graphinfer/quantization/,
whose quantized layers it installs: above both, so that models never imports quantization."""
import logging

import torch
from torch import nn

from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError
from graphinfer.models import resolve_model_impl
from graphinfer.models.loader import _check_path, _safetensors_weights, build_model, load_hf_config, load_weights
from graphinfer.models.presets import init_random_weights, preset_config

logger = logging.getLogger(__name__)


def load_model(path: str, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
               quantization: str | None = None, model_impl: str = "auto"):
    """(model, hf_config) with weights loaded (a named preset gets random weights from `seed`). Under tensor
    parallelism the model is this rank's shard, and only its slices are read. `quantization`
    (graphinfer.quantization): an online scheme quantizes the linear layers once loaded; "gguf" keeps a GGUF's
    quantized blocks; a compressed-tensors checkpoint is always read in its quantized form, a block-FP8 one
    (DeepSeek-V3's) kept in fp8 where the platform has an fp8 GEMM, else dequantized to `dtype` (_block_fp8).
    `model_impl`: whose modeling code (models/__init__.py:
    resolve_model_impl; "transformers": models/transformers.py)."""
    preset = preset_config(path)
    if model_impl == "transformers" and (path.endswith(".gguf") or preset is not None):
        raise InvalidConfigError(f"model_impl='transformers' runs an HF checkpoint directory through transformers' "
                                 f"modeling code; {path!r} is not one (a GGUF file or a preset runs on graphinfer's "
                                 f"own models: model_impl='auto').")
    if not path.endswith(".gguf") and preset is None:
        _check_path(path)
        dir_config = load_hf_config(path)
        if resolve_model_impl(dir_config.architectures, model_impl) == "transformers":
            return _load_transformers_model(path, dtype, device, quantization), dir_config
    config = preset
    if config is not None:
        with ps.layout(0, 1):  # the whole model's random weights, the same on every rank, then this rank's part
            full = build_model(config, torch.float32, "cpu")
        init_random_weights(full, seed)  # drawn on CPU in fp32 so every device and dtype gets the same values
        if ps.tp_size() == 1 and ps.pp_size() == 1:
            model = full.to(device=device, dtype=dtype)
        else:
            model = build_model(config, torch.float32, "cpu")
            load_weights(model, full.state_dict().items(), config.tie_word_embeddings)
            model = model.to(device=device, dtype=dtype)
        return _quantize_online(model, quantization, path), config
    _check_path(path)
    schemes = {}
    if path.endswith(".gguf"):
        from graphinfer.models.gguf_loader import FastGGUFReader, gguf_tensors, load_gguf_config

        reader = FastGGUFReader(path)
        config = load_gguf_config(reader)
        model = build_model(config, dtype, device)
        if quantization == "gguf":
            from graphinfer.quantization.gguf import gguf_quantized_weights

            # A packed embedding / tied head is tp 1 only: at tp > 1 the vocab-parallel layers stay float.
            weights, schemes = gguf_quantized_weights(reader, config, embedding=ps.tp_size() == 1)
            if ps.tp_size() > 1 and "lm_head" in schemes:
                raise InvalidConfigError("quantization='gguf' at tensor_parallel_size > 1 keeps an untied quantized "
                                         "output.weight, which is not supported yet: run it at tp 1, or without "
                                         "quantization='gguf' (dequantized).")
        else:
            weights = gguf_tensors(reader)
    else:
        config = dir_config
        model = build_model(config, dtype, device)
        weights = _safetensors_weights(path)
        if (qc := getattr(config, "quantization_config", None)) is not None:
            from graphinfer.quantization.compressed_tensors import compressed_tensors_weights
            from graphinfer.quantization.fp8 import is_fp8_config

            if is_fp8_config(qc):  # block FP8 (DeepSeek-V3's): kept in fp8 where the platform can, else dequantized
                weights, schemes = _block_fp8(model, weights, qc, device)
                if quantization is not None:
                    raise InvalidConfigError(f"{path!r} is a block-FP8 checkpoint (quant_method 'fp8'), read in "
                                             f"its own block-FP8 form; quantization={quantization!r} cannot apply to "
                                             f"it. Leave quantization unset.")
            else:
                weights, schemes = compressed_tensors_weights(weights, qc)
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise InvalidConfigError(f"quantization='gguf' reads a .gguf file; {path!r} is not one.")
    if schemes:
        if quantization not in (None, "gguf", "compressed-tensors"):
            fmt = "GGUF" if path.endswith(".gguf") else "compressed-tensors"
            raise InvalidConfigError(f"{path!r} is already quantized ({fmt}); quantization={quantization!r} cannot "
                                     f"quantize it again. Leave quantization unset.")
        from graphinfer.quantization import install_quantized_linears

        install_quantized_linears(model, schemes, device, tied=config.tie_word_embeddings)
    elif quantization == "compressed-tensors":
        raise InvalidConfigError(f"{path!r} has no compressed-tensors quantization_config in its config.json.")
    load_weights(model, weights, config.tie_word_embeddings)
    return (model if schemes else _quantize_online(model, quantization, path)), config


def _block_fp8(model: nn.Module, weights, quant_config, device):
    """(weights, schemes) of a block-FP8 checkpoint: the platform's block_fp8_plan decides whether the model's
    quantizable linears keep fp8 (graphinfer::block_fp8_linear) or everything is dequantized at load; logged."""
    from graphinfer.platforms import platform_for_device
    from graphinfer.quantization import quantizable_linears
    from graphinfer.quantization.fp8 import block_fp8_checkpoint

    device = torch.device(device)
    keep, why = platform_for_device(device.type).block_fp8_plan(device)
    names = frozenset(n for n, _ in quantizable_linears(model)) if keep else frozenset()
    weights, schemes = block_fp8_checkpoint(weights, quant_config, names)
    if keep:
        logger.info("block-FP8 checkpoint: %d linear layers kept in float8_e4m3fn (block_fp8_linear, %s); MoE experts "
                    "and the other quantized weights dequantized at load", len(schemes), why)
    else:
        logger.info("block-FP8 checkpoint: weights dequantized at load (%s)", why)
    return weights, schemes


def _load_transformers_model(path: str, dtype: torch.dtype, device, quantization: str | None) -> nn.Module:
    from graphinfer.models.transformers import TransformersForCausalLM

    if quantization is not None:
        raise InvalidConfigError(f"quantization={quantization!r} is not supported with transformers' modeling code "
                                 f"(model_impl='transformers') yet; leave it unset.")
    return TransformersForCausalLM.from_pretrained(path, dtype, device)


def _quantize_online(model: nn.Module, quantization: str | None, path: str) -> nn.Module:
    if quantization in (None, "compressed-tensors", "gguf"):
        if quantization is not None:
            raise InvalidConfigError(f"quantization={quantization!r} reads a pre-quantized checkpoint; {path!r} is "
                                     f"not one. Use an online scheme (w8a8, int8_wo, int4_wo, fp8) to quantize it.")
        return model
    from graphinfer.quantization import quantize_model

    quantize_model(model, quantization)
    return model
