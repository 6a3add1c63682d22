"""LoRASlots: one projection's adapter weights on the device, max_loras slots of them, read by the graph's
graphinfer::lora_shrink / lora_expand nodes (passes/lora.py puts one beside each targeted projection).

lora_a [max_loras, n, max_lora_rank, in] and lora_b [max_loras, out, max_lora_rank] hold, per slot, the A and B of the
projection's n sources (3 for a fused q/k/v, 2 for gate/up, else 1): source s's B rows at its place in the fused
output, ranks zero-padded. token_indices [max_num_tokens] is the step's slot per token (-1: none), one tensor shared
by every LoRASlots of the graph. All three are written in place only (LoRAManager in runtime/worker/lora_manager.py):
captured device graphs and lowered copies of the graph keep reading the same storage.
"""
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LoRASource:
    """One source projection of a LoRASlots: its module path (the adapter's key, as in HF's modeling), its full
    (unsharded) shape, and how this rank holds it under tensor parallel: B's rows (column-parallel: dim 0) or A's
    columns (row-parallel: dim 1) split in num_shards parts, this rank's part being shard_index."""
    path: str
    in_features: int
    out_features: int
    shard_dim: int | None = None  # 0: B's rows split (ColumnParallelLinear); 1: A's columns (RowParallelLinear)
    shard_index: int = 0
    num_shards: int = 1


class LoRASlots(nn.Module):
    def __init__(self, sources: list[LoRASource], slice_sizes: list[int], in_features: int, max_loras: int,
                 max_lora_rank: int, token_indices: Tensor, dtype: torch.dtype):
        super().__init__()
        self.sources, self.slice_sizes, self.in_features = list(sources), list(slice_sizes), in_features
        self.resize(max_loras, max_lora_rank, token_indices, dtype)

    def resize(self, max_loras: int, max_lora_rank: int, token_indices: Tensor, dtype: torch.dtype | None = None):
        """Empty slots for max_loras adapters of rank <= max_lora_rank, on token_indices' device, reading
        token_indices: made at compile time, and again when an artifact is loaded (slots are per engine, not
        compiled in). Before the graph is lowered: lowered copies hold these tensors."""
        dtype = dtype or self.lora_a.dtype
        n, out, device = len(self.sources), sum(self.slice_sizes), token_indices.device
        self.register_buffer("lora_a", torch.zeros(max_loras, n, max_lora_rank, self.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out, max_lora_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("token_indices", token_indices, persistent=False)

    def __getstate__(self):
        """Pickled (an artifact's added_modules.pt) without the slots' zeros: the loader resizes them."""
        state = self.__dict__.copy()
        state["_buffers"] = {k: torch.empty(0, dtype=v.dtype) for k, v in self._buffers.items()}
        return state

    @torch.no_grad()
    def set_slot(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]]) -> None:
        """Write slot `slot`: weights maps a source's path to its (A [r, in_full], B [out_full, r], scaling folded into
        B), unsharded; sources it does not name get zeros. This rank's shard is cut here."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offset = 0
        for s, (src, size) in enumerate(zip(self.sources, self.slice_sizes)):
            if src.path in weights:
                a, b = weights[src.path]
                if src.shard_dim == 1:
                    part = a.shape[1] // src.num_shards
                    a = a[:, src.shard_index * part:(src.shard_index + 1) * part]
                elif src.shard_dim == 0:
                    part = b.shape[0] // src.num_shards
                    b = b[src.shard_index * part:(src.shard_index + 1) * part]
                r = a.shape[0]
                self.lora_a[slot, s, :r].copy_(a)
                self.lora_b[slot, offset:offset + size, :r].copy_(b)
            offset += size

    def extra_repr(self) -> str:
        return f"sources={[s.path for s in self.sources]}, slice_sizes={self.slice_sizes}, " \
               f"slots={self.lora_a.shape[0]}, rank={self.lora_a.shape[2]}"


def fit_lora_slots(graph: nn.Module, max_loras: int, max_lora_rank: int, max_num_tokens: int,
                   device: torch.device) -> int:
    """Give every LoRASlots of graph (an artifact's, loaded empty) its slots and one shared index buffer; the number
    of LoRASlots."""
    modules = [m for m in graph.modules() if isinstance(m, LoRASlots)]
    token_indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
    for m in modules:
        m.resize(max_loras, max_lora_rank, token_indices)
    return len(modules)
