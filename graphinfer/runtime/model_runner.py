"""Turns a scheduled step into flat model inputs, runs the model, and samples.

Owns the paged KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
whose per-layer views are handed to the model's attention modules.
"""
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from graphinfer.runtime.device_graphs import CaptureStats, DecodeGraphs, staged
from graphinfer.runtime.piecewise_graphs import PiecewiseGraphs
from graphinfer.compiler.split import SplitGraph
from graphinfer.compiler.trace import rebind_buffers
from graphinfer.config import CacheConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import KVCacheTooSmallError
from graphinfer.models.layers import AttentionMetadata, PagedAttention, activation_dtype, allocate_kv_cache
from graphinfer.platforms import Platform
from graphinfer.runtime.expert_load import moe_layers
from graphinfer.runtime.sampler import Sampler, SamplerOutput
from graphinfer.runtime.scheduler import SchedulerOutput
from graphinfer.runtime.sequence import Sequence
from graphinfer.runtime.spec_decode.verify import verify, warm_up_rejection_sample

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
    # Data-parallel lockstep (runtime/dp_lockstep.py): the last num_pad tokens are padding every replica's step
    # to the same shape, and decode_graphs False keeps a uniform decode batch off the decode graphs because
    # another replica's step cannot replay one (their collectives must pair).
    decode_graphs: bool = True
    num_pad: int = 0
    # Speculative decoding: drafts per row (row i samples spec_lens[i] + 1 logits rows, in order); None: none has any
    spec_lens: list[int] | None = None

    def pending_index(self) -> np.ndarray | None:
        """[2, P] int64 (dst; src), or None when the pending ids are simply the first P sampled ones, in order."""
        n = len(self.pending_dst)
        if self.pending_dst == self.pending_src == list(range(n)):
            return None
        return np.array([self.pending_dst, self.pending_src], dtype=np.int64)


def kv_cache_budget(gpu_memory_utilization: float, free: int, total: int, unused_cache: int, engine_bytes: int,
                    activation_bytes: int, graph_bytes: int) -> int:
    """Bytes the KV cache may take on a GPU, vLLM's arithmetic: this engine may use gpu_memory_utilization of the
    device's TOTAL memory (two engines at 0.4 fit side by side), less what it already holds (engine_bytes: weights,
    fused copies, buffers), less the profiled peak of a step's activations and the estimated graph pool; and all of
    that within what is free now (memory the caching allocator keeps but nothing uses counts as free). No hidden
    factor: the rest of the device, (1 - gpu_memory_utilization) of it, is the head-room (CUDA context, kernels'
    workspaces, other processes)."""
    return int(min(gpu_memory_utilization * total - engine_bytes, free + unused_cache) - activation_bytes - graph_bytes)


class ModelRunner:
    def __init__(self, model, cache_config: CacheConfig, device: torch.device, platform: Platform,
                 eos_token_ids: set[int], seed: int, max_model_len: int, engine_bytes: int = 0,
                 placeholder_kv: bool = False, graph=None, step_tokens: int = 0, logits_rows: int = 1,
                 graph_tokens: int = 0, logprobs_mode: str = "raw_logprobs"):
        """engine_bytes: device memory the engine took before the KV cache (weights, fused copies, buffers), which
        gpu_memory_utilization counts; placeholder_kv: a 1-block cache (`graphinfer compile`, which serves nothing).
        step_tokens (max_num_batched_tokens), logits_rows (max_num_seqs), graph_tokens (the largest capture size; 0:
        no graphs): the shapes whose activation peaks are profiled, with `graph` (the engine's fused graph; None:
        the model), before a GPU's KV cache is sized by gpu_memory_utilization."""
        self.model = model
        self.compute_logits = model.compute_logits  # the compile pipeline may swap in a lowered LM head (cpu: packed)
        self.graph = model if graph is None else graph  # what runs the forward (the engine sets its compiled graph)
        self.device = device
        self.platform = platform
        self.decode_graphs: DecodeGraphs | None = None  # FULL_DECODE_ONLY / FULL_AND_PIECEWISE: capture_decode_graphs
        self.verify_graphs: DecodeGraphs | None = None  # the same, 1 + k tokens per request (speculative decoding)
        self.piecewise_graphs: PiecewiseGraphs | None = None  # PIECEWISE / FULL_AND_PIECEWISE: capture_piecewise_graphs
        self.lm_head_in_graph = False
        self.block_size = cache_config.block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        # MoE models: the step's real token count, read by every MoE layer's expert-load count (runtime/expert_load.py)
        # at a fixed address, so captured graphs see each step's value and their padded rows count nothing.
        self.moe_layers = moe_layers(model)
        self.num_tokens = torch.zeros(1, dtype=torch.int64, device=device) if self.moe_layers else None
        for layer in self.moe_layers.values():
            layer.num_tokens = self.num_tokens
        self.profile = dict(step_tokens=step_tokens, logits_rows=logits_rows, graph_tokens=graph_tokens,
                            max_model_len=max_model_len)
        self.num_blocks = 1 if placeholder_kv else self._num_kv_blocks(cache_config, max_model_len, engine_bytes)
        self.num_blocks = ps.min_across_ranks(self.num_blocks)  # tensor parallel: every rank's cache alike
        self.kv_cache = allocate_kv_cache(model, self.num_blocks, self.block_size)
        self.kv_pages = None  # cpu: the thread committing the cache's pages (runtime/startup.py starts it)
        if not placeholder_kv:
            logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                        self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)
        self.sampler = Sampler(eos_token_ids, seed=seed, device=device, kernel=platform.sample_kernel,
                               logprobs_mode=logprobs_mode)
        self.channel = None  # tensor parallel, on rank 0: the StepChannel to the other ranks

    def _block_bytes(self) -> int:
        a = self.attn_layers[0]
        dtype_size = torch.empty((), dtype=activation_dtype(self.model)).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * dtype_size

    def _num_kv_blocks(self, cfg: CacheConfig, max_model_len: int, engine_bytes: int) -> int:
        """Blocks for the cache budget; a budget that cannot hold one request of max_model_len tokens is refused
        here, at start-up (num_gpu_blocks_override, a testing knob, is taken as given)."""
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        budget, source = cfg.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        if budget is None and self.device.type == "cpu":
            budget, source = _CPU_KV_CACHE_BYTES, "kv_cache_memory_bytes (default on cpu: 1 GiB)"
        elif budget is None:  # vLLM's meaning of gpu_memory_utilization (kv_cache_budget)
            activation_bytes, graph_bytes = self._profile_peaks()
            free, total = self.platform.mem_get_info(self.device)
            unused_cache = self.platform.memory_reserved(self.device) - self.platform.memory_allocated(self.device)
            budget = kv_cache_budget(cfg.gpu_memory_utilization, free, total, unused_cache, engine_bytes,
                                     activation_bytes, graph_bytes)
            source = (f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB, less the "
                      f"engine's {engine_bytes / 2**30:.2f} GiB (weights, buffers), the profiled peak of a step's "
                      f"activations {activation_bytes / 2**30:.2f} GiB and of the largest captured graph "
                      f"{graph_bytes / 2**30:.2f} GiB; {free / 2**30:.1f} GiB free on the device")
            logger.info("KV cache budget %.2f GiB: %s", max(0, budget) / 2**30, source)
        blocks = max(0, budget) // self._block_bytes()
        needed = -(-max_model_len // self.block_size)
        if blocks < needed:
            raise KVCacheTooSmallError(
                f"The KV cache would hold {blocks} blocks of {self.block_size} tokens ({max(0, budget) / 2**20:.0f} MiB "
                f"from {source}), but one request of max_model_len={max_model_len} tokens needs {needed} "
                f"({needed * self._block_bytes() / 2**20:.0f} MiB). Lower max_model_len (--max-model-len), or give the "
                f"cache more memory: gpu_memory_utilization (--gpu-memory-utilization) on a GPU, kv_cache_memory_bytes "
                f"(--kv-cache-memory-bytes) on any device.")
        return blocks

    @torch.inference_mode()
    def _profile_peaks(self) -> tuple[int, int]:
        """(activation, graph) bytes: the peak device memory above what the engine holds of an eager forward of a
        full step (step_tokens tokens as requests of at most max_model_len, the LM head on logits_rows rows and a
        sampler-sized softmax + sort), and of one of graph_tokens tokens (the largest captured graph: its pool keeps
        about that much). A 1-block KV cache stands in (slots -1 write nothing); the engine points the graph at the
        real one once it is allocated."""
        p = self.profile
        if not p["step_tokens"]:
            return 0, 0
        allocate_kv_cache(self.model, 1, self.block_size)
        if isinstance(self.graph, fx.GraphModule):
            rebind_buffers(self.graph, self.model)
        peaks = []
        for tokens in (p["step_tokens"], p["graph_tokens"]):
            if not tokens:
                peaks.append(0)
                continue
            self.platform.synchronize()
            self.platform.reset_peak_memory_stats(self.device)
            before = self.platform.memory_allocated(self.device)
            self._dummy_step(tokens, p["max_model_len"], min(p["logits_rows"], tokens))
            self.platform.synchronize()
            peaks.append(max(0, self.platform.max_memory_allocated(self.device) - before))
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = None
        return peaks[0], peaks[1]

    def _dummy_step(self, tokens: int, max_len: int, rows: int) -> None:
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        blocks = -(-max(lens) // self.block_size)
        dev, i32, i64 = self.device, torch.int32, torch.int64
        md = AttentionMetadata(torch.full((tokens,), -1, dtype=i64, device=dev),
                               torch.zeros(len(lens), blocks, dtype=i32, device=dev),
                               torch.tensor(np.cumsum([0, *lens]), dtype=i32, device=dev),
                               torch.tensor(lens, dtype=i32, device=dev))
        positions = torch.cat([torch.arange(n, dtype=i64, device=dev) for n in lens])
        hidden = self.graph(torch.zeros(tokens, dtype=i64, device=dev), positions, md)
        logits = self.compute_logits(hidden[-rows:]).float()
        torch.sort(logits.softmax(-1), dim=-1, descending=True)  # about the sampler's working set (top-p sorts)

    @torch.inference_mode()
    def warm_up(self, speculative: bool = False) -> None:
        """Run the eager forward (and the LM head) on a few dummy prefills that write no KV, so the kernels a
        first request needs are compiled, or loaded from the kernel cache, now rather than at that request.
        Lengths 16 and 7: a multiple of 16 and not (Triton specialises integer arguments on divisibility by 16).
        Then the sampling-side kernels: rejection sampling (speculative decoding) and structured outputs' mask."""
        for n in (16, 7):
            blocks = -(-n // self.block_size)
            md = AttentionMetadata(torch.full((n,), -1, dtype=torch.int64, device=self.device),
                                   torch.zeros(1, blocks, dtype=torch.int32, device=self.device),
                                   torch.tensor([0, n], dtype=torch.int32, device=self.device),
                                   torch.tensor([n], dtype=torch.int32, device=self.device))
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            positions = torch.arange(n, dtype=torch.int64, device=self.device)
            self.compute_logits(self.graph(ids, positions, md)[-1:])
        if speculative:
            warm_up_rejection_sample(self.device)
        logits = torch.zeros(1, self.model.config.vocab_size, dtype=activation_dtype(self.model), device=self.device)
        torch.ops.graphinfer.apply_token_bitmask(logits, torch.full((1, -(-logits.shape[1] // 32)), -1,
                                                                    dtype=torch.int32, device=self.device))
        self.platform.synchronize()

    def release(self) -> None:
        """Free the captured graphs (and their memory pool), their static buffers and the KV cache."""
        if self.kv_pages is not None:  # still committing the cache's pages: it holds the cache
            self.kv_pages.stop()
            self.kv_pages = None
        for graphs in (self.decode_graphs, self.verify_graphs, self.piecewise_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.verify_graphs = self.piecewise_graphs = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = self.graph = self.model = self.compute_logits = self.sampler = self.num_tokens = None
        self.attn_layers, self.moe_layers = [], {}

    def host_inputs(self, out: SchedulerOutput) -> HostInputs:
        """Flat input_ids/positions over all scheduled tokens, the attention metadata, and the rows
        (last token of each sequence that completes its prompt or decodes) whose logits get sampled."""
        bs = self.block_size
        input_ids, positions, query_start_loc, seq_lens, logits_indices, rows = [], [], [0], [], [], []
        tables, pending_dst, pending_src, spec_lens = [], [], [], []
        for seq, n in out.scheduled:  # plain lists: per-row numpy calls cost more than they save at batch 256
            start = seq.num_computed_tokens
            k = len(seq.spec_token_ids)  # drafts: the scheduled tokens' last k, after the sequence's own
            if n == 1:
                if start == len(seq.token_ids):  # sampled by the in-flight step: the device fills it in
                    pending_dst.append(len(input_ids))
                    pending_src.append(seq.pending_row)
                    input_ids.append(0)
                else:
                    input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:start + n - k])
                input_ids.extend(seq.spec_token_ids)
                positions.extend(range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            if start + n == seq.num_tokens + k:
                end = query_start_loc[-1]
                if k:
                    logits_indices.extend(range(end - 1 - k, end))
                else:
                    logits_indices.append(end - 1)
                rows.append(seq)
                spec_lens.append(k)
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
        positions = np.array(positions, dtype=np.int64)
        query_start_loc = np.array(query_start_loc, dtype=np.int32)
        row = np.repeat(np.arange(len(tables)), np.diff(query_start_loc))
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        return HostInputs(np.array(input_ids, dtype=np.int64), positions, slot_mapping, block_tables, query_start_loc,
                          np.array(seq_lens, dtype=np.int32), np.array(logits_indices, dtype=np.int64), rows,
                          pending_dst, pending_src, spec_lens=spec_lens if any(spec_lens) else None)

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
                              progress: bool = True, query_len: int = 1) -> CaptureStats:
        """FULL_DECODE_ONLY: record the decode step (up to the logits, or the hidden states) per batch size;
        query_len 1 + k: speculative decoding's verification step (into verify_graphs)."""
        if lm_head_in_graph:
            def forward(ids, pos, md):
                return self.compute_logits(self.graph(ids, pos, md))
        else:
            forward = self.graph
        self.lm_head_in_graph = lm_head_in_graph
        graphs = DecodeGraphs(forward, self.platform, self.device, sizes,
                              max_blocks_per_seq=-(-max_model_len // self.block_size), query_len=query_len)
        if query_len == 1:
            self.decode_graphs = graphs
        else:
            self.verify_graphs = graphs
        return graphs.capture(progress)

    def capture_piecewise_graphs(self, split: SplitGraph, sizes: list[int], progress: bool = True) -> CaptureStats:
        """PIECEWISE: record the split graph's pieces per token count; attention runs eagerly between them."""
        self.piecewise_graphs = PiecewiseGraphs(split, self.platform, self.device, sizes)
        return self.piecewise_graphs.capture(progress)

    def _full_graphs(self, h: HostInputs) -> DecodeGraphs | None:
        """The full graphs that cover this step: a uniform batch (one token per request: decode graphs; 1 + k:
        verify graphs) of at most their largest size. Decided from the shapes, as every tensor-parallel rank can."""
        b, t = len(h.seq_lens), len(h.input_ids)
        if not h.decode_graphs or not b:
            return None
        g = self.decode_graphs if t == b else self.verify_graphs
        if g is None or b > g.max_size or t != b * g.query_len:
            return None
        return g if g.query_len == 1 or (np.diff(h.query_start_loc) == g.query_len).all() else None

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput | None, prev_tokens: torch.Tensor | None = None,
                      share_sampled: bool = False, dp_step=None,
                      mask_logits=None) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sample this step and the sampler's output, on the device
        (nothing here waits for the device). prev_tokens: the in-flight step's sampled ids (async scheduling),
        which, with share_sampled, the other tensor-parallel ranks get too. dp_step: the shape the data-parallel
        replicas agreed on (runtime/dp_lockstep.py), to pad to; out None: a padding-only step. mask_logits(logits,
        rows, spec_lens): called once the forward is launched, before sampling, to mask the logits in place
        (structured outputs); they are the forward's output, outside any captured graph."""
        h = self.host_inputs(out) if out is not None else None
        if dp_step is not None:
            from graphinfer.runtime import dp_lockstep  # it builds on HostInputs

            h = dp_lockstep.pad(h or dp_lockstep.empty_inputs(), dp_step)
        share = share_sampled and self.channel is not None and len(h.logits_indices) > 0
        if self.channel is not None:  # the other ranks run the same step on the same inputs
            self.channel.send_step(h, share)
            ps.set_phase(f"step {self.channel.steps}")
        try:
            logits = self.step_logits(h, prev_tokens)
            if logits is None:
                return h.rows, None
            if mask_logits is not None:
                mask_logits(logits, h.rows, h.spec_lens)
            if h.spec_lens is None:
                sampled = self.sampler(logits, h.rows)
            else:
                sampled = verify(self.sampler, logits, h.rows, h.spec_lens, self.to_device)
            if share:
                ps.broadcast_from_rank0(sampled.sampled_token_ids)
        except BaseException as e:  # the other ranks may wait in a collective of this step: no further step
            if self.channel is not None:
                self.channel.broken = f"step {self.channel.steps} failed on rank 0 ({type(e).__name__}: {e})"
            raise
        return h.rows, sampled

    @torch.inference_mode()
    def step_logits(self, h: HostInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logits for the rows that sample (None when every sequence is mid-prompt); every
        tensor-parallel rank runs this, in the same order, with the same inputs.

        A uniform decode batch replays a full decode graph if there is one of its size; any other step up to
        the largest piecewise size replays the pieces; the rest run the graph eagerly."""
        fill_pending = lambda ids: self.fill_pending(ids, h, prev_tokens)  # noqa: E731
        if self.num_tokens is not None:  # the real rows: a padded bucket's others count no expert load
            self.num_tokens.fill_(len(h.input_ids) - h.num_pad)
        logits_ready = False
        if (graphs := self._full_graphs(h)) is not None:
            hidden = graphs.replay(h.input_ids, h.positions, h.slot_mapping, h.block_tables, h.seq_lens,
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
        rows = len(h.logits_indices)
        if not rows:  # every sequence is mid-prompt (chunked prefill): nothing to sample yet
            return None
        if rows < len(h.input_ids):  # some rows are not the last of their sequence's scheduled tokens
            hidden = hidden[self.to_device(h.logits_indices)]
        return hidden if logits_ready else self.compute_logits(hidden)
