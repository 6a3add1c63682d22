"""Tensor-parallel layers (vLLM's names), sharded by the process's layout (distributed.parallel_state).

At tp 1 each is exactly the plain layer (nn.Linear, nn.Embedding), so the traced graph is today's. At tp N:
- ColumnParallelLinear: output features split; no communication (q/k/v, gate/up: the passes still fuse them);
- RowParallelLinear: input features split, partial sums all-reduced (o_proj, down_proj); the bias is added
  after the all-reduce, so every rank runs the same graph;
- VocabParallelEmbedding / ParallelLMHead: the vocabulary split in padded equal parts; the embedding looks
  up the ids it owns and all-reduces, the LM head all-gathers the logits (every rank holds them, rank 0
  samples);
- MoEExperts: each expert's intermediate dimension split (TP for MoE), the combined output all-reduced; with
  expert parallel on, whole experts partitioned over the EP ranks instead (see MoEExperts). It also counts the
  tokens routed to each expert (expert_counts, runtime/expert_load.py).
Layers with a collective are traced through (compiler/trace.py), so graphinfer::all_reduce and
graphinfer::all_gather are nodes of the graph. Each layer's weight_loader copies its slice of a checkpoint
tensor (models/checkpoint_tensor.py), so a rank reads only its part.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphinfer import ops
from graphinfer.distributed import parallel_state as ps
from graphinfer.distributed.communication_op import (all_gather, ep_combine, ep_dispatch, sequence_parallel_chunk,
                                                     tensor_model_parallel_all_gather,
                                                     tensor_model_parallel_all_reduce)
from graphinfer.errors import InvalidConfigError, ModelNotFoundError
from graphinfer.models.checkpoint_tensor import CheckpointTensor


def num_experts(config) -> int:
    """The routed expert count of an MoE config (transformers 5 saves Qwen3-MoE's as num_local_experts, DeepSeek's as
    n_routed_experts), else 0."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or \
        getattr(config, "n_routed_experts", None) or 0


def uses_expert_parallel(config, tp: int, enable_expert_parallel: bool) -> bool:
    """Whether the flag changes anything: experts to partition and more than one rank (a dense model ignores it)."""
    return enable_expert_parallel and tp > 1 and num_experts(config) > 0


def check_tensor_parallel(config, tp: int, expert_parallel: bool = False, dp: int = 1) -> None:
    """Refuse, with the numbers, a tensor-parallel size that does not split the model's heads or MLPs (with
    expert parallel: an expert count the EP size, tp x dp, does not divide)."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    experts = num_experts(config)
    if expert_parallel and experts and experts % (tp * dp):
        fits = [d for d in range(1, experts + 1) if experts % d == 0]
        raise InvalidConfigError(f"enable_expert_parallel with tensor_parallel_size={tp}, data_parallel_size={dp} "
                                 f"(expert parallel size {tp * dp}) "
                                 f"does not partition this model's {experts} experts (num_experts) evenly. Use an "
                                 f"expert parallel size that divides {experts}: one of {fits}, or leave expert "
                                 f"parallel off (each expert's intermediate dimension is then split).")
    sizes = {"attention heads (num_attention_heads)": heads}
    for attr in ("intermediate_size",) + (() if expert_parallel and experts else ("moe_intermediate_size",)):
        if getattr(config, attr, None):
            sizes[attr] = getattr(config, attr)
    bad = [f"{name} = {n}" for name, n in sizes.items() if n % tp]
    if kv % tp and tp % kv:  # fewer KV heads than ranks: each KV head is replicated on tp / kv ranks
        bad.append(f"KV heads (num_key_value_heads) = {kv}, which tp must divide or be a multiple of")
    if bad:
        fits = [d for d in range(1, heads + 1) if all(n % d == 0 for n in sizes.values()) and (kv % d == 0 or d % kv == 0)]
        raise InvalidConfigError(f"tensor_parallel_size={tp} does not split this model: {'; '.join(bad)}. Use a "
                                 f"tensor_parallel_size that divides them: one of {fits}.")


def _load_slice(label: str, dest: Tensor, src: CheckpointTensor, dim: int | None, index: int = 0,
                num_shards: int = 1) -> None:
    """dest <- part `index` of `num_shards` equal parts of src along dim (all of src for dim None)."""
    want = list(dest.shape)
    if dim is not None:
        want[dim] *= num_shards
    if list(src.shape) != want:
        per_rank = " per rank" if num_shards > 1 else ""
        raise ModelNotFoundError(f"Checkpoint tensor {label!r} has shape {tuple(src.shape)}, the model expects "
                                 f"{tuple(dest.shape)}{per_rank}; the checkpoint does not match its config.")
    with torch.no_grad():
        if dim is None or num_shards == 1:
            dest.copy_(src.read())
        else:
            n = dest.shape[dim]
            dest.copy_(src.read(dim, index * n, n))


class ColumnParallelLinear(nn.Linear):
    """Output features split in num_shards parts (default: one per rank). num_shards < tp replicates: rank r
    holds part r * num_shards // tp (KV projections when tp > num_kv_heads, as vLLM)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, num_shards: int | None = None):
        tp = ps.tp_size()
        self.num_shards = num_shards or tp
        self.shard_index = ps.tp_rank() * self.num_shards // tp
        super().__init__(in_features, out_features // self.num_shards, bias)

    def weight_loader(self, name: str, param: Tensor, src: CheckpointTensor, label: str) -> None:
        _load_slice(label, param, src, 0, self.shard_index, self.num_shards)


class RowParallelLinear(nn.Linear):
    """Input features split; y = all_reduce(x_r W_r^T) + b."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features // ps.tp_size(), out_features, bias)
        self.has_collective = ps.tp_size() > 1

    def forward(self, x: Tensor) -> Tensor:
        if not self.has_collective:
            return F.linear(x, self.weight, self.bias)
        out = tensor_model_parallel_all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, name: str, param: Tensor, src: CheckpointTensor, label: str) -> None:
        _load_slice(label, param, src, 1 if name == "weight" else None, ps.tp_rank(), ps.tp_size())


def _vocab_part(vocab_size: int) -> tuple[int, int]:
    """(rows per rank, first row of this rank): the vocabulary padded to a multiple of tp."""
    per = -(-vocab_size // ps.tp_size())
    return per, ps.tp_rank() * per


def _load_vocab_rows(label: str, param: Tensor, src: CheckpointTensor, vocab_size: int) -> None:
    per, start = _vocab_part(vocab_size)
    if tuple(src.shape) != (vocab_size, param.shape[1]):
        raise ModelNotFoundError(f"Checkpoint tensor {label!r} has shape {tuple(src.shape)}, the model expects "
                                 f"{(vocab_size, param.shape[1])}; the checkpoint does not match its config.")
    n = max(0, min(per, vocab_size - start))
    with torch.no_grad():
        param[n:].zero_()  # the padding rows of the last rank
        if n:
            param[:n].copy_(src.read(0, start, n) if ps.tp_size() > 1 else src.read())


class VocabParallelEmbedding(nn.Embedding):
    """Rows of the vocabulary split; each rank embeds the ids it owns (zeros elsewhere), then all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        per, start = _vocab_part(num_embeddings)
        super().__init__(per, embedding_dim)
        self.org_vocab_size = num_embeddings
        self.has_collective = ps.tp_size() > 1
        if self.has_collective:  # a buffer, not a constant: every rank's graph is the same code
            self.register_buffer("vocab_start", torch.tensor(start), persistent=False)

    def reset_buffers(self, device) -> None:
        if self.has_collective:
            self.vocab_start = torch.tensor(_vocab_part(self.org_vocab_size)[1], device=device)

    def forward(self, input_ids: Tensor) -> Tensor:
        if not self.has_collective:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        owned = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(owned, local, 0), self.weight)
        return tensor_model_parallel_all_reduce(rows * owned.unsqueeze(-1).to(rows.dtype))

    def weight_loader(self, name: str, param: Tensor, src: CheckpointTensor, label: str) -> None:
        _load_vocab_rows(label, param, src, self.org_vocab_size)


class ParallelLMHead(nn.Linear):
    """The LM head over the padded vocabulary split like VocabParallelEmbedding (so a tied head shares its
    rows); the logits are all-gathered and the padding dropped."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, _vocab_part(vocab_size)[0], bias=False)
        self.org_vocab_size = vocab_size
        self.has_collective = ps.tp_size() > 1

    def forward(self, hidden_states: Tensor) -> Tensor:
        logits = F.linear(hidden_states, self.weight)
        if not self.has_collective:
            return logits
        return tensor_model_parallel_all_gather(logits, -1)[..., :self.org_vocab_size]

    def weight_loader(self, name: str, param: Tensor, src: CheckpointTensor, label: str) -> None:
        _load_vocab_rows(label, param, src, self.org_vocab_size)


class _Placement:
    """The physical expert placement of the MoE layers a model build creates, in build (= layer) order."""

    def __init__(self, rows: list[list[int]]):
        self.rows, self.used = rows, 0

    def next_row(self) -> list[int]:
        row = self.rows[min(self.used, len(self.rows) - 1)]  # one row: every layer's
        self.used += 1
        return row


_placement: _Placement | None = None


@contextlib.contextmanager
def expert_placement(rows: list[list[int]] | None):
    """While building a model under expert parallel: the i-th MoE layer built holds physical placement rows[i] (one
    row: every layer), a row listing the logical expert of each physical slot, EP rank r holding slots
    [r * P / ep, (r + 1) * P / ep) (EPLB: runtime/worker/eplb_state.py). Yields the _Placement, whose `used` says
    how many MoE layers took a row. None: the plain contiguous layout."""
    global _placement
    saved, _placement = _placement, _Placement(rows) if rows else None
    try:
        yield _placement
    finally:
        _placement = saved


def logical_maps_of(row: list[int], num_logical: int) -> tuple[Tensor, Tensor]:
    """(logical_to_physical_map [E, P - E + 1]: each expert's physical slots ascending, -1 padded;
    logical_replica_count [E]) of one placement row (eplb/policy.logical_maps is the same over many layers)."""
    slots = [[] for _ in range(num_logical)]
    for p, e in enumerate(row):
        slots[e].append(p)
    width = len(row) - num_logical + 1
    log2phy = [s + [-1] * (width - len(s)) for s in slots]
    return (torch.tensor(log2phy, dtype=torch.int64, device="cpu"),
            torch.tensor([len(s) for s in slots], dtype=torch.int64, device="cpu"))


class MoEExperts(nn.Module):
    """num_experts SwiGLU experts as stacked weights (vLLM's FusedMoE names): w13_weight [E, 2I, H] is
    cat(gate_proj, up_proj) per expert (HF's gate_up_proj), w2_weight [E, H, I] the down_proj. Naive on purpose:
    dispatch -> grouped MLP -> combine, which the fuse_moe pass turns into one fused_moe.

    Tensor parallel: I is split over the TP ranks and the combined output all-reduced. Expert parallel
    (ps.ep_size() = tp x dp > 1): EP rank r holds experts [r*E/ep, (r+1)*E/ep) whole, and the block is vLLM's
    sequence-parallel MoE: each TP rank takes its slice of its replica's T (replicated) tokens, ep_dispatch sends
    every routed slot to its expert's rank (of any replica), the local chain runs there (fuse_moe: one
    fused_experts), ep_combine brings the rows back weighted, and all_gather over TP rebuilds [T, H] (no
    all-reduce).

    EPLB (built under expert_placement): P = E + redundant physical experts, rank r holding physical slots
    [r*P/ep, (r+1)*P/ep) (w13_weight [P/ep, ...]), each the copy of the logical expert placement[p] names.
    graphinfer::eplb_map_to_physical_and_record turns each routed slot's logical id into one replica's physical id
    through logical_to_physical_map / logical_replica_count, device buffers rewritten in place when the experts are
    re-placed (captured graphs stay valid), and counts each physical expert's tokens into expert_load_pass.

    Expert load (EPLB's input): expert_counts [E] int64 (all experts, with EP too) accumulates the tokens routed
    to each expert on the device, inside the graph; num_tokens [1] is the step's real token count, the model runner's static tensor
    (set_num_tokens), so the padded rows of a captured bucket count nothing. Both are non-persistent buffers:
    never in a checkpoint or an artifact's weights."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.ep_size, self.ep_rank, self.global_num_experts = ps.ep_size(), ps.ep_rank(), num_experts
        row = _placement.next_row() if _placement is not None and self.ep_size > 1 else None
        self.eplb = row is not None
        self.placement = list(row) if self.eplb else list(range(num_experts))  # logical expert of each physical slot
        self.num_physical_experts = len(self.placement)
        self.num_experts = self.num_physical_experts // self.ep_size  # local (physical) experts
        self.expert_start = self.ep_rank * self.num_experts  # global (physical) id of local expert 0
        self.tp_split = 1 if self.ep_size > 1 else ps.tp_size()  # shards of each expert's intermediate dim
        E, H, I = self.num_experts, hidden_size, intermediate_size // self.tp_split
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2_weight = nn.Parameter(torch.empty(E, H, I))
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("num_tokens", torch.zeros(1, dtype=torch.int64), persistent=False)
        if self.eplb:
            self._eplb_buffers("cpu")

    def _eplb_buffers(self, device) -> None:
        log2phy, count = logical_maps_of(self.placement, self.global_num_experts)
        for name, value in (("logical_to_physical_map", log2phy), ("logical_replica_count", count),
                            ("expert_load_pass", torch.zeros(self.num_physical_experts, dtype=torch.int64,
                                                             device="cpu"))):
            self.register_buffer(name, value.to(device), persistent=False)

    def reset_buffers(self, device) -> None:
        self.expert_counts = torch.zeros(self.global_num_experts, dtype=torch.int64, device=device)
        self.num_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        if self.eplb:
            self._eplb_buffers(device)

    def local_placement(self) -> list[int]:
        """The logical expert of each local slot."""
        return self.placement[self.expert_start:self.expert_start + self.num_experts]

    def forward(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        # Counted on the whole (replicated) batch before any EP chunking: every rank holds the totals.
        ops.moe_count_experts(topk_ids, self.expert_counts, self.num_tokens)
        if self.eplb:  # logical -> physical ids (one replica each), physical load counted
            topk_ids = ops.eplb_map_to_physical_and_record(topk_ids, self.logical_to_physical_map,
                                                           self.logical_replica_count, self.expert_load_pass,
                                                           self.num_tokens)
        if self.ep_size > 1:
            return self._forward_ep(hidden_states, topk_ids, topk_weights)
        sorted_hidden, expert_offsets, inverse_perm = ops.moe_dispatch(hidden_states, topk_ids, self.num_experts)
        expert_out = ops.moe_grouped_mlp(sorted_hidden, expert_offsets, self.w13_weight, self.w2_weight)
        return tensor_model_parallel_all_reduce(ops.moe_combine(expert_out, inverse_perm, topk_weights))

    def _forward_ep(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        ep, tp = self.ep_size, ps.tp_size()
        x, ids, weights = hidden_states, topk_ids, topk_weights
        if tp > 1:  # the replica's tokens are replicated over its TP ranks: each takes a slice
            x, ids, weights = (sequence_parallel_chunk(t, tp, ps.TP_GROUP) for t in (x, ids, weights))
        rows, local_ids, combine_metadata = ep_dispatch(x, ids, self.num_physical_experts, ep, ps.EP_GROUP)
        # A row with id -1 (a slot of another rank's expert) is a zero row: expert 0 with weight 0 adds exactly 0.
        valid = (local_ids >= 0).unsqueeze(-1)
        out = self._local_experts(rows, local_ids.clamp(min=0).unsqueeze(-1), valid.to(rows.dtype))
        out = ep_combine(out, ids, weights, combine_metadata, self.num_physical_experts, ep, ps.EP_GROUP)
        if tp > 1:
            out = all_gather(out, 0, tp, ps.TP_GROUP)[:hidden_states.shape[0]]
        return out

    def _local_experts(self, rows: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        sorted_rows, expert_offsets, inverse_perm = ops.moe_dispatch(rows, ids, self.num_experts)
        expert_out = ops.moe_grouped_mlp(sorted_rows, expert_offsets, self.w13_weight, self.w2_weight)
        return ops.moe_combine(expert_out, inverse_perm, weights)

    def weight_loader(self, name: str, param: Tensor, src: CheckpointTensor, label: str,
                      expert: int | None = None, half: int | None = None) -> None:
        """A per-expert tensor (local expert `expert`, half 0 gate / 1 up / None down) or a stacked one (expert
        None: [E, 2I, H] gate_up or [E, H, I] down, transformers' in-memory layout; with expert parallel this
        rank's experts are sliced out of the expert dim)."""
        if expert is None and self.eplb:  # stacked, EPLB: each local slot's logical expert, whole
            for slot, logical in enumerate(self.local_placement()):
                _load_slice(label, param[slot:slot + 1], src, 0, logical, self.global_num_experts)
            return None
        if expert is None and self.ep_size > 1:  # stacked, expert parallel: this rank's experts, whole
            return _load_slice(label, param, src, 0, self.ep_rank, self.ep_size)
        rank, shards = (0, 1) if self.tp_split == 1 else (ps.tp_rank(), self.tp_split)
        if name == "w2_weight":  # down: [.., H, I], split along I
            dest = param if expert is None else param[expert]
            return _load_slice(label, dest, src, dest.dim() - 1, rank, shards)
        if expert is not None:
            return _load_slice(label, param[expert].chunk(2)[half], src, 0, rank, shards)
        I_local = param.shape[1] // 2
        if tuple(src.shape) != (param.shape[0], 2 * I_local * shards, param.shape[2]):
            raise ModelNotFoundError(f"Checkpoint tensor {label!r} has shape {tuple(src.shape)}, the model expects "
                                     f"{tuple(param.shape)} per rank; the checkpoint does not match its config.")
        I = I_local * shards
        with torch.no_grad():
            for h in (0, 1):  # gate rows [0, I), up rows [I, 2I): this rank's part of each
                param[:, h * I_local:(h + 1) * I_local].copy_(src.read(1, h * I + rank * I_local, I_local))

    def local_slots(self, expert: int) -> list[int]:
        """The local slots holding (a replica of) logical expert `expert`: none when only other EP ranks hold it."""
        return [slot for slot, logical in enumerate(self.local_placement()) if logical == expert]


def local_heads(total: int) -> int:
    return total // ps.tp_size()


def local_kv_heads(total: int) -> int:
    """KV heads per rank: replicated (one per rank) when there are fewer KV heads than ranks."""
    return max(1, total // ps.tp_size())
