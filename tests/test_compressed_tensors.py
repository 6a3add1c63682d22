"""compressed-tensors checkpoints (graphinfer/quantization/compressed_tensors.py), written here by the
compressed-tensors package itself from tiny random HF models (apply_quantization_config, scales from the weights'
min / max by its calculate_qparams, ModelCompressor.compress_model, save_pretrained, update_config), then read back
through the loader's safetensors iterator: our tensors dequantize (ops.quant.dequantize_weight) to exactly what the
package's own compressor decompresses from the same files and what transformers' load of the checkpoint holds, and
the schemes are the expected ones; unsupported configurations are refused naming the field."""
import copy
import json
import os

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from graphinfer.errors import UnsupportedQuantizationError
from graphinfer.models.checkpoint_tensor import CheckpointTensor
from graphinfer.models.loader import _safetensors_weights
from graphinfer.ops.quant import dequantize_weight
from graphinfer.quantization.compressed_tensors import compressed_tensors_weights
from graphinfer.quantization.linear import QuantizedLinear
from graphinfer.quantization.scheme import QuantScheme

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
ARGS = QuantizationArgs
STATIC_INPUT_SCALE = 0.0234375


def _scheme(weights, acts=None, targets=("Linear",)):
    return QuantizationScheme(targets=list(targets), weights=ARGS(**weights), input_activations=acts and ARGS(**acts))


W8_TOKEN = dict(num_bits=8, type="int", strategy="token", dynamic=True)
# name -> (config_groups: presets by name or schemes, expected QuantScheme of the layers (attention, mlp), arch, dtype)
CASES = {
    "W8A8": ({"W8A8": ["Linear"]}, QuantScheme(bits=8, act_dtype="int8"), "llama", torch.bfloat16),
    "W8A8-static": ({"g": _scheme(dict(num_bits=8, strategy="tensor"),
                                  dict(num_bits=8, strategy="tensor", dynamic=False))},
                    QuantScheme(bits=8, act_dtype="int8", static_input=True), "llama", torch.bfloat16),
    "FP8_DYNAMIC": ({"FP8_DYNAMIC": ["Linear"]}, QuantScheme(bits=8, act_dtype="fp8", weight_fp8=True), "llama",
                    torch.bfloat16),
    "FP8-static": ({"FP8": ["Linear"]}, QuantScheme(bits=8, act_dtype="fp8", weight_fp8=True, static_input=True),
                   "qwen3", torch.bfloat16),
    "W4A16": ({"g": _scheme(dict(num_bits=4, strategy="group", group_size=32))},
              QuantScheme(bits=4, group_size=32, has_zero=True), "qwen3", torch.bfloat16),
    "W4A16-asym": ({"g": _scheme(dict(num_bits=4, strategy="group", group_size=32, symmetric=False))},
                   QuantScheme(bits=4, group_size=32, has_zero=True), "llama", torch.float16),
    "W4A16-asym-channel": ({"g": _scheme(dict(num_bits=4, strategy="channel", symmetric=False))},
                           QuantScheme(bits=4, has_zero=True), "llama", torch.bfloat16),
    "W8A16-channel": ({"g": _scheme(dict(num_bits=8, strategy="channel"))}, QuantScheme(bits=8), "llama",
                      torch.bfloat16),
    "W8A16-asym-group": ({"g": _scheme(dict(num_bits=8, strategy="group", group_size=32, symmetric=False))},
                         QuantScheme(bits=8, group_size=32, has_zero=True), "llama", torch.bfloat16),
    "mixed": ({"attn": _scheme(dict(num_bits=8, strategy="channel"), W8_TOKEN, ["re:.*self_attn\\..*"]),
               "mlp": _scheme(dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
                              targets=["re:.*mlp\\..*"])},
              (QuantScheme(bits=8, act_dtype="int8"), QuantScheme(bits=4, group_size=32, has_zero=True)), "qwen3",
              torch.bfloat16),
    # fp32 scales: the products are not all exact in fp32, so the int4 forms round twice (checked to 16 ulps of s)
    "W4A16-fp32": ({"g": _scheme(dict(num_bits=4, strategy="group", group_size=32))},
                   QuantScheme(bits=4, group_size=32, has_zero=True), "llama", torch.float32),
}


def _calibrate(module):
    """Weight scales / zero points from the weight's min / max per the strategy (the package's calculate_qparams);
    a fixed static input scale."""
    args = module.quantization_scheme.weights
    w = module.weight.data.float()
    n, k = w.shape
    if args.strategy == "group":
        groups = w.view(n, k // args.group_size, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale)
    if getattr(module, "weight_zero_point", None) is not None:
        module.weight_zero_point.data.copy_(zero_point)
    if getattr(module, "input_scale", None) is not None:
        module.input_scale.data.fill_(STATIC_INPUT_SCALE)


def write_checkpoint(path, groups, arch="llama", dtype=torch.bfloat16):
    """A tiny random model quantized and saved compressed by compressed-tensors -> {module: (its scheme, format)}."""
    torch.manual_seed(0)
    config = (LlamaConfig if arch == "llama" else Qwen3Config)(**TINY, **({"head_dim": 32} if arch == "qwen3" else {}))
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]), show_progress=False)
    quantized = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    for module in quantized.values():
        _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return {n: (m.quantization_scheme, m.quantization_scheme.format) for n, m in quantized.items()}


def _file_tensors(path, prefix):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k[len(prefix) + 1:]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == prefix}


def _dequant(scheme, t):
    scale = t["weight_scale"]
    return dequantize_weight(t["weight"], scale if scheme.weight_only else scale[:, None], t.get("weight_zero"),
                             scheme.bits)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_the_packages_decompression(case, tmp_path):
    groups, expected, arch, dtype = CASES[case]
    path = str(tmp_path)
    recorded = write_checkpoint(path, groups, arch, dtype)
    config = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]

    weights, schemes = compressed_tensors_weights(_safetensors_weights(path), config)  # the loader's own iterator
    assert set(schemes) == set(recorded)  # every Linear but the ignored lm_head
    attn, mlp = expected if isinstance(expected, tuple) else (expected, expected)
    for prefix, scheme in schemes.items():
        assert scheme == (attn if ".self_attn." in prefix else mlp), prefix
    ours = {}
    for name, t in weights:
        assert name not in ours
        ours[name] = t.read() if isinstance(t, CheckpointTensor) else t
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        file_names = set(f.keys())
        for name in file_names:  # the unquantized tensors come unchanged (embedding, norms, the ignored lm_head)
            if name.rpartition(".")[0] not in schemes:
                assert torch.equal(ours.pop(name), f.get_tensor(name)), name
    dequantized = {}
    for prefix, scheme in schemes.items():
        mine = {n[len(prefix) + 1:]: ours.pop(n) for n in list(ours) if n.rpartition(".")[0] == prefix}
        ct_scheme, fmt = recorded[prefix]
        file = _file_tensors(path, prefix)
        layer = QuantizedLinear(*reversed(_dequant(scheme, mine).shape), scheme, device="meta")
        assert {n: (t.dtype, tuple(t.shape)) for n, t in mine.items()} == \
            {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()}, prefix  # what the loader fills
        theirs = BaseCompressor.get_value_from_registry(fmt).decompress(file, ct_scheme)["weight"]
        assert theirs.dtype == dtype
        _assert_same(scheme, mine, theirs, prefix)
        if scheme.static_input:
            assert torch.equal(mine["input_scale"], torch.tensor([STATIC_INPUT_SCALE]))
        dequantized[prefix] = mine
    assert not ours

    # transformers' own load of the checkpoint (its compressed-tensors quantizer: decompressed on the first forward)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf(torch.tensor([[1, 2, 3]]))
    hf_weights = hf.state_dict()
    for prefix, mine in dequantized.items():
        _assert_same(schemes[prefix], mine, hf_weights[f"{prefix}.weight"], prefix)


def _assert_same(scheme, mine, theirs, label):
    """Our dequantized tensors vs a decompressed weight (in the scale dtype): equal once cast to it; with fp32
    scales c * s rounds (up to 8 ulps of s, c <= 15), then + zero rounds (up to 4 more): within 16 ulps of s."""
    ours = _dequant(scheme, mine)
    if theirs.dtype == torch.float32:
        scale = mine["weight_scale"].repeat_interleave(scheme.group(theirs.shape[1]), dim=1)
        assert bool(((ours - theirs).abs() <= scale * 2 ** -19).all()), label
    else:
        assert torch.equal(ours.to(theirs.dtype), theirs), label


def test_sliced_reads_of_passed_through_tensors(tmp_path):
    """Unquantized tensors stay lazy CheckpointTensors (a tensor-parallel rank reads its slice) and are readable
    after the loader's iterator has closed the file."""
    path = str(tmp_path)
    write_checkpoint(path, CASES["W4A16"][0], "llama")
    config = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    weights, _ = compressed_tensors_weights(_safetensors_weights(path), config)
    head = dict(weights)["lm_head.weight"]
    assert isinstance(head, CheckpointTensor) and head.shape == (128, 64)
    full = _file_tensors(path, "lm_head")["weight"]
    assert torch.equal(head.read(), full) and torch.equal(head.read(0, 32, 32), full[32:64])
    assert torch.equal(head.read(1, 16, 16), full[:, 16:32])


# The refusals: one module's worth of (fake) tensors and a config changed from a valid one.
_W4 = {"format": "pack-quantized", "targets": ["Linear"],
       "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                   "dynamic": False}}
_BASE = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "ignore": ["lm_head"], "config_groups": {"group_0": _W4}, "sparsity_config": {}, "transform_config": {},
         "kv_cache_scheme": None}
_TENSORS = [("model.layers.0.mlp.up_proj.weight_packed", torch.zeros(128, 8, dtype=torch.int32)),
            ("model.layers.0.mlp.up_proj.weight_scale", torch.ones(128, 2)),
            ("model.layers.0.mlp.up_proj.weight_shape", torch.tensor([128, 64]))]


def _config(**changes):
    config = copy.deepcopy(_BASE)
    for dotted, value in changes.items():
        *path, key = dotted.split("__")
        d = config
        for p in path:
            d = d[p]
        d[key] = value
    return config


_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
REFUSALS = {
    "2:4 sparsity": (dict(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
                     "sparsity_config"),
    "transforms": (dict(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    "kv cache": (dict(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    "other method": (dict(quant_method="gptq"), "quant_method"),
    "not compressed": (dict(quantization_status="frozen"), "quantization_status"),
    "actorder group": (dict(config_groups__group_0__weights__actorder="group"), "actorder='group'"),
    "2-bit": (dict(config_groups__group_0__weights__num_bits=2), "num_bits=2"),
    "W4A8": (dict(config_groups__group_0__input_activations=dict(num_bits=8, type="int", strategy="token",
                                                                 dynamic=True)), "input_activations"),
    "output activations": (dict(config_groups__group_0__output_activations=dict(num_bits=8, type="int",
                                                                                strategy="token", dynamic=True)),
                           "output_activations"),
    "nvfp4": (dict(config_groups__group_0__format="nvfp4-pack-quantized"), "format='nvfp4-pack-quantized'"),
    "block fp8": (dict(config_groups__group_0={**_W4, "format": "float-quantized", "weights": {
        **_FP8, "strategy": "block", "block_structure": [128, 128]}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}}), "strategy='block'"),
    "fp8 weight-only": (dict(config_groups__group_0={**_W4, "format": "float-quantized", "weights": _FP8}),
                        "input_activations=None"),
    "asymmetric activations": (dict(config_groups__group_0={**_W4, "format": "int-quantized", "weights": {
        **_FP8, "type": "int"}, "input_activations": dict(num_bits=8, type="int", strategy="token", dynamic=True,
                                                         symmetric=False)}), "symmetric=False"),
    "dynamic per-tensor activations": (dict(config_groups__group_0={**_W4, "format": "int-quantized", "weights": {
        **_FP8, "type": "int"}, "input_activations": dict(num_bits=8, type="int", strategy="tensor", dynamic=True)}),
        "strategy / dynamic"),
    "grouped activations": (dict(config_groups__group_0={**_W4, "format": "int-quantized", "weights": {
        **_FP8, "type": "int"}, "input_activations": dict(num_bits=8, type="int", strategy="group", group_size=32,
                                                         dynamic=True)}), "strategy / dynamic"),
    "not targeted": (dict(config_groups__group_0__targets=["re:.*self_attn.*"]), "matches no config group"),
    "ignored": (dict(ignore=["lm_head", "re:.*up_proj"]), "ignore list"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_configurations_are_refused(case):
    changes, message = REFUSALS[case]
    with pytest.raises(UnsupportedQuantizationError, match=message.replace("(", "\\(").replace("[", "\\[")) as e:
        compressed_tensors_weights(iter(_TENSORS), _config(**changes))
    assert isinstance(e.value, ValueError)
    if case not in ("not targeted", "ignored", "not compressed"):
        assert "graphinfer reads" in str(e.value)  # and what is supported


def test_unsupported_tensors_are_refused_when_read():
    weights, schemes = compressed_tensors_weights(
        iter(_TENSORS + [("model.layers.0.mlp.up_proj.weight_g_idx", torch.zeros(64, dtype=torch.int32))]), _BASE)
    assert list(schemes) == ["model.layers.0.mlp.up_proj"]
    with pytest.raises(UnsupportedQuantizationError, match="weight_g_idx"):
        list(weights)
    weights, _ = compressed_tensors_weights(iter(_TENSORS[:2]), _BASE)
    with pytest.raises(UnsupportedQuantizationError, match="lacks model.layers.0.mlp.up_proj.weight_shape"):
        list(weights)


def test_valid_base_config_reads():
    weights, schemes = compressed_tensors_weights(iter(_TENSORS), _BASE)
    out = dict(weights)
    assert schemes == {"model.layers.0.mlp.up_proj": QuantScheme(bits=4, group_size=32, has_zero=True)}
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], torch.zeros(128, 32, dtype=torch.uint8))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight_zero"], torch.full((128, 2), -8.0))
