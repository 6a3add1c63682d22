"""PIECEWISE capture: the split graph's attention-free pieces recorded per token-count bucket.

A step of T scheduled tokens (any mix of prefill chunks and decodes) runs the split module with its token
count padded to the smallest capture size >= T: the static inputs (input_ids, positions, slot_mapping)
hold the T real tokens and then padding (id 0, position 0, slot -1: no KV written), each piece replays its
device graph for that size, and the splitting ops (attention) run eagerly between the pieces on the step's
real attention metadata, which covers the T real rows only (the rows past query_start_loc[-1] come out 0).

Static memory: a replayed graph reads and writes fixed addresses, so every tensor that crosses a piece
boundary lives in a buffer allocated once, outside the graphs: a piece's outputs are copied (inside its
graph) into such buffers, and an attention output is copied (eagerly) into the next piece's input buffer.
Buffers are shared between values whose lifetimes (in piece order) do not overlap, so the static memory is
about two layers' activations at the largest size, not one per layer. Everything else a piece allocates
is scratch in the shared graph pool and can be reused by the next piece and the next size: nothing a
graph allocated is read after it ran. Sizes are captured largest first, as for FULL_DECODE_ONLY.
"""
import bisect
import logging
import operator
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, fx, nn
from tqdm.auto import tqdm

from graphinfer.runtime.worker.device_graphs import CaptureStats, measured_capture, release_graphs, staged
from graphinfer.compiler.split import SplitGraph, is_metadata_read
from graphinfer.models.layers import AttentionMetadata
from graphinfer.platforms import Platform

logger = logging.getLogger(__name__)


class _BufferArena:
    """Flat static buffers handed out by lifetime: a buffer is reused once its last value's last reader ran."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[list] = []  # [flat tensor, busy until (node index)]
        self.assigned: dict[tuple, Tensor] = {}  # (piece, kind, slot) -> its flat buffer, for every size

    def view(self, key: tuple, like: Tensor, start: int, end: int) -> Tensor:
        """A buffer shaped like `like` for the value `key`, live from node `start` to node `end`."""
        flat = self.assigned.get(key)
        if flat is None:
            fits = [b for b in self.buffers if b[1] < start and b[0].dtype == like.dtype and b[0].numel() >= like.numel()]
            if fits:
                entry = min(fits, key=lambda b: b[0].numel())
            else:
                entry = [torch.empty(like.numel(), dtype=like.dtype, device=self.device), end]
                self.buffers.append(entry)
            entry[1] = max(entry[1], end)
            flat = self.assigned[key] = entry[0]
        if flat.numel() < like.numel():
            raise RuntimeError(f"static buffer for {key} holds {flat.numel()} elements, {like.numel()} needed: sizes "
                               f"must be captured largest first")
        return flat[:like.numel()].view(like.shape)

    @property
    def nbytes(self) -> int:
        return sum(b[0].numel() * b[0].element_size() for b in self.buffers)


class PieceRunner(nn.Module):
    """Stands in for piece i in the split module: runs it eagerly, captures it, or replays it for the active size."""

    def __init__(self, index: int, piece: fx.GraphModule, owner: "PiecewiseGraphs", node_index: int,
                 copied_args: list[int], output_ends: list[int]):
        super().__init__()
        self.index, self.piece, self.node_index = index, piece, node_index
        self.copied_args = copied_args  # args produced by a splitting op: copied into a static buffer
        self.output_ends = output_ends  # node index of each output's last reader
        self._owner = [owner]  # a list: not a submodule
        self.graphs: dict[int, object] = {}
        self.static_args: dict[int, list] = {}
        self.outputs: dict[int, tuple] = {}

    def forward(self, *args):
        owner = self._owner[0]
        size = owner.active_size
        if size is None:
            return self.piece(*args)
        if owner.capturing:
            return self._capture(size, list(args), owner)
        static = self.static_args[size]
        for j in self.copied_args:
            static[j].copy_(args[j])
        self.graphs[size].replay()
        return self.outputs[size]

    def _capture(self, size: int, args: list, owner: "PiecewiseGraphs") -> tuple:
        p, arena = owner.platform, owner.arena
        for j in self.copied_args:
            buf = arena.view((self.index, "in", j), args[j], self.node_index - 1, self.node_index)
            buf.copy_(args[j])
            args[j] = buf
        warm = self.piece(*args)  # outside the capture: Triton compiles, library handles get created
        outs = tuple(arena.view((self.index, "out", j), v, self.node_index, self.output_ends[j])
                     if isinstance(v, Tensor) else v for j, v in enumerate(warm))
        p.synchronize()

        def run():
            for dst, src in zip(outs, self.piece(*args)):
                if isinstance(dst, Tensor):
                    dst.copy_(src)

        graph = p.capture_graph(run, (), owner.pool, owner.stream)
        for dst, src in zip(outs, warm):  # real values for the eager attention that follows the capture
            if isinstance(dst, Tensor):
                dst.copy_(src)
        self.graphs[size], self.static_args[size], self.outputs[size] = graph, args, outs
        return outs


class PiecewiseGraphs:
    """Device graphs of every piece of a split forward, per token-count capture size."""

    def __init__(self, split: SplitGraph, platform: Platform, device: torch.device, sizes: list[int]):
        self.split = split
        self.platform = platform
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        self._host = np.zeros(3 * n, dtype=np.int64)  # [input_ids | positions | slot_mapping], padding included
        self._host[2 * n:] = -1
        self._dev = torch.from_numpy(self._host).to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._dev.view(3, n)
        self.arena = _BufferArena(device)
        self.active_size: int | None = None  # the size being captured or replayed; None: pieces run eagerly
        self.capturing = False
        self.pool = self.stream = None
        self._install_runners()

    def _install_runners(self) -> None:
        """Swap each `piece_i` of the split module for a PieceRunner that knows its inputs and outputs' lifetimes."""
        module = self.split.module
        self.runners: list[PieceRunner] = []
        nodes = list(module.graph.nodes)
        order = {node: i for i, node in enumerate(nodes)}
        for node in nodes:
            if node.op != "call_module" or not node.target.startswith("piece_"):
                continue
            i = int(node.target.removeprefix("piece_"))
            copied = [j for j, a in enumerate(node.args) if isinstance(a, fx.Node) and not _is_static_source(a)]
            ends = [len(nodes)] * len(next(n for n in self.split.pieces[i].graph.nodes if n.op == "output").args[0])
            for user in node.users:  # getitem(piece call, j)
                assert user.target is operator.getitem
                ends[user.args[1]] = max(order[u] for u in user.users) if user.users else order[user]
            runner = PieceRunner(i, self.split.pieces[i], self, order[node], copied, ends)
            setattr(module, node.target, runner)
            self.runners.append(runner)

    def release(self) -> None:
        """Free every piece's graphs (their pool goes with the last of them), static inputs and outputs, and the
        arena's buffers."""
        for runner in self.runners:
            release_graphs(runner.graphs)
            runner.static_args.clear()
            runner.outputs.clear()
            runner._owner.clear()
        self.runners = []
        self.arena = self._dev = self.input_ids = self.positions = self.slot_mapping = self.split = None

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self.runners[0].graphs)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_tokens: int) -> int | None:
        """The capture size a step of num_tokens tokens replays, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def _dummy_metadata(self, size: int) -> AttentionMetadata:
        """Capture-time metadata: `size` one-row requests with no context (attention outputs zeros)."""
        device = self._dev.device
        return AttentionMetadata(self.slot_mapping[:size], torch.zeros(size, 1, dtype=torch.int32, device=device),
                                 torch.arange(size + 1, dtype=torch.int32, device=device),
                                 torch.zeros(size, dtype=torch.int32, device=device))

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> CaptureStats:
        self.pool, self.stream = self.platform.graph_pool_handle(), self.platform.new_stream()
        stats = measured_capture(self.platform, self._dev.device, self.sizes, lambda: self._capture_all(progress),
                                 kind=f"piecewise graphs ({len(self.split.pieces)} pieces per size)")
        logger.info("static activation buffers: %.0f MiB", self.arena.nbytes / 2**20)
        return stats

    def _capture_all(self, progress: bool) -> None:
        self.capturing = True
        try:
            for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing piecewise graphs", disable=not progress):
                self.active_size = size
                self.split.module(self.input_ids[:size], self.positions[:size], self._dummy_metadata(size))
        finally:
            self.capturing, self.active_size = False, None

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, block_tables: Tensor,
            query_start_loc: Tensor, seq_lens: Tensor, fill_pending: Callable[[Tensor], None] | None = None) -> Tensor:
        """The hidden states of a step's T tokens (host arrays; metadata on the device), via the graphs of the
        smallest size >= T. fill_pending(static input_ids) writes ids still on the device (async scheduling)."""
        t = len(input_ids)
        size = self.bucket(t)
        n = self.max_size
        ids, pos, slots = self._host.reshape(3, n)
        ids[:t], pos[:t], slots[:t] = input_ids, positions, slot_mapping
        ids[t:size], pos[t:size], slots[t:size] = 0, 0, -1
        self._dev.copy_(staged(self._host, self._dev.device), non_blocking=True)
        if fill_pending is not None:
            fill_pending(self.input_ids)
        md = AttentionMetadata(self.slot_mapping[:size], block_tables, query_start_loc, seq_lens)
        self.active_size = size
        try:
            hidden = self.split.module(self.input_ids[:size], self.positions[:size], md)
        finally:
            self.active_size = None
        return hidden[:t]


def _is_static_source(node: fx.Node) -> bool:
    """Whether a piece input already lives at a fixed address: a graph input (the runner's static buffers), a
    metadata field (slot_mapping, static too) or an output of another piece (the arena's buffers)."""
    if node.op == "placeholder" or is_metadata_read(node):
        return True
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "call_module")
