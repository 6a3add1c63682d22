"""lora: a LoRA delta beside each attention / MLP projection, for max_loras adapters at once (vLLM's Punica split).

Matches: every projection whose module name (or, for a fused one, every source's: fuse_qkv / fuse_gate_up record
them in gm.meta["fused_linears"]) is one of TARGET_MODULES: an nn.Linear / QuantizedLinear call, or, under tensor
parallel, the F.linear a row-parallel layer is traced to (the delta is added before its all-reduce, so the
partial products sum to x A^T B^T like the base's).
Produces: y = lin(x) becomes z = graphinfer::lora_expand(y, graphinfer::lora_shrink(x, A, idx), B, idx, slices), with A,
B and idx buffers of a LoRASlots module (graphinfer/lora/slots.py) at `<projection>_lora`; idx, the step's slot per
token (-1: none), is one buffer for the whole graph, so one graph (and each captured device graph) serves any mix of
adapters. Slots start empty (all zeros): the graph computes what it did before, so the numeric check is exact.
Runs only when LoRA is enabled (enable_lora: the pipeline configures it); else it finds nothing.
Declines: a targeted projection whose input is not one tensor node (reason in the report).
"""
import torch
import torch.nn.functional as F
from torch import fx

from graphinfer.distributed import parallel_state as ps
from graphinfer.lora.slots import LoRASlots, LoRASource
from graphinfer.models.parallel_layers import ColumnParallelLinear
from graphinfer.passes.base import Pass
from graphinfer.passes.match import is_op
from graphinfer.passes.utils import GRAPHINFER, is_linear
from graphinfer.quantization.linear import QuantizedLinear

# vLLM's supported_lora_modules of its Llama / Qwen models (packed qkv_proj / gate_up_proj count as their sources)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _source(gm: fx.GraphModule, path: str) -> LoRASource:
    """The LoRASource of the projection module at `path` in gm."""
    m = gm.get_submodule(path)
    i, o = m.in_features, m.out_features
    if isinstance(m, ColumnParallelLinear) and m.num_shards > 1:
        return LoRASource(path, i, o * m.num_shards, 0, m.shard_index, m.num_shards)
    return LoRASource(path, i, o)


def _row_parallel_source(path: str, weight: torch.Tensor) -> LoRASource:
    """A row-parallel layer traced through (its F.linear reads this rank's [out, in / tp] weight)."""
    out_features, in_local = weight.shape
    return LoRASource(path, in_local * ps.tp_size(), out_features, 1, ps.tp_rank(), ps.tp_size())


def _targeted(path: str) -> bool:
    return path.rpartition(".")[2] in TARGET_MODULES


class LoRAPass(Pass):
    name = "lora"
    description = "LoRA delta (graphinfer::lora_shrink / lora_expand over max_loras slots) beside each projection"

    def __init__(self, max_loras: int = 0, max_lora_rank: int = 0, max_num_tokens: int = 0):
        super().__init__()
        self.max_loras, self.max_lora_rank, self.max_num_tokens = max_loras, max_lora_rank, max_num_tokens

    def _projection(self, gm: fx.GraphModule, node: fx.Node) -> tuple[str, list[LoRASource], torch.Tensor] | None:
        """(path, sources, a tensor of its dtype and device) of a projection node this pass targets, else None."""
        if is_linear(gm, node):
            path = node.target
            sources = gm.meta.get("fused_linears", {}).get(path, [path])
            if not all(_targeted(s) for s in sources):
                return None
            module = gm.get_submodule(path)
            return path, [_source(gm, s) for s in sources], module.weight
        weight = node.args[1] if is_op(node, F.linear) and len(node.args) >= 2 else None
        if getattr(weight, "op", None) == "get_attr" and weight.target.endswith(".weight") and \
                any(is_op(u, GRAPHINFER.all_reduce) for u in node.users):  # a row-parallel layer, traced through
            path = weight.target.rpartition(".")[0]
            if _targeted(path):
                w = gm.get_parameter(weight.target)
                return path, [_row_parallel_source(path, w)], w
        return None

    def apply(self, gm: fx.GraphModule) -> int:
        if not self.max_loras:
            return 0
        token_indices = None
        matches = 0
        for node in list(gm.graph.nodes):
            found = self._projection(gm, node)
            if found is None:
                continue
            path, sources, weight = found
            x = node.args[0]
            if not isinstance(x, fx.Node):
                self.decline(f"{path}: its input is not a tensor node")
                continue
            if token_indices is None:
                token_indices = torch.full((self.max_num_tokens,), -1, dtype=torch.int64, device=weight.device)
            local = [s.out_features // s.num_shards if s.shard_dim == 0 else s.out_features for s in sources]
            in_local = sources[0].in_features // (sources[0].num_shards if sources[0].shard_dim == 1 else 1)
            module = gm.get_submodule(path) if node.op == "call_module" else None
            dtype = module.out_dtype if isinstance(module, QuantizedLinear) else weight.dtype
            slots = LoRASlots(sources, local, in_local, self.max_loras, self.max_lora_rank, token_indices, dtype)
            target = f"{path}_lora"
            gm.add_submodule(target, slots)
            with gm.graph.inserting_after(node):
                a = gm.graph.get_attr(f"{target}.lora_a")
            with gm.graph.inserting_after(a):
                b = gm.graph.get_attr(f"{target}.lora_b")
            with gm.graph.inserting_after(b):
                idx = gm.graph.get_attr(f"{target}.token_indices")
            with gm.graph.inserting_after(idx):
                buf = gm.graph.call_function(GRAPHINFER.lora_shrink.default, (x, a, idx))
            with gm.graph.inserting_after(buf):
                z = gm.graph.call_function(GRAPHINFER.lora_expand.default, (node, buf, b, idx, local))
            node.replace_all_uses_with(z, delete_user_cb=lambda user: user is not z)
            matches += 1
        return matches
