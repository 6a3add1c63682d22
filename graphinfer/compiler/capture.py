"""Bucketed device-graph capture of the decode forward (FULL_DECODE_ONLY).

One graph per capture size (vLLM's bucket list by default), all recorded over one set of static input
buffers and one shared memory pool, largest first so the smaller graphs reuse the pool's blocks. A
uniform decode batch of B rows replays the graph of the smallest size >= B: rows B..size-1 are padding
that writes no KV (slot -1) and attends to nothing (context length 0, block-table row 0). Batches
bigger than the largest size, or with any prefill, run eagerly.

The captured function is the model's decode step up to the logits (LM head inside the graph by
default) or up to the hidden states; sampling always runs outside (per-request parameters, seeds and
sorting would need one graph per sampling configuration).
"""
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from graphinfer.models.layers import AttentionMetadata
from graphinfer.platforms import Platform

logger = logging.getLogger(__name__)


@dataclass
class CaptureStats:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool took (free memory before - after)

    def summary(self) -> str:
        return (f"captured {len(self.sizes)} decode graphs (batch sizes {self.sizes[0]}..{self.sizes[-1]}) in "
                f"{self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB")


class DecodeGraphs:
    """Device graphs of `forward(input_ids, positions, attn_metadata)` for uniform decode batches."""

    def __init__(self, forward: Callable[[Tensor, Tensor, AttentionMetadata], Tensor], platform: Platform,
                 device: torch.device, sizes: list[int], max_blocks_per_seq: int):
        self.forward = forward
        self.platform = platform
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        z = dict(device=device)
        # The static inputs every graph reads; replay copies a step's inputs into their first rows.
        self.input_ids = torch.zeros(n, dtype=torch.int64, **z)
        self.positions = torch.zeros(n, dtype=torch.int64, **z)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **z)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, **z)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, **z)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **z)  # one query row per request
        self.output: Tensor | None = None  # the static output all graphs write their first rows of
        self.graphs: dict[int, object] = {}
        self.stats: CaptureStats | None = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _args(self, bs: int):
        md = AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.query_start_loc[:bs + 1],
                               self.seq_lens[:bs])
        return self.input_ids[:bs], self.positions[:bs], md

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> CaptureStats:
        p = self.platform
        device = self.input_ids.device
        p.synchronize()
        free_before = p.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = p.graph_pool_handle()
        stream = p.new_stream()
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="Capturing decode graphs", disable=not progress):
            args = self._args(bs)
            out = self.forward(*args)  # warm-up outside the capture: Triton compiles, library handles get created
            if self.output is None:
                self.output = out.new_empty(self.max_size, *out.shape[1:])
            del out
            p.synchronize()
            graph = p.graph_class()()
            with p.graph_capture(graph, pool, stream):
                # Copying into one static output (rather than keeping each graph's own output alive) lets the
                # pool reuse every graph's memory for the next: per-bucket logits would add up to gigabytes.
                self.output[:bs].copy_(self.forward(*args))
            self.graphs[bs] = graph
        p.synchronize()
        self.stats = CaptureStats(self.sizes, time.perf_counter() - start, free_before - p.mem_get_info(device)[0])
        logger.info(self.stats.summary())
        return self.stats

    def bucket(self, batch: int) -> int | None:
        """The capture size a batch of `batch` rows replays, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
               block_tables: np.ndarray, seq_lens: np.ndarray) -> Tensor:
        """Run the graph for a decode batch given as host arrays; returns the first B rows of its output."""
        b, width = block_tables.shape
        bs = self.bucket(b)
        for static, host in ((self.input_ids, input_ids), (self.positions, positions),
                             (self.slot_mapping, slot_mapping), (self.seq_lens, seq_lens)):
            static[:b].copy_(torch.from_numpy(host), non_blocking=True)
        self.block_tables[:b, :width].copy_(torch.from_numpy(block_tables), non_blocking=True)
        if bs > b:  # padded rows: no KV write, no context (stale ids/positions are harmless)
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].zero_()
            self.block_tables[b:bs].zero_()
        host_lens = np.zeros(bs, dtype=np.int32)
        host_lens[:b] = seq_lens
        self.platform.before_graph_replay(self.graphs[bs], host_lens)  # e.g. Ascend: patch FIA's host lengths
        self.graphs[bs].replay()
        return self.output[:b]
