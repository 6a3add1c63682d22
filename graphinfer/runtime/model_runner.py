"""Turns a scheduled step into flat model inputs, runs the model, and samples.

Owns the paged KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
whose per-layer views are handed to the model's attention modules.
"""
import logging
from dataclasses import dataclass

import numpy as np
import torch

from graphinfer.compiler.capture import CaptureStats, DecodeGraphs, staged
from graphinfer.compiler.piecewise import PiecewiseGraphs
from graphinfer.compiler.split import SplitGraph
from graphinfer.config import CacheConfig
from graphinfer.models.layers import AttentionMetadata, PagedAttention
from graphinfer.platforms import Platform
from graphinfer.runtime.sampler import Sampler, SamplerOutput
from graphinfer.runtime.scheduler import SchedulerOutput
from graphinfer.runtime.sequence import Sequence

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class HostInputs:
    """One step's flat inputs as host arrays (see host_inputs)."""
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    logits_indices: np.ndarray  # [rows] int64
    rows: list[Sequence]
    # Async scheduling: input_ids[pending_dst[i]] is row pending_src[i] of the in-flight step's sampled tokens,
    # which are still on the device (input_ids holds 0 there until the device fills it in).
    pending_dst: list[int]
    pending_src: list[int]

    def pending_index(self) -> np.ndarray | None:
        """[2, P] int64 (dst; src), or None when the pending ids are simply the first P sampled ones, in order."""
        n = len(self.pending_dst)
        if self.pending_dst == self.pending_src == list(range(n)):
            return None
        return np.array([self.pending_dst, self.pending_src], dtype=np.int64)


def allocate_kv_cache(model, num_blocks: int, block_size: int) -> torch.Tensor:
    """One tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]; each attention layer gets its views."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    weight = model.lm_head.weight
    kv = torch.zeros(len(layers), 2, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim,
                     dtype=weight.dtype, device=weight.device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[i, 0], kv[i, 1]
    return kv


class ModelRunner:
    def __init__(self, model, cache_config: CacheConfig, device: torch.device, platform: Platform,
                 eos_token_ids: set[int], seed: int):
        self.model = model
        self.graph = model  # what runs the forward: the compiled fx graph once the engine has one
        self.device = device
        self.platform = platform
        self.decode_graphs: DecodeGraphs | None = None  # FULL_DECODE_ONLY / FULL_AND_PIECEWISE: capture_decode_graphs
        self.piecewise_graphs: PiecewiseGraphs | None = None  # PIECEWISE / FULL_AND_PIECEWISE: capture_piecewise_graphs
        self.lm_head_in_graph = False
        self.block_size = cache_config.block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.num_blocks = self._num_kv_blocks(cache_config)
        self.kv_cache = allocate_kv_cache(model, self.num_blocks, self.block_size)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)
        self.sampler = Sampler(eos_token_ids, seed=seed, device=device)

    def _block_bytes(self) -> int:
        a = self.attn_layers[0]
        dtype_size = torch.empty((), dtype=self.model.lm_head.weight.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * dtype_size

    def _num_kv_blocks(self, cfg: CacheConfig) -> int:
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cpu":
                budget = _CPU_KV_CACHE_BYTES
            else:  # what gpu_memory_utilization leaves after the weights, minus a margin for activations
                free, total = self.platform.mem_get_info(self.device)
                budget = int((free - (1 - cfg.gpu_memory_utilization) * total) * 0.9)
        return max(1, budget // self._block_bytes())

    def host_inputs(self, out: SchedulerOutput) -> HostInputs:
        """Flat input_ids/positions over all scheduled tokens, the attention metadata, and the rows
        (last token of each sequence that completes its prompt or decodes) whose logits get sampled."""
        bs = self.block_size
        input_ids, positions, query_start_loc, seq_lens, logits_indices, rows = [], [], [0], [], [], []
        tables, pending_dst, pending_src = [], [], []
        for seq, n in out.scheduled:  # plain lists: per-row numpy calls cost more than they save at batch 256
            start = seq.num_computed_tokens
            if n == 1:
                if start == len(seq.token_ids):  # sampled by the in-flight step: the device fills it in
                    pending_dst.append(len(input_ids))
                    pending_src.append(seq.pending_row)
                    input_ids.append(0)
                else:
                    input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:start + n])
                positions.extend(range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == seq.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                rows.append(seq)
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
        positions = np.array(positions, dtype=np.int64)
        query_start_loc = np.array(query_start_loc, dtype=np.int32)
        row = np.repeat(np.arange(len(tables)), np.diff(query_start_loc))
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        return HostInputs(np.array(input_ids, dtype=np.int64), positions, slot_mapping, block_tables, query_start_loc,
                          np.array(seq_lens, dtype=np.int32), np.array(logits_indices, dtype=np.int64), rows,
                          pending_dst, pending_src)

    def to_device(self, x: np.ndarray) -> torch.Tensor:
        return staged(x, self.device).to(self.device, non_blocking=True)

    def fill_pending(self, input_ids: torch.Tensor, h: HostInputs, prev_tokens: torch.Tensor | None) -> None:
        """Async scheduling: write the in-flight step's sampled ids into input_ids, on the device."""
        if not h.pending_dst:
            return
        index = h.pending_index()
        if index is None:
            n = len(h.pending_dst)
            input_ids[:n].copy_(prev_tokens[:n])
        else:
            dst, src = self.to_device(index)
            input_ids[dst] = prev_tokens[src]

    def capture_decode_graphs(self, sizes: list[int], max_model_len: int, lm_head_in_graph: bool = True,
                              progress: bool = True) -> CaptureStats:
        """FULL_DECODE_ONLY: record the decode step (up to the logits, or the hidden states) per batch size."""
        if lm_head_in_graph:
            def forward(ids, pos, md):
                return self.model.compute_logits(self.graph(ids, pos, md))
        else:
            forward = self.graph
        self.lm_head_in_graph = lm_head_in_graph
        self.decode_graphs = DecodeGraphs(forward, self.platform, self.device, sizes,
                                          max_blocks_per_seq=-(-max_model_len // self.block_size))
        return self.decode_graphs.capture(progress)

    def capture_piecewise_graphs(self, split: SplitGraph, sizes: list[int], progress: bool = True) -> CaptureStats:
        """PIECEWISE: record the split graph's pieces per token count; attention runs eagerly between them."""
        self.piecewise_graphs = PiecewiseGraphs(split, self.platform, self.device, sizes)
        return self.piecewise_graphs.capture(progress)

    def _replayable(self, out: SchedulerOutput) -> bool:
        g = self.decode_graphs
        return g is not None and len(out.scheduled) <= g.max_size and all(n == 1 for _, n in out.scheduled)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput,
                      prev_tokens: torch.Tensor | None = None) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sample this step and the sampler's output, on the device
        (nothing here waits for the device). prev_tokens: the in-flight step's sampled ids (async scheduling).

        A uniform decode batch replays a full decode graph if there is one of its size; any other step up to
        the largest piecewise size replays the pieces; the rest run the graph eagerly."""
        h = self.host_inputs(out)
        fill_pending = lambda ids: self.fill_pending(ids, h, prev_tokens)  # noqa: E731
        logits_ready = False
        if self._replayable(out):
            hidden = self.decode_graphs.replay(h.input_ids, h.positions, h.slot_mapping, h.block_tables, h.seq_lens,
                                               fill_pending=fill_pending)
            logits_ready = self.lm_head_in_graph
        elif self.piecewise_graphs is not None and self.piecewise_graphs.bucket(len(h.input_ids)) is not None:
            t = self.to_device
            hidden = self.piecewise_graphs.run(h.input_ids, h.positions, h.slot_mapping, t(h.block_tables),
                                               t(h.query_start_loc), t(h.seq_lens), fill_pending=fill_pending)
        else:
            t = self.to_device
            input_ids = t(h.input_ids)
            fill_pending(input_ids)
            md = AttentionMetadata(t(h.slot_mapping), t(h.block_tables), t(h.query_start_loc), t(h.seq_lens))
            hidden = self.graph(input_ids, t(h.positions), md)
        if not h.rows:  # every sequence is mid-prompt (chunked prefill): nothing to sample yet
            return h.rows, None
        if len(h.rows) < len(h.input_ids):  # some rows are not the last of their sequence's scheduled tokens
            hidden = hidden[self.to_device(h.logits_indices)]
        logits = hidden if logits_ready else self.model.compute_logits(hidden)
        return h.rows, self.sampler(logits, h.rows)
