"""Pipeline parallel, the model side: which decoder layers a stage holds, and a stage's module tree.

A stage's model is the whole model's tree with the other stages' parts replaced by PPMissingLayer (vLLM's name):
decoder layers outside its range, and the embedding and LM head except on the first stage (the first stage also runs
the LM head: the last stage sends the final hidden rows back, see runtime/worker/model_runner.py). The final norm
(one vector) stays everywhere. A PPMissingLayer holds no weight and is a leaf of the tracer: the traced graph keeps
it as one call, which the compiler's stage cut (compiler/pipeline_stages.py) leaves to the stage that owns it.
"""
import re

from torch import nn

from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
FIRST_STAGE_MODULES = ("model.embed_tokens", "lm_head")


class PPMissingLayer(nn.Module):
    """Another pipeline stage's module: no weights; never run (the stage graph does not call it)."""
    weight = None  # a tied LM head reads the embedding's weight: there is none here

    def forward(self, *args, **kwargs):
        raise RuntimeError("PPMissingLayer ran: another pipeline stage's module was called on this one")


def layer_index(path: str) -> int | None:
    """The decoder layer a module / parameter path is in (`model.layers.<i>....`), or None."""
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def stage_layer_counts(num_layers: int, pp: int, partition: str | None = None) -> list[int]:
    """Decoder layers per stage: `partition` ("a,b,...", vLLM's VLLM_PP_LAYER_PARTITION) if given, else an even
    split with the first num_layers % pp stages one layer more. Refused, with the numbers, if it does not cover
    the model's layers or leaves a stage empty."""
    if partition:
        try:
            counts = [int(x) for x in partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise InvalidConfigError(
                f"pp_layer_partition={partition!r} must be {pp} positive layer counts (one per pipeline stage) summing "
                f"to the model's {num_layers} decoder layers, e.g. {','.join(map(str, stage_layer_counts(num_layers, pp)))}.")
        return counts
    if num_layers < pp:
        raise InvalidConfigError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} decoder layers: every "
                                 f"stage needs at least one. Use pipeline_parallel_size <= {num_layers}.")
    return [num_layers // pp + (s < num_layers % pp) for s in range(pp)]


def stage_layers(num_layers: int, stage: int | None = None) -> range:
    """The decoder layers of pipeline stage `stage` (default: this rank's) under the current layout."""
    counts = stage_layer_counts(num_layers, ps.pp_size(), ps.pp_layer_partition())
    stage = ps.pp_rank() if stage is None else stage
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def stage_of_layer(num_layers: int, layer: int) -> int:
    counts = stage_layer_counts(num_layers, ps.pp_size(), ps.pp_layer_partition())
    end = 0
    for stage, n in enumerate(counts):
        end += n
        if layer < end:
            return stage
    raise ValueError(f"layer {layer} >= {num_layers}")


def prune_to_stage(model: nn.Module) -> None:
    """Replace (before its weights are materialised) every module of model that this rank's pipeline stage does
    not hold by a PPMissingLayer; a no-op without pipeline parallel."""
    if ps.pp_size() == 1:
        return
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InvalidConfigError(f"pipeline_parallel_size > 1 needs a model with decoder layers at model.layers; "
                                 f"{type(model).__name__} has none.")
    mine = stage_layers(len(layers))
    for i in range(len(layers)):
        if i not in mine:
            layers[i] = PPMissingLayer()
    if ps.pp_rank() != 0:
        for path in FIRST_STAGE_MODULES:
            parent, _, name = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            if hasattr(owner, name):
                setattr(owner, name, PPMissingLayer())
