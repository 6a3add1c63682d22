"""Read a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors, or adapter_model.bin) into
per-module weights: `a` [r, in] and `b` [out, r] with PEFT's scaling folded into b, so y = x W^T + (x a^T) b^T.

Only plain LoRA on the base model's Linear projections is read; everything else PEFT can save is refused with a
LoRAAdapterError naming the adapter path, the field or module, and what to do: DoRA, LoRA on the embeddings or LM
head, modules_to_save, trainable tokens, biases, target_parameters, layer_replication, a rank above max_lora_rank,
a module the base model does not have, shapes of another model size, non-finite values. The names and rules
(target_modules, rank_pattern, alpha_pattern, rslora) are PEFT's own (peft/tuners/lora, peft/utils/other.py).
"""
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from graphinfer.errors import LoRAAdapterError

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
PREFIX = "base_model.model."
_LORA_PARTS = ("lora_A", "lora_B")
_EMBEDDING_PARTS = ("lora_embedding_A", "lora_embedding_B")
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")


@dataclass
class LoRALayerWeights:
    """One Linear's LoRA: a [r, in], b [out, r] with lora_alpha / r (or / sqrt(r) under rslora) folded in."""
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: `rank` the largest of its modules' ranks, `modules` keyed by module path
    ("model.layers.0.self_attn.q_proj")."""
    rank: int
    modules: dict[str, LoRALayerWeights] = field(default_factory=dict)


def load_adapter(path: str, base_shapes: dict[str, tuple[int, int]], max_lora_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Load the PEFT LoRA adapter at `path` for a base model whose targetable Linears are `base_shapes`
    (module path -> (in_features, out_features) of the full, unsharded Linear). Tensors come back in `dtype`, on
    cpu, contiguous. Raises LoRAAdapterError for anything graphinfer cannot apply exactly."""
    path = str(path)
    config = _read_config(path)
    _check_config(path, config)
    pairs = _group_tensors(path, _read_tensors(path))
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {path}: {_weights_name(path)} holds no lora_A / lora_B weights; "
                               f"save the adapter with PEFT's save_pretrained.")
    modules = {}
    for module in sorted(pairs):
        a, b = _check_module(path, config, module, pairs[module], base_shapes, max_lora_rank)
        r, alpha = _rank_and_alpha(config, module)
        if a.shape[0] != r:
            raise LoRAAdapterError(f"LoRA adapter {path}: module {module!r} has rank {a.shape[0]} in its weights, but "
                                   f"adapter_config.json says r={r} for it (r / rank_pattern); the config does not "
                                   f"belong to these weights. Save config and weights together with save_pretrained.")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
        modules[module] = LoRALayerWeights(
            a=a.to(dtype).contiguous(), b=(b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(rank=max(m.rank for m in modules.values()), modules=modules)


def _refuse(path: str, what: str, fix: str):
    raise LoRAAdapterError(f"LoRA adapter {path}: {what}. {fix}")


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        _refuse(path, "the directory does not exist" if not os.path.exists(path) else "is not a directory",
                f"Pass lora_path as the directory PEFT's save_pretrained wrote ({CONFIG_NAME} + {SAFETENSORS_NAME}).")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        _refuse(path, f"no {CONFIG_NAME} in the directory",
                "Save the adapter with PEFT's save_pretrained, which writes it next to the weights.")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        _refuse(path, f"{CONFIG_NAME} cannot be read as JSON ({e})", "Save the adapter again with save_pretrained.")
    if not isinstance(config, dict):
        _refuse(path, f"{CONFIG_NAME} is not a JSON object", "Save the adapter again with save_pretrained.")
    return config


def _check_config(path: str, config: dict) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        _refuse(path, f"peft_type={peft_type!r} in {CONFIG_NAME} is not supported",
                "Only LoRA adapters (peft_type 'LORA') can be served.")
    if config.get("use_dora"):
        _refuse(path, "use_dora=true: DoRA adapters are not supported",
                "Train a plain LoRA adapter (use_dora=False), or merge this one into the base weights with PEFT's "
                "merge_and_unload() and serve the merged model.")
    if config.get("bias", "none") != "none":
        _refuse(path, f"bias={config['bias']!r} is not supported (only 'none')",
                "Train with bias='none', or merge the adapter into the base model (merge_and_unload()) and serve that.")
    if config.get("lora_bias"):
        _refuse(path, "lora_bias=true (a bias on lora_B) is not supported",
                "Train with lora_bias=False, or merge the adapter (merge_and_unload()) and serve the merged model.")
    if config.get("modules_to_save"):
        _refuse(path, f"modules_to_save={config['modules_to_save']!r} is not supported (fully trained copies of "
                      f"modules cannot be swapped per request)",
                "Train without modules_to_save, or merge the adapter (merge_and_unload()) and serve the merged model.")
    if config.get("trainable_token_indices"):
        _refuse(path, "trainable_token_indices (trained embedding rows) is not supported",
                "Train without trainable tokens, or merge the adapter (merge_and_unload()) and serve the merged model.")
    if config.get("target_parameters"):
        _refuse(path, f"target_parameters={config['target_parameters']!r} (LoRA on bare parameters) is not supported",
                "Target Linear modules with target_modules, or merge the adapter and serve the merged model.")
    if config.get("layer_replication"):
        _refuse(path, "layer_replication is not supported (it changes the base model's layers)",
                "Merge the adapter (merge_and_unload()) and serve the merged model.")
    if config.get("alora_invocation_tokens"):
        _refuse(path, "alora_invocation_tokens (activated LoRA) is not supported",
                "Use a plain LoRA adapter.")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            _refuse(path, f"{name} in {CONFIG_NAME} is not a mapping of module pattern -> value",
                    "Save the adapter again with save_pretrained.")
    r = config.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        _refuse(path, f"r={r!r} in {CONFIG_NAME} is not a positive integer",
                "Save the adapter again with save_pretrained.")


def _weights_name(path: str) -> str:
    return SAFETENSORS_NAME if os.path.isfile(os.path.join(path, SAFETENSORS_NAME)) else BIN_NAME


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, bin_ = os.path.join(path, SAFETENSORS_NAME), os.path.join(path, BIN_NAME)
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file
            return load_file(st, device="cpu")
        if os.path.isfile(bin_):
            tensors = torch.load(bin_, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise ValueError("not a state dict of tensors")
            return tensors
    except Exception as e:  # a damaged or foreign file: say so, with the file's name
        _refuse(path, f"{os.path.basename(st if os.path.isfile(st) else bin_)} cannot be read ({e})",
                "Save the adapter again with PEFT's save_pretrained.")
    _refuse(path, f"no {SAFETENSORS_NAME} or {BIN_NAME} in the directory",
            "Save the adapter with PEFT's save_pretrained, which writes the weights next to adapter_config.json.")


def _group_tensors(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module path -> {"lora_A": t, "lora_B": t}; refuses the keys of what is not plain LoRA on a Linear."""
    for key in tensors:  # first, so that whatever else PEFT saved with them (the base embedding) is not blamed
        parts = key.split(".")
        if any(p in _EMBEDDING_PARTS for p in parts) or any(p in _UNSUPPORTED_MODULES for p in parts):
            module = ".".join(parts[:next(i for i, p in enumerate(parts)
                                          if p in _EMBEDDING_PARTS or p in _UNSUPPORTED_MODULES) + 1])
            module = module[len(PREFIX):] if module.startswith(PREFIX) else module
            _refuse(path, f"tensor {key!r} adapts {module!r}: LoRA on the embeddings / LM head (embed_tokens, "
                          f"lm_head) is not supported",
                    "Train the adapter without embed_tokens / lm_head in target_modules, or merge it "
                    "(merge_and_unload()) and serve the merged model.")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        parts = name.split(".")
        idx = next((i for i, p in enumerate(parts) if p.startswith("lora_") or p == "modules_to_save"), None)
        module = ".".join(parts[:idx]) if idx else name
        kind = parts[idx] if idx is not None else None
        tail = parts[idx + 1:] if idx is not None else []
        if kind == "lora_magnitude_vector":
            _refuse(path, f"{key} is a DoRA magnitude vector: DoRA adapters are not supported (use_dora)",
                    "Train a plain LoRA adapter, or merge this one (merge_and_unload()) and serve the merged model.")
        if kind == "modules_to_save":
            _refuse(path, f"{key} is a fully trained module (modules_to_save): not supported",
                    "Train without modules_to_save, or merge the adapter and serve the merged model.")
        if kind not in _LORA_PARTS:
            _refuse(path, f"unexpected tensor {key!r}: only lora_A / lora_B weights of Linear modules are supported",
                    "Serve a plain LoRA adapter, or merge this one (merge_and_unload()) and serve the merged model.")
        # <module>.lora_A.weight, or with the adapter name PEFT can leave in: <module>.lora_A.<adapter>.weight
        if tail and tail[-1] == "bias":
            _refuse(path, f"{key} is a LoRA bias (lora_bias): not supported",
                    "Train with lora_bias=False, or merge the adapter and serve the merged model.")
        if not tail or tail[-1] != "weight" or len(tail) > 2:
            _refuse(path, f"unexpected tensor name {key!r} (expected <module>.{kind}.weight)",
                    "Save the adapter with PEFT's save_pretrained.")
        if kind in pairs.setdefault(module, {}):
            _refuse(path, f"module {module!r} has more than one {kind} (several adapters in one file?)",
                    "Save one adapter per directory with PEFT's save_pretrained.")
        pairs[module][kind] = tensor
    return pairs


def _check_module(path, config, module, pair, base_shapes, max_lora_rank):
    for kind in _LORA_PARTS:
        if kind not in pair:
            _refuse(path, f"module {module!r} has no {kind} weight", "Save the adapter again with save_pretrained.")
    a, b = pair["lora_A"], pair["lora_B"]
    if module not in base_shapes:
        known = sorted({m.rsplit(".", 1)[-1] for m in base_shapes})
        _refuse(path, f"module {module!r} is not a LoRA-targetable Linear of the base model (it has "
                      f"{len(base_shapes)}, named {', '.join(known) or 'none'})",
                "The adapter was made for another architecture or a model with more layers; use an adapter trained "
                "on this base model.")
    if a.dim() != 2 or b.dim() != 2:
        _refuse(path, f"module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not matrices",
                "Only LoRA on Linear modules is supported.")
    if not (a.is_floating_point() and b.is_floating_point()):
        _refuse(path, f"module {module!r}: lora weights of dtype {a.dtype} / {b.dtype} are not floating point",
                "Save the adapter in float32, bfloat16 or float16.")
    if a.shape[0] != b.shape[1]:
        _refuse(path, f"module {module!r}: ranks disagree, lora_A is {tuple(a.shape)} (rank {a.shape[0]}) and "
                      f"lora_B is {tuple(b.shape)} (rank {b.shape[1]})",
                "The file is damaged or mixes adapters; save it again with save_pretrained.")
    in_f, out_f = base_shapes[module]
    if a.shape[1] != in_f or b.shape[0] != out_f:
        _refuse(path, f"module {module!r}: shapes do not match the base model: lora_A {tuple(a.shape)} / lora_B "
                      f"{tuple(b.shape)} is a {a.shape[1]} -> {b.shape[0]} projection, the base model's is "
                      f"{in_f} -> {out_f}",
                "The adapter was trained on another model size; use an adapter trained on this base model.")
    r = a.shape[0]
    if r > max_lora_rank:
        _refuse(path, f"module {module!r} has LoRA rank {r}, above max_lora_rank={max_lora_rank}",
                f"Start the engine with max_lora_rank (--max-lora-rank) >= {r}.")
    if not _targeted(config, module):
        _refuse(path, f"module {module!r} has weights but adapter_config.json's target_modules="
                      f"{config.get('target_modules')!r} does not target it (exclude_modules="
                      f"{config.get('exclude_modules')!r}, layers_to_transform={config.get('layers_to_transform')!r})",
                "The config does not belong to these weights; save config and weights together with save_pretrained.")
    for kind, t in (("lora_A", a), ("lora_B", b)):
        if not torch.isfinite(t).all():
            _refuse(path, f"module {module!r}: {kind} holds non-finite values (inf / nan)",
                    "The adapter is broken (a diverged training run?); use a checkpoint with finite weights.")
    return a, b


def _rank_and_alpha(config: dict, module: str) -> tuple[int, float]:
    """PEFT's per-module r and lora_alpha: the first rank_pattern / alpha_pattern key that matches the module path
    as `(.*\\.)?(key)$` (peft.utils.other.get_pattern_key), else the config's r / lora_alpha."""
    r = config.get("r", 8)
    alpha = config.get("lora_alpha", 8)
    for name, default in (("rank_pattern", r), ("alpha_pattern", alpha)):
        pattern = config.get(name) or {}
        key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)
        value = pattern[key] if key is not None else default
        if name == "rank_pattern":
            r = value
        else:
            alpha = value
    return r, alpha


def _targeted(config: dict, key: str) -> bool:
    """PEFT's check_target_module_exists (peft/tuners/tuners_utils.py) for a module that holds LoRA weights:
    target_modules as a regex (fullmatch) or a list of names (exact or a '.'-suffix), exclude_modules, and
    layers_to_transform / layers_pattern. A config without target_modules (PEFT filled them from its model-type
    defaults when training) does not restrict."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return False
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return False
    targets = config.get("target_modules")
    if not targets:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layer_indexes = config.get("layers_to_transform")
    if layer_indexes is None or (isinstance(layer_indexes, list) and not layer_indexes):
        return True
    layers_pattern = config.get("layers_pattern")
    match = None
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    if match is None:
        return False
    idx = int(match.group("idx"))
    return idx == layer_indexes if isinstance(layer_indexes, int) else idx in layer_indexes
