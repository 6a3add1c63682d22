"""vLLM-Ascend's expert-map JSON (its `expert_map_path`, read by vllm_ascend/ops/expert_load_balancer.py and written
by vllm_ascend/eplb/adaptor/vllm_adaptor.py's _export_tensor_to_file): a static placement an operator can start from.

    {"moe_layer_count": L,
     "layer_list": [{"layer_id": 0, "device_count": D,
                     "device_list": [{"device_id": 0, "device_expert": [logical expert of local slot 0, 1, ...]},
                                     ...]},
                    ...]}

Layer i is the i-th MoE layer; device d is EP rank d; device_expert[j] is the logical expert in its local slot j.
Flattening the devices of a layer gives graphinfer's (and vLLM's) physical_to_logical_map row: physical slot
d * slots_per_rank + j. A placement may hold two replicas of one expert on one rank (the policy allows it).
Reading validates everything (typed InvalidConfigError naming the layer / device / field), so a bad file fails at
start-up, not as a wrong token later.
"""
import json
import os

import torch

from graphinfer.eplb.policy import initial_placement
from graphinfer.errors import InvalidConfigError


def _fail(path: str, where: str, what: str) -> InvalidConfigError:
    return InvalidConfigError(f"expert map {path}: {where}{': ' if where else ''}{what}")


def _int(value, path: str, where: str, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, where, f'"{field}" must be an integer, got {value!r}.')
    return value


def _list(value, path: str, where: str, field: str) -> list:
    if not isinstance(value, list):
        raise _fail(path, where, f'"{field}" must be a list, got {type(value).__name__}.')
    return value


def _get(record, field: str, path: str, where: str):
    if not isinstance(record, dict):
        raise _fail(path, where, f"must be a JSON object, got {type(record).__name__}.")
    if field not in record:
        raise _fail(path, where, f'missing "{field}".')
    return record[field]


def validate_placement(physical_to_logical_map: torch.Tensor, num_logical: int, ep_size: int,
                       source: str = "placement") -> torch.Tensor:
    """Check a placement [layers, ep_size * slots_per_rank]: ids in [0, num_logical), every logical expert in
    every layer at least once, an equal number of slots per rank. Returns it as int64 on the CPU."""
    phy2log = torch.as_tensor(physical_to_logical_map).to("cpu", torch.int64)
    if phy2log.dim() != 2 or phy2log.shape[1] == 0:
        raise _fail(source, "", f"a placement is [layers, physical experts], got shape {tuple(phy2log.shape)}.")
    if ep_size < 1 or phy2log.shape[1] % ep_size:
        raise _fail(source, "", f"{phy2log.shape[1]} physical experts do not split evenly over ep_size={ep_size}.")
    per = phy2log.shape[1] // ep_size
    for layer, row in enumerate(phy2log.tolist()):
        for p, e in enumerate(row):
            if not 0 <= e < num_logical:
                raise _fail(source, f"layer {layer}, device {p // per}",
                            f"device_expert[{p % per}] = {e} is outside [0, {num_logical}).")
        missing = sorted(set(range(num_logical)) - set(row))
        if missing:
            raise _fail(source, f"layer {layer}", f"logical experts {missing} have no replica; every expert needs "
                        "at least one.")
    return phy2log


def placement_to_json(physical_to_logical_map: torch.Tensor, ep_size: int, num_logical: int | None = None) -> dict:
    """A placement [layers, ep_size * slots_per_rank] as vLLM-Ascend's expert-map record (validated first;
    num_logical defaults to the largest id + 1)."""
    phy2log = torch.as_tensor(physical_to_logical_map).to("cpu", torch.int64)
    if num_logical is None:
        num_logical = int(phy2log.max()) + 1 if phy2log.numel() else 0
    phy2log = validate_placement(phy2log, num_logical, ep_size)
    per = phy2log.shape[1] // ep_size
    return {"moe_layer_count": phy2log.shape[0],
            "layer_list": [{"layer_id": layer, "device_count": ep_size,
                            "device_list": [{"device_id": d, "device_expert": row[d * per:(d + 1) * per]}
                                            for d in range(ep_size)]}
                           for layer, row in enumerate(phy2log.tolist())]}


def placement_from_json(data, num_logical: int | None = None, ep_size: int | None = None,
                        num_layers: int | None = None, source: str = "<json>") -> torch.Tensor:
    """vLLM-Ascend's expert-map record -> physical_to_logical_map [layers, device_count * slots_per_device] int64.
    num_logical / ep_size / num_layers, when given, must match the model and the deployment; num_logical defaults to
    the largest id + 1 (so every id below it must appear)."""
    count = _int(_get(data, "moe_layer_count", source, ""), source, "", "moe_layer_count")
    layers = _list(_get(data, "layer_list", source, ""), source, "", "layer_list")
    if count < 1 or count != len(layers):
        raise _fail(source, "", f'"moe_layer_count" is {count} but "layer_list" has {len(layers)} layers.')
    if num_layers is not None and count != num_layers:
        raise _fail(source, "", f'"moe_layer_count" is {count}, but the model has {num_layers} MoE layers.')
    rows, devices, slots = [], None, None
    for i, layer in enumerate(layers):
        where = f"layer_list[{i}]"
        layer_id = _int(_get(layer, "layer_id", source, where), source, where, "layer_id")
        if layer_id != i:
            raise _fail(source, where, f'"layer_id" is {layer_id}; layers must be listed in order from 0.')
        where = f"layer {i}"
        n = _int(_get(layer, "device_count", source, where), source, where, "device_count")
        device_list = _list(_get(layer, "device_list", source, where), source, where, "device_list")
        if n < 1 or n != len(device_list):
            raise _fail(source, where, f'"device_count" is {n} but "device_list" has {len(device_list)} devices.')
        if devices is None:
            devices = n
            if ep_size is not None and n != ep_size:
                raise _fail(source, where, f'"device_count" is {n}, but the expert-parallel size is {ep_size}.')
        elif n != devices:
            raise _fail(source, where, f'"device_count" is {n}, but layer 0 has {devices}; every layer needs the '
                        "same devices.")
        row = []
        for d, device in enumerate(device_list):
            at = f"layer {i}, device_list[{d}]"
            device_id = _int(_get(device, "device_id", source, at), source, at, "device_id")
            if device_id != d:
                raise _fail(source, at, f'"device_id" is {device_id}; devices must be listed in order from 0.')
            at = f"layer {i}, device {d}"
            experts = _list(_get(device, "device_expert", source, at), source, at, "device_expert")
            if not experts:
                raise _fail(source, at, '"device_expert" is empty; every device holds at least one expert.')
            if slots is None:
                slots = len(experts)
            elif len(experts) != slots:
                raise _fail(source, at, f'"device_expert" has {len(experts)} experts, but layer 0, device 0 has '
                            f"{slots}; every device needs the same number of slots.")
            row += [_int(e, source, at, f"device_expert[{j}]") for j, e in enumerate(experts)]
        rows.append(row)
    phy2log = torch.tensor(rows, dtype=torch.int64)
    if num_logical is None:
        num_logical = int(phy2log.max()) + 1
    return validate_placement(phy2log, num_logical, devices, source)


def load_expert_map(path: str | os.PathLike, num_logical: int | None = None, ep_size: int | None = None,
                    num_layers: int | None = None) -> torch.Tensor:
    """Read a vLLM-Ascend expert-map JSON file into physical_to_logical_map [layers, ep_size * slots_per_rank]."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise _fail(path, "", "no such file; give the path of an expert-map JSON (vLLM-Ascend's format).") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, "", f"cannot be read as JSON ({e}).") from None
    return placement_from_json(data, num_logical, ep_size, num_layers, source=path)


def save_expert_map(path: str | os.PathLike, physical_to_logical_map: torch.Tensor, ep_size: int,
                    num_logical: int | None = None) -> None:
    """Write a placement as a vLLM-Ascend expert-map JSON file (indented as vLLM-Ascend writes it)."""
    record = placement_to_json(physical_to_logical_map, ep_size, num_logical)
    with open(os.fspath(path), "w") as f:
        json.dump(record, f, indent=4)
        f.write("\n")


def starting_placement(num_logical: int, num_redundant: int, ep_size: int,
                       expert_map_path: str | os.PathLike | None = None) -> list[list[int]]:
    """The placement a model is built with: the expert-map file's rows (one per MoE layer), else vLLM's initial
    placement (logical experts in order, then redundant slot i holding expert i % E) as one row for every layer.
    Refuses (InvalidConfigError) a physical count the EP ranks cannot split, and a file whose redundancy is not
    num_redundant (unless num_redundant is 0: the file says)."""
    if expert_map_path:
        rows = load_expert_map(expert_map_path, num_logical, ep_size)
        if num_redundant and rows.shape[1] != num_logical + num_redundant:
            raise _fail(os.fspath(expert_map_path), "", f"it places {rows.shape[1]} physical experts, but eplb_config "
                        f"asks for {num_logical} + num_redundant_experts={num_redundant}; drop num_redundant_experts "
                        f"(the file decides) or use a matching file.")
        return rows.tolist()
    physical = num_logical + num_redundant
    if physical % ep_size:
        fits = [r for r in range(num_redundant, num_redundant + ep_size + 1) if (num_logical + r) % ep_size == 0]
        raise InvalidConfigError(f"eplb_config num_redundant_experts={num_redundant}: {num_logical} experts + "
                                 f"{num_redundant} redundant = {physical} physical experts do not split evenly over "
                                 f"the expert-parallel size {ep_size}; use num_redundant_experts={fits[0]} (any value "
                                 f"with {num_logical} + R a multiple of {ep_size}).")
    return initial_placement(1, num_logical, num_redundant).tolist()
