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

from graphinfer.errors import GraphCaptureError
from graphinfer.models.layers import AttentionMetadata
from graphinfer.platforms import Platform

logger = logging.getLogger(__name__)


def staged(x: np.ndarray, device: torch.device) -> Tensor:
    """x as the source of a non-blocking copy to `device`: a pinned copy off cpu (the caching host allocator
    holds it until the copy ran), so the host can rewrite x, or go on, while the copy waits in the stream."""
    t = torch.from_numpy(x)
    return t.pin_memory() if device.type != "cpu" else t


@dataclass
class CaptureStats:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool took (free memory before - after)
    kind: str = "decode graphs"

    def summary(self) -> str:
        return (f"captured {self.kind} for {len(self.sizes)} sizes ({self.sizes[0]}..{self.sizes[-1]}) in "
                f"{self.seconds:.1f} s, {self.memory_bytes / 2**20:.0f} MiB")


def measured_capture(platform: Platform, device: torch.device, sizes: list[int], capture: Callable[[], None],
                     kind: str = "decode graphs") -> CaptureStats:
    """Run capture() inside the platform's capture session; its time and the device memory it took."""
    platform.synchronize()
    free_before = platform.mem_get_info(device)[0]
    start = time.perf_counter()
    with platform.capture_session():
        capture()
    platform.synchronize()
    stats = CaptureStats(sizes, time.perf_counter() - start, free_before - platform.mem_get_info(device)[0], kind)
    logger.info(stats.summary())
    return stats


def release_graphs(graphs: dict) -> None:
    """Reset (free) and forget captured device graphs."""
    for graph in graphs.values():
        if hasattr(graph, "reset"):
            graph.reset()
    graphs.clear()


class DecodeGraphs:
    """Device graphs of `forward(input_ids, positions, attn_metadata)` for uniform batches: query_len tokens per
    request (1: decode; 1 + k: speculative decoding's verification, vLLM's uniform_decode_query_len), per batch size
    (requests) in `sizes`."""

    def __init__(self, forward: Callable[[Tensor, Tensor, AttentionMetadata], Tensor], platform: Platform,
                 device: torch.device, sizes: list[int], max_blocks_per_seq: int, query_len: int = 1):
        self.forward = forward
        self.platform = platform
        self.sizes = sorted(set(sizes))
        self.query_len = q = query_len
        self.rows = n = self.sizes[-1]  # the static buffers' rows (requests), however many sizes get captured
        w = max_blocks_per_seq
        # The static inputs every graph reads, as views of two device buffers that replay fills with one
        # host-to-device copy each (padding included): [input_ids | positions | slot_mapping] (int64) and
        # [seq_lens | block_tables] (int32). The host arrays persist so stale block-table columns cost nothing.
        self._host64 = np.zeros(3 * n * q, dtype=np.int64)
        self._host64[2 * n * q:] = -1
        self._host32 = np.zeros(n + n * w, dtype=np.int32)
        self._dev64 = torch.from_numpy(self._host64).to(device, copy=True)
        self._dev32 = torch.from_numpy(self._host32).to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.view(3, n * q)
        self.seq_lens, self.block_tables = self._dev32[:n], self._dev32[n:].view(n, w)
        self.query_start_loc = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)  # q rows per request
        self.output: Tensor | None = None  # the static output all graphs write their first rows of
        self.graphs: dict[int, object] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _args(self, bs: int):
        md = AttentionMetadata(self.slot_mapping[:bs * self.query_len], self.block_tables[:bs],
                               self.query_start_loc[:bs + 1], self.seq_lens[:bs])
        return self.input_ids[:bs * self.query_len], self.positions[:bs * self.query_len], md

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> CaptureStats:
        pool, stream = self.platform.graph_pool_handle(), self.platform.new_stream()
        return measured_capture(self.platform, self.input_ids.device, self.sizes,
                                lambda: self._capture_all(pool, stream, progress))

    def _capture_all(self, pool, stream, progress: bool) -> None:
        p = self.platform
        desc = "Capturing decode graphs" if self.query_len == 1 else f"Capturing verify graphs ({self.query_len} tokens)"
        for bs in tqdm(sorted(self.sizes, reverse=True), desc=desc, disable=not progress):
            args = self._args(bs)
            out = self.forward(*args)  # warm-up outside the capture: Triton compiles, library handles get created
            if self.output is None:
                self.output = out.new_empty(self.rows * self.query_len, *out.shape[1:])
            del out
            p.synchronize()
            # Copying into one static output (rather than keeping each graph's own output alive) lets the
            # pool reuse every graph's memory for the next: per-bucket logits would add up to gigabytes.
            ids, positions, md = args
            try:
                self.graphs[bs] = p.capture_graph(self._forward_into, (
                    self.output[:bs * self.query_len], ids, positions, md.slot_mapping, md.block_tables,
                    md.query_start_loc, md.seq_lens), pool, stream)
            except GraphCaptureError as e:  # the cpu platform's traces: this size runs eagerly
                if len(self.sizes) == 1:
                    raise
                self.sizes.remove(bs)  # in place: the CaptureStats hold this list
                logger.info("no graph of %d rows (its steps run eagerly): %s", bs, e)

    def _forward_into(self, out: Tensor, input_ids: Tensor, positions: Tensor, *metadata: Tensor) -> Tensor:
        """The captured function, its tensors all arguments (a trace then holds no static buffer as a constant)."""
        return out.copy_(self.forward(input_ids, positions, AttentionMetadata(*metadata)))

    def release(self) -> None:
        """Free the graphs (their pool goes with the last of them) and the static buffers."""
        release_graphs(self.graphs)
        self._dev64 = self._dev32 = self.input_ids = self.positions = self.slot_mapping = None
        self.seq_lens = self.block_tables = self.query_start_loc = self.output = self.forward = None

    def bucket(self, batch: int) -> int | None:
        """The capture size a batch of `batch` rows replays, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
               block_tables: np.ndarray, seq_lens: np.ndarray,
               fill_pending: Callable[[Tensor], None] | None = None) -> Tensor:
        """Run the graph for a batch of B requests (B * query_len tokens) given as host arrays; returns the first
        B * query_len rows of its output. fill_pending(static input_ids) writes ids that are still on the device
        (async scheduling)."""
        b, width = block_tables.shape
        bs = self.bucket(b)
        q, n, w = self.query_len, self.rows, self.block_tables.shape[1]
        ids, pos, slots = self._host64.reshape(3, n * q)
        ids[:b * q], pos[:b * q], slots[:b * q] = input_ids, positions, slot_mapping
        slots[b * q:bs * q] = -1  # padded rows write no KV ...
        lens, tables = self._host32[:n], self._host32[n:].reshape(n, w)
        lens[:b], lens[b:bs] = seq_lens, 0  # ... and attend to nothing
        tables[:b, :width] = block_tables
        tables[b:bs] = 0
        device = self._dev64.device
        self._dev64.copy_(staged(self._host64, device), non_blocking=True)
        self._dev32[:n + bs * w].copy_(staged(self._host32[:n + bs * w], device), non_blocking=True)
        if fill_pending is not None:
            fill_pending(self.input_ids)
        self.platform.before_graph_replay(self.graphs[bs], lens[:bs].copy())  # e.g. Ascend: patch FIA's lengths
        self.graphs[bs].replay()
        return self.output[:b * q]
