"""EPLB while serving (vLLM's EplbState): one per rank, owned by its model runner.

Every step the MoE layers count the tokens routed to each physical expert into their expert_load_pass buffers (inside
the graph: graphinfer::eplb_map_to_physical_and_record); after the forward the runner files them into a window of the
last window_size steps, on the device (record: no host read). Every step_interval steps, before a step's forward,
every rank of the EP group (tensor-parallel ranks step together; data-parallel + EP replicas in lockstep) runs
rearrange at the same step:
  1. the window's physical load, all-reduced over the EP group (each tensor-parallel rank counted its replica's
     tokens: divided by tp), folded into the logical load through the placement it was counted under;
  2. EP rank 0 runs the policy (eplb/policy.py: vLLM's default), keeps each rank's experts in the slots they
     already had (eplb/transfer.py: keep_in_place), and broadcasts the new placement;
  3. the experts move, one MoE layer at a time: per layer, plan_moves (eplb/transfer.py) says which slot gets which
     expert from where; this rank's new slots are filled in a staging buffer of one layer's local experts (local
     copies, and torch.distributed point-to-point receives from the ranks that held them, while it sends what others
     need from its unchanged weights), then copied into place, and the layer's logical-to-physical map is rewritten
     in place. So no more than one layer's local experts are ever held twice, and no step runs until every layer is
     done: a step never sees half-moved weights. Captured graphs read the weights and the maps at fixed addresses:
     they replay unchanged.
The window restarts with each placement, so the load it holds was counted under one placement (exact logical load;
the physical imbalance is the placement's own). Moved bytes and seconds are logged and kept for eplb_stats().
"""
import logging
import time

import torch
import torch.distributed as dist

from graphinfer.config import EPLBConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.eplb import balancedness, rank_imbalance, rebalance_experts
from graphinfer.eplb.transfer import keep_in_place, plan_moves
from graphinfer.models.parallel_layers import MoEExperts, logical_maps_of

logger = logging.getLogger(__name__)

HISTORY = 100  # rearrangements eplb_stats() lists


def _imbalance(load: torch.Tensor) -> list[float]:
    """max / mean of each row of load [layers, ranks] (1.0 for a row with no load)."""
    mean = load.double().mean(-1)
    top = load.double().max(-1).values
    return torch.where(mean > 0, top / mean.clamp(min=1e-300), torch.ones_like(mean)).tolist()


class EplbState:
    def __init__(self, layers: dict[int, MoEExperts], config: EPLBConfig, device: torch.device, synchronize):
        """layers: the model's MoE layers (built with a placement: MoEExperts.eplb); synchronize(): wait for the
        device (the platform's), so a rearrangement's seconds are its own."""
        self.layer_ids = list(layers)
        self.layers = list(layers.values())
        self.config, self.device, self.synchronize = config, device, synchronize
        first = self.layers[0]
        self.ep_size, self.ep_rank, self.tp = first.ep_size, first.ep_rank, ps.tp_size()
        self.num_logical, self.num_physical = first.global_num_experts, first.num_physical_experts
        # the window: physical load per step, [window_size, layers, physical experts], on the device
        self.window = torch.zeros(config.window_size, len(self.layers), self.num_physical, dtype=torch.int64,
                                  device=device)
        self.window_steps = 0  # steps counted under the current placement
        self.steps = 0  # steps since the last rearrangement (or the start)
        self.fresh = True  # warm-up and capture ran the layers: their pass counts are noise until the first step
        # staging for one layer's local experts (the bound on what a move holds twice)
        self.w13_buffer = torch.empty_like(first.w13_weight.data)
        self.w2_buffer = torch.empty_like(first.w2_weight.data)
        self.expert_bytes = (first.w13_weight[0].numel() * first.w13_weight.element_size()
                             + first.w2_weight[0].numel() * first.w2_weight.element_size())
        self.rearrangements = 0
        self.moved_bytes_total = 0
        self.seconds_total = 0.0
        self.last: dict = {}
        self.history: list[dict] = []  # per rearrangement (the last HISTORY): imbalances, bytes, seconds

    # ----- every step -----
    def before_step(self) -> None:
        """Before a step's forward: rearrange when step_interval steps have run since the last time."""
        if self.fresh:
            torch._foreach_zero_([m.expert_load_pass for m in self.layers])
            self.fresh = False
        if self.steps >= self.config.step_interval:
            self.rearrange()

    def after_step(self) -> None:
        """After a step's forward: its physical load into the window (device ops only)."""
        slot = self.window[self.window_steps % self.config.window_size]
        torch.stack([m.expert_load_pass for m in self.layers], out=slot)
        torch._foreach_zero_([m.expert_load_pass for m in self.layers])
        self.window_steps += 1
        self.steps += 1
        if self.config.log_balancedness and self.ep_rank == 0:  # a host read each step: only when asked
            load = slot.view(len(self.layers), self.ep_size, -1).sum(-1).cpu()
            logger.info("EPLB step balancedness %.4f (mean / max tokens per EP rank, this replica's step)",
                        balancedness(load))

    # ----- a rearrangement -----
    def placement(self) -> torch.Tensor:
        """The current placement [layers, physical experts] (the logical expert of each slot), int64 on the host."""
        return torch.tensor([m.placement for m in self.layers], dtype=torch.int64)

    @torch.no_grad()
    def rearrange(self) -> None:
        self.synchronize()
        start = time.perf_counter()
        n = min(self.window_steps, self.config.window_size)
        load = self.window[:n].sum(0)  # [layers, physical]
        ps.collective("EPLB load all_reduce", ps.EP_GROUP, lambda group: dist.all_reduce(load, group=group))
        load = load.cpu() // self.tp
        old = self.placement()
        logical = torch.zeros(len(self.layers), self.num_logical, dtype=torch.int64).scatter_add_(1, old, load)
        # the policy's global form (one expert group, one node): the layers do not know a model's expert groups
        if self.ep_rank == 0:
            new = rebalance_experts(logical, self.num_physical, 1, 1, self.ep_size)[0]
            new = torch.tensor([keep_in_place(o, n, self.ep_size) for o, n in zip(old.tolist(), new.tolist())])
        else:
            new = torch.empty_like(old)
        new = new.to(self.device)
        ps.collective("EPLB placement broadcast", ps.EP_GROUP, lambda group: dist.broadcast(new, src=0, group=group))
        new = new.cpu()
        moved = copied = 0
        for i, layer in enumerate(self.layers):
            a, b = self._move_layer(layer, old[i].tolist(), new[i].tolist())
            moved, copied = moved + a, copied + b
        for i, layer in enumerate(self.layers):  # the maps as the layer built them, rewritten in place
            layer.placement = new[i].tolist()
            log2phy, count = logical_maps_of(layer.placement, self.num_logical)
            layer.logical_to_physical_map.copy_(log2phy)
            layer.logical_replica_count.copy_(count)
        self.synchronize()
        seconds = time.perf_counter() - start
        L = len(self.layers)
        measured = _imbalance(load.view(L, self.ep_size, -1).sum(-1))  # physical slots, as placed
        without = _imbalance(logical.view(L, self.ep_size, -1).sum(-1))  # logical experts, contiguous (E % ep == 0)
        predicted = rank_imbalance(new, logical, self.ep_size).tolist()
        self.rearrangements += 1
        self.moved_bytes_total += moved
        self.seconds_total += seconds
        self.last = {
            "window_steps": n, "window_routed_slots": int(load.sum()) // L,  # tokens x top_k per MoE layer
            # the window just ended, under the placement it was counted with
            "rank_imbalance": _mean(measured), "rank_imbalance_per_layer": dict(zip(self.layer_ids, measured)),
            # the same logical load under the plain contiguous placement of the logical experts (no EPLB)
            "rank_imbalance_without_eplb": _mean(without),
            # the same load under the new placement, each expert's tokens split evenly over its replicas
            "predicted_rank_imbalance": _mean(predicted),
            "moved_bytes": moved, "copied_bytes": copied, "seconds": seconds}
        self.history = self.history[-(HISTORY - 1):] + [
            {k: self.last[k] for k in ("rank_imbalance", "rank_imbalance_without_eplb", "moved_bytes", "seconds")}]
        self.window_steps = self.steps = 0
        if self.ep_rank == 0:
            logger.info("EPLB rearrangement %d: window of %d steps, EP-rank imbalance %.3f (contiguous %.3f), next "
                        "placement %.3f; moved %.2f MiB between ranks (+%.2f MiB within) in %.3f s",
                        self.rearrangements, n, self.last["rank_imbalance"], self.last["rank_imbalance_without_eplb"],
                        self.last["predicted_rank_imbalance"], moved / 2**20, copied / 2**20, seconds)

    def _move_layer(self, layer: MoEExperts, old: list[int], new: list[int]) -> tuple[int, int]:
        """One layer's experts to placement `new`; (bytes sent between all ranks, bytes copied within ranks)."""
        moves = plan_moves(old, new, self.ep_size)
        if not moves:
            return 0, 0
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        mine = [m for m in moves if m.dst_rank == self.ep_rank]
        p2p = []  # (isend / irecv, tensor, peer): posted in plan order on every rank, so the pairs match
        for k, m in enumerate(mine):
            if m.src_rank == self.ep_rank:
                self.w13_buffer[k].copy_(w13[m.src_slot])
                self.w2_buffer[k].copy_(w2[m.src_slot])
            else:
                p2p += [(dist.irecv, self.w13_buffer[k], m.src_rank), (dist.irecv, self.w2_buffer[k], m.src_rank)]
        for m in moves:
            if m.src_rank == self.ep_rank and m.dst_rank != self.ep_rank:
                p2p += [(dist.isend, w13[m.src_slot], m.dst_rank), (dist.isend, w2[m.src_slot], m.dst_rank)]
        if p2p:
            def exchange(group):
                for request in dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in p2p]):
                    request.wait()
            ps.collective("EPLB expert transfer", ps.EP_GROUP, exchange)
        for k, m in enumerate(mine):
            w13[m.dst_slot].copy_(self.w13_buffer[k])
            w2[m.dst_slot].copy_(self.w2_buffer[k])
        remote = sum(m.src_rank != m.dst_rank for m in moves)
        return remote * self.expert_bytes, (len(moves) - remote) * self.expert_bytes

    def stats(self) -> dict:
        """What eplb_stats() reports (JSON-ready)."""
        return {"enabled": True, "num_redundant_experts": self.num_physical - self.num_logical,
                "num_physical_experts": self.num_physical, "ep_size": self.ep_size,
                "window_size": self.config.window_size, "step_interval": self.config.step_interval,
                "steps_since_rearrangement": self.steps, "rearrangements": self.rearrangements,
                "moved_bytes_total": self.moved_bytes_total, "seconds_total": self.seconds_total,
                "last": dict(self.last), "history": list(self.history)}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 1.0
