"""The pieces of loading a model from an HF checkpoint directory or a .gguf file: its config, the model built on
meta then on the device, its weights read into it (a tensor-parallel rank's slices only), its tokenizer.
graphinfer/model_loader.py puts them together with quantization (load_model)."""
import contextlib
import glob
import json
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from graphinfer.errors import UnsupportedArchitectureError, ModelNotFoundError
from graphinfer.models import get_model_class
from graphinfer.models.checkpoint_tensor import SafetensorsTensor, as_checkpoint_tensor
from graphinfer.models.layers import init_buffers
from graphinfer.models.parallel_layers import _load_slice
from graphinfer.models.pipeline_stage import PPMissingLayer, prune_to_stage
from graphinfer.models.presets import PRESET_NAMES, preset_config

_EXPECTED = "an HF checkpoint directory (config.json + *.safetensors) or a .gguf file"


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise ModelNotFoundError(f"Model path {path!r} does not exist. Pass {_EXPECTED}, "
                                 f"or a preset with random weights: {', '.join(PRESET_NAMES)}.")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{path!r} has no config.json. Pass {_EXPECTED}.")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ModelNotFoundError(f"{path!r} is a file but not a .gguf. Pass {_EXPECTED}.")


def load_hf_config(path: str):
    """The HF config of a checkpoint directory."""
    _check_path(path)
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        raise UnsupportedArchitectureError(
            f"{path!r}: model_type {model_type!r}, which transformers {transformers.__version__} does not know (and "
            f"graphinfer runs no checkpoint's own code); use a model transformers has, or a newer transformers.")

    return AutoConfig.from_pretrained(path)


def _safetensors_weights(path: str):
    """(name, SafetensorsTensor) of every tensor in the directory's *.safetensors: read as they are loaded,
    a tensor-parallel rank reading only its slices."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{path!r} has no *.safetensors weights. Pass {_EXPECTED}.")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, SafetensorsTensor(f, name)


_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED_EXPERT = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")
_HALF = {"gate_proj": 0, "up_proj": 1, "down_proj": None}


def _expert_target(name: str, params: dict) -> tuple[str, int | None, int | None] | None:
    """Where an expert tensor goes in the stacked w13_weight [E, 2I, H] / w2_weight [E, H, I]:
    (parameter, expert or None for all, half of w13 (0 gate, 1 up) or None). Two layouts: one tensor per
    expert and projection, `...experts.{e}.gate_proj.weight` (hub checkpoints and transformers' save_pretrained),
    and transformers' in-memory 3-D `...experts.gate_up_proj` / `...experts.down_proj` (already stacked)."""
    if m := _PER_EXPERT.fullmatch(name):
        prefix, e, proj = m.groups()
        target, expert, half = f"{prefix}.{'w2' if proj == 'down_proj' else 'w13'}_weight", int(e), _HALF[proj]
    elif m := _STACKED_EXPERT.fullmatch(name):
        prefix, proj = m.groups()
        target, expert, half = f"{prefix}.{'w2' if proj == 'down_proj' else 'w13'}_weight", None, None
    else:
        return None
    return (target, expert, half) if target in params else None


def load_weights(model: nn.Module, weights, tied: bool) -> None:
    """Copy named checkpoint tensors (CheckpointTensors or tensors) into the model's parameters; every parameter
    must be covered exactly once. A parameter's module may have a weight_loader (the tensor-parallel layers:
    models/parallel_layers.py), which copies its rank's slice; per-expert tensors go to their slice of the
    stacked expert weights (see _expert_target)."""
    params = dict(model.named_parameters())  # a tied lm_head shares (and so omits) the embedding's entry
    missing = set(params)
    pieces: dict[str, set] = {}  # stacked expert weight -> (expert, half) slices loaded so far
    # pipeline parallel: other stages' modules (models/pipeline_stage.py), whose tensors are never read here
    elsewhere = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
    for name, tensor in weights:
        if elsewhere and name.startswith(elsewhere):
            continue
        target, calls = name, [{}]
        if name not in params:
            if (found := _expert_target(name, params)) is None:
                if tied and name == "lm_head.weight":
                    continue
                if name.endswith("rotary_emb.inv_freq") or getattr(model, "skip_checkpoint_tensor", bool)(name):
                    continue
                raise ModelNotFoundError(f"Checkpoint tensor {name!r} has no parameter in {type(model).__name__}; "
                                         f"the checkpoint does not match its config.")
            target, expert, half = found
            experts = model.get_submodule(target.rpartition(".")[0])
            slots = [None]  # a stacked tensor: its weight_loader takes this rank's experts
            if expert is not None:
                total = getattr(experts, "global_num_experts", params[target].shape[0])
                if expert >= total:
                    raise ModelNotFoundError(f"Checkpoint tensor {name!r} is for expert {expert}, the model has "
                                             f"{total}; the checkpoint does not match its config.")
                # expert parallel: the local slots of this expert (EPLB: one per local replica; none: another rank's)
                slots = experts.local_slots(expert) if hasattr(experts, "local_slots") else [expert]
                if not slots:
                    continue
            calls = [{"expert": slot, "half": half} for slot in slots]
        param, src = params[target], as_checkpoint_tensor(tensor)
        owner, _, attr = target.rpartition(".")
        loader = getattr(model.get_submodule(owner), "weight_loader", None)
        for kwargs in calls:
            if loader is not None:
                loader(attr, param, src, name, **kwargs)
            else:
                _load_slice(name, param, src, None)
        if calls[0].get("expert") is not None:
            got = pieces.setdefault(target, set())
            got.update((c["expert"], c["half"]) for c in calls)
            if len(got) < param.shape[0] * (1 if calls[0]["half"] is None else 2):
                continue
        missing.discard(target)
    if missing:
        raise ModelNotFoundError(f"Checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}.")


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def _skip_init():
    """nn.init's functions as no-ops (as transformers' no_init_weights): on meta tensors they run through
    torch._refs, whose first use imports torch._dynamo (seconds), to draw values nobody keeps."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def meta_model(config) -> nn.Module:
    """The model's module tree on the meta device: shapes only, no memory, no random init; under pipeline parallel
    only this rank's stage's modules (prune_to_stage)."""
    cls = get_model_class(config.architectures)
    with torch.device("meta"), _skip_init():
        model = cls(config)
    prune_to_stage(model)
    return model


def build_model(config, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """The model on `device` in `dtype` with uninitialised weights (built on meta, so no random init is paid)."""
    model = meta_model(config)
    model.to_empty(device=device).to(dtype)
    model.tie_weights()
    init_buffers(model, device)
    return model.eval()


class PlainConfig:
    """A model config read back from its `to_dict()` (an artifact's config.json): the attributes the model
    classes read, without importing transformers' per-model config classes."""

    _ALIASES = {"num_experts": "num_local_experts"}  # name the models read -> transformers 5's saved name

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def __getattr__(self, name: str):  # only for names not saved: the alias's value (to_dict stays as saved)
        saved = self._ALIASES.get(name)
        if saved is not None and saved in self.__dict__:
            return self.__dict__[saved]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def load_config(path: str):
    """The HF config of an HF directory, a .gguf file or a named preset."""
    config = preset_config(path)
    if config is not None:
        return config
    _check_path(path)
    if path.endswith(".gguf"):
        from graphinfer.models.gguf_loader import load_gguf_config

        return load_gguf_config(path)
    return load_hf_config(path)


def release_tensors(model: nn.Module) -> None:
    """Drop every parameter and buffer of model's module tree (engine shutdown: whoever still holds a module
    no longer keeps its device memory alive)."""
    for module in model.modules():
        module._parameters.clear()
        module._buffers.clear()


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when a directory ships none (token-id prompts still work)."""
    if preset_config(path) is not None:
        return None
    if path.endswith(".gguf"):
        from graphinfer.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_fast_tokenizer(path: str):
    """A tokenizer saved by graphinfer in HF form (an artifact's tokenizer/: tokenizer.json + its config, chat
    template included) as transformers' fast tokenizer class, without AutoTokenizer's look-ups (AutoConfig and
    the per-model tokenizer classes, which import model code)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)
