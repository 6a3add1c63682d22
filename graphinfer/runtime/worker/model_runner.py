"""Turns a scheduled step into flat model inputs, runs the model, and samples.

Owns the paged KV cache: one tensor [num_layers, planes (2, or MLA's 1), num_blocks, block_size, num_kv_heads, head_dim]
whose per-layer views are handed to the model's attention modules; with an MTP drafter (spec_decode/mtp_proposer.py)
also the drafter's cache over the same blocks, which it runs after every step.
"""
import logging

import numpy as np
import torch

from graphinfer.compiler.pipeline import CompiledModel
from graphinfer.compiler.trace import rebind_buffers
from graphinfer.config import CacheConfig, EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import KVCacheTooSmallError
from graphinfer.models.layers import AttentionMetadata, PagedAttention, activation_dtype, allocate_kv_cache
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.engine.scheduler import SchedulerOutput
from graphinfer.runtime.spec_decode.verify import verify, warm_up_rejection_sample
from graphinfer.runtime.worker.device_graphs import staged
from graphinfer.runtime.worker.eplb_state import EplbState
from graphinfer.runtime.worker.expert_load import moe_layers
from graphinfer.runtime.worker.graph_dispatcher import FULL, PIECEWISE, GraphDispatcher
from graphinfer.runtime.worker.inputs import HostInputs, empty_inputs, pad_inputs
from graphinfer.runtime.worker.lora_manager import LoRAManager
from graphinfer.runtime.worker.pipeline_stage import PipelineEnds
from graphinfer.runtime.worker.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30
# Prompt logprobs: hidden rows per LM-head call, so a step holds at most this many rows of logits (x vocab) at once
PROMPT_LOGPROBS_CHUNK = 256


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
    """Runs one rank's compiled model: sizes and owns its KV cache, turns a scheduled step into flat inputs, runs the
    forward the graph dispatcher picks (a replay or the lowered graph, eagerly), and samples. Built whole by the
    Worker (worker/worker.py), after the model is loaded and lowered and before the graphs are captured."""

    def __init__(self, compiled: CompiledModel, config: EngineConfig, device: torch.device, platform: Platform,
                 backend: KernelBackend, dispatcher: GraphDispatcher, max_model_len: int, engine_bytes: int = 0,
                 drafter=None, kv_cache_dtype: torch.dtype | None = None):
        """engine_bytes: device memory the engine took before the KV cache (weights, fused copies, buffers), which
        gpu_memory_utilization counts. On a GPU the KV cache's budget is what is left after the activation peaks of
        the forward that will run (compiled.executable), profiled on a full step (max_num_batched_tokens tokens, the
        LM head on max_num_seqs rows) and on the largest captured one. drafter: an MTP proposer
        (spec_decode/mtp_proposer.py), whose cache rows share the target's blocks (and budget) and which drafts after
        every step from its hidden states."""
        cache_config, sc = config.cache_config, config.scheduler_config
        self.model = compiled.model
        self.graph = compiled.executable  # the lowered forward (compiled.graph is the fused one artifacts save)
        self.graph_rows = compiled.executable_rows  # the same, its last layers on the sampled rows only (or None)
        self.compute_logits = compiled.compute_logits
        self.dispatcher = dispatcher
        self.device, self.platform, self.max_model_len = device, platform, max_model_len
        self.block_size = cache_config.block_size
        # the cache's dtype (CacheConfig.kv_cache_dtype as the Worker resolved it; None: the model's)
        self.kv_cache_dtype = kv_cache_dtype or activation_dtype(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.drafter, self.last_hidden = drafter, None  # the step's hidden states, every row: what the drafter reads
        self.prompt_logprobs_out = None  # the last step's prompt logprobs (prompt_logprobs), until taken
        # MoE models: the step's real token count, read by every MoE layer's expert-load count (worker/expert_load.py)
        # at a fixed address, so captured graphs see each step's value and their padded rows count nothing.
        self.moe_layers = moe_layers(self.model)
        self.num_tokens = torch.zeros(1, dtype=torch.int64, device=device) if self.moe_layers else None
        for layer in self.moe_layers.values():
            layer.num_tokens = self.num_tokens
        self.profile = dict(step_tokens=sc.max_num_batched_tokens, logits_rows=sc.max_num_seqs,
                            graph_tokens=dispatcher.max_graph_tokens, max_model_len=max_model_len)
        self.num_blocks = self._num_kv_blocks(cache_config, max_model_len, engine_bytes)
        self.num_blocks = ps.min_across_ranks(self.num_blocks)  # tensor parallel: every rank's cache alike
        self.kv_cache = allocate_kv_cache(self.model, self.num_blocks, self.block_size, self.kv_cache_dtype)
        rebind_buffers(self.model, compiled.graph, self.graph, self.graph_rows,
                       compiled.split.module if compiled.split else None)
        self.kv_pages = platform.populate_in_background(self.kv_cache)  # cpu: a thread commits the cache's pages
        if drafter is not None:
            drafter.bind(self)
        self.sampler = Sampler(seed=config.model_config.seed, device=device, kernel=backend.sample_kernel,
                               logprobs_mode=config.model_config.logprobs_mode)
        # EPLB: the window of physical expert load, and the rearrangements every step_interval steps
        pc = config.parallel_config
        self.eplb = EplbState(self.moe_layers, pc.eplb_config, device, platform.synchronize) \
            if pc.enable_eplb and any(m.eplb for m in self.moe_layers.values()) else None
        # pipeline parallel: the stage's ends (worker/pipeline_stage.py); None without
        self.pipeline = PipelineEnds(self.model, device) if ps.pp_size() > 1 else None
        # LoRA: the graph's adapter slots (passes/lora.py), filled per step from the step's plan
        self.lora = LoRAManager(compiled.graph, config.lora_config, activation_dtype(self.model)) \
            if config.lora_config.enable_lora else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        return self.graph(input_ids, positions, md)

    def logits_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The forward up to the logits (what a full graph captures with the LM head inside)."""
        return self.compute_logits(self.graph(input_ids, positions, md))

    def _block_bytes(self) -> int:
        a = self.attn_layers[0]
        dtype_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        target = a.cache_planes * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * dtype_size
        return target + (self.drafter.bytes_per_block if self.drafter is not None else 0)  # its rows of each block

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
        about that much). The Worker's 1-block placeholder KV cache is still bound (slots -1 write nothing)."""
        p = self.profile
        if not p["step_tokens"]:
            return 0, 0
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
        return peaks[0], peaks[1]

    def _dummy_step(self, tokens: int, max_len: int, rows: int) -> None:
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        md, ids, positions = dummy_inputs(lens, self.block_size, self.device)
        logits = self.compute_logits(self.graph(ids, positions, md)[-rows:]).float()
        torch.sort(logits.softmax(-1), dim=-1, descending=True)  # about the sampler's working set (top-p sorts)

    @torch.inference_mode()
    def warm_up(self, speculative: bool = False) -> None:
        """Run the forward (and the LM head) on a few dummy prefills that write no KV, so the kernels a first request
        needs are compiled, or loaded from the kernel cache, now rather than at that request. Lengths 16 and 7: a
        multiple of 16 and not (Triton specialises integer arguments on divisibility by 16). Then the sampling-side
        kernels: rejection sampling (speculative decoding) and structured outputs' mask."""
        for n in (16, 7):
            md, ids, positions = dummy_inputs([n], self.block_size, self.device)
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
        self.dispatcher.release()
        if self.drafter is not None:
            self.drafter.release()
        self.drafter = self.last_hidden = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = self.graph = self.graph_rows = self.model = self.compute_logits = self.sampler = None
        self.num_tokens = self.lora = None
        self.eplb = None
        self.attn_layers, self.moe_layers = [], {}

    def wait_for_kv_cache_pages(self) -> None:
        """Join the thread committing the KV cache's pages (cpu: CpuPlatform.populate_in_background) if it still
        runs."""
        if self.kv_pages is not None:
            self.kv_pages.join()
            self.kv_pages = None

    # ----- a step -----
    def host_inputs(self, out: SchedulerOutput) -> HostInputs:
        """Flat input_ids/positions over all scheduled tokens, the attention metadata, and the rows (last token of
        each sequence that completes its known tokens) whose logits get sampled."""
        bs = self.block_size
        input_ids, positions, query_start_loc, seq_lens, logits_indices = [], [], [0], [], []
        tables, pending_dst, pending_src, spec_lens = [], [], [], []
        next_ids = [] if self.drafter is not None else None
        plp_rows, plp_targets, plp_k = [], [], 0
        for s in out.scheduled:  # plain lists: per-row numpy calls cost more than they save at batch 256
            seq, n, start = s.seq, s.num_tokens, s.start
            if s.prompt_logprobs is not None:  # position p's row predicts prompt token p + 1
                lo, hi = s.prompt_logprobs
                first = len(input_ids) - start
                plp_rows.extend(range(first + lo, first + hi))
                plp_targets.extend(seq.token_ids[lo + 1:hi + 1])
                k = seq.sampling_params.prompt_logprobs
                plp_k = -1 if k == -1 or plp_k == -1 else max(plp_k, k)
            k = len(seq.spec_token_ids)  # drafts: the scheduled tokens' last k, after the sequence's own
            if n == 1:
                if start == len(seq.token_ids):  # sampled by the in-flight step: the device fills it in
                    pending_dst.append(len(input_ids))
                    pending_src.append(s.pending_row)
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
            if next_ids is not None:
                next_ids.append(-1 if s.samples else seq.token_ids[start + n])
            if s.samples:
                end = query_start_loc[-1]
                if k:
                    logits_indices.extend(range(end - 1 - k, end))
                else:
                    logits_indices.append(end - 1)
                spec_lens.append(k)
        lora_slots, lora_loads = self._lora_plan(out) if self.lora is not None else (None, None)
        block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
        positions = np.array(positions, dtype=np.int64)
        query_start_loc = np.array(query_start_loc, dtype=np.int32)
        row = np.repeat(np.arange(len(tables)), np.diff(query_start_loc))
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        return HostInputs(np.array(input_ids, dtype=np.int64), positions, slot_mapping, block_tables, query_start_loc,
                          np.array(seq_lens, dtype=np.int32), np.array(logits_indices, dtype=np.int64), out.rows,
                          pending_dst, pending_src, spec_lens=spec_lens if any(spec_lens) else None,
                          next_token_ids=None if next_ids is None else np.array(next_ids, dtype=np.int64),
                          # a full decode graph returns the last tokens' rows only: prompt rows take the pieces
                          decode_graphs=not plp_rows,
                          prompt_lp_indices=np.array(plp_rows, dtype=np.int64) if plp_rows else None,
                          prompt_lp_targets=np.array(plp_targets, dtype=np.int64) if plp_rows else None,
                          prompt_lp_k=plp_k, lora_slots=lora_slots, lora_loads=lora_loads)

    def _lora_plan(self, out: SchedulerOutput) -> tuple[np.ndarray | None, list | None]:
        """Rank 0: the step's slot per token and the adapter writes it needs first (LoRAManager.plan)."""
        requests = {s.seq.lora_request.lora_int_id: s.seq.lora_request for s in out.scheduled
                    if s.seq.lora_request is not None}
        if not requests:
            return None, None
        slot_of, loads = self.lora.plan(requests)
        slots = [-1 if s.seq.lora_request is None else slot_of[s.seq.lora_request.lora_int_id] for s in out.scheduled]
        return np.repeat(np.array(slots, dtype=np.int64), [s.num_tokens for s in out.scheduled]), loads

    def prepare_inputs(self, out: SchedulerOutput | None, dp_step=None) -> HostInputs:
        """The step's host inputs; dp_step: the shape the data-parallel replicas agreed on (engine/dp_lockstep.py),
        to pad to (out None: a padding-only step)."""
        h = self.host_inputs(out) if out is not None else None
        if dp_step is not None:
            h = pad_inputs(h or empty_inputs(), dp_step)
        return h

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

    @torch.inference_mode()
    def execute(self, h: HostInputs, prev_tokens: torch.Tensor | None = None, mask_logits=None) -> SamplerOutput | None:
        """Run one step and sample; returns the sampler's output, on the device (nothing here waits for the device),
        or None when no row samples. prev_tokens: the in-flight step's sampled ids (async scheduling).
        mask_logits(logits, rows, spec_lens): called once the forward is launched, before sampling, to mask the
        logits in place (structured outputs); they are the forward's output, outside any captured graph."""
        return self.sample(h, self.step_logits(h, prev_tokens), mask_logits)

    @torch.inference_mode()
    def sample(self, h: HostInputs, logits: torch.Tensor | None, mask_logits=None) -> SamplerOutput | None:
        """Sample the step's logits (None: no row samples); then the drafter's proposals (see execute)."""
        out = None
        if logits is not None:
            if mask_logits is not None:
                mask_logits(logits, h.rows, h.spec_lens)
            if h.spec_lens is None:
                out = self.sampler(logits, h.rows)
            else:
                out = verify(self.sampler, logits, h.rows, h.spec_lens, self.to_device)
        if self.drafter is not None and len(h.input_ids):  # also after mid-prompt chunks: their cache rows
            self.drafter.propose(h, self.last_hidden, out)
            self.last_hidden = None
        return out

    @torch.inference_mode()
    def pipeline_logits(self, rows: int) -> torch.Tensor | None:
        """Pipeline parallel, first stage: the logits of a step's `rows` sampling rows, from their final hidden
        states the last stage sends (its first-sent step first); None on the other stages."""
        if self.pipeline is None or not self.pipeline.first or not rows:  # a step of mid-prompt chunks: no rows
            return None
        return self.compute_logits(self.pipeline.recv_rows(rows))

    @torch.inference_mode()
    def step_logits(self, h: HostInputs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logits for the rows that sample (None when every sequence is mid-prompt); every
        tensor-parallel rank runs this, in the same order, with the same inputs, and replays what the dispatcher
        picks from the step's shape."""
        fill_pending = lambda ids: self.fill_pending(ids, h, prev_tokens)  # noqa: E731
        if self.num_tokens is not None:  # the real rows: a padded bucket's others count no expert load
            self.num_tokens.fill_(len(h.input_ids) - h.num_pad)
        if self.lora is not None:
            self.lora.apply(h.lora_slots, h.lora_loads or [])
        if self.eplb is not None:  # between steps: every EP rank reaches this step's rearrangement together
            self.eplb.before_step()
        run = self.dispatcher.dispatch(h)
        t, rows_only = self.to_device, False
        if run.kind == FULL:
            hidden = run.graphs.replay(h.input_ids, h.positions, h.slot_mapping, h.block_tables, h.seq_lens,
                                       fill_pending=fill_pending)
        elif run.kind == PIECEWISE:
            hidden = run.graphs.run(h.input_ids, h.positions, h.slot_mapping, t(h.block_tables),
                                    t(h.query_start_loc), t(h.seq_lens), fill_pending=fill_pending)
        else:
            input_ids = t(h.input_ids)
            fill_pending(input_ids)
            md = AttentionMetadata(t(h.slot_mapping), t(h.block_tables), t(h.query_start_loc), t(h.seq_lens))
            if rows_only := self._rows_only(h):  # the last layers on the sampled rows alone: hidden is [rows, H]
                hidden = self.graph_rows(input_ids, t(h.positions), md, t(h.logits_indices))
            else:
                hidden = self.graph(input_ids, t(h.positions), md)
        if self.eplb is not None:
            self.eplb.after_step()
        if self.drafter is not None:
            self.last_hidden = hidden
        if self.pipeline is not None:  # this stage's hidden state went on; the last stage's rows go back to the first
            if self.pipeline.last and len(h.logits_indices):
                self.pipeline.send_rows(hidden[self.to_device(h.logits_indices)] if len(h.logits_indices) < len(
                    h.input_ids) else hidden)
            return None
        if h.prompt_lp_indices is not None:
            assert run.kind != FULL, "a step with prompt-logprob rows never replays a full decode graph"
            self.prompt_logprobs_out = self.prompt_logprobs(hidden, h)
        rows = len(h.logits_indices)
        if not rows:  # every sequence is mid-prompt (chunked prefill): nothing to sample yet
            return None
        if rows < len(h.input_ids) and not rows_only:  # some rows are not the last of their sequence's scheduled tokens
            hidden = hidden[self.to_device(h.logits_indices)]
        return hidden if run.kind == FULL and self.dispatcher.lm_head_in_graph else self.compute_logits(hidden)

    def _rows_only(self, h: HostInputs) -> bool:
        """Whether the step's forward may skip the other rows after the last attention: some rows are not sampled
        and no one reads them (a drafter reads every row's hidden state, prompt logprobs their logits, a pipeline
        stage sends them on)."""
        return (self.graph_rows is not None and len(h.logits_indices) < len(h.input_ids) and self.drafter is None
                and self.pipeline is None and h.prompt_lp_indices is None)

    def prompt_logprobs(self, hidden: torch.Tensor, h: HostInputs) -> tuple[torch.Tensor, ...] | None:
        """(logprob of the next prompt token [L], its rank [L], top-k ids [L, k], top-k logprobs [L, k]) for the
        step's prompt-logprob rows, on the device: their hidden states through the LM head PROMPT_LOGPROBS_CHUNK rows
        at a time, so the logits held at once are chunk x vocab whatever the prompt's length; raw log_softmax in fp32
        (logprobs_mode raw_logits: the logits), as the sampler reports. Ranks other than 0 (no targets) only run the
        LM head, whose all-gather pairs with rank 0's; they return None."""
        idx = self.to_device(h.prompt_lp_indices)
        targets = self.to_device(h.prompt_lp_targets) if h.prompt_lp_targets is not None else None
        n, out = len(idx), None
        for lo in range(0, n, PROMPT_LOGPROBS_CHUNK):
            hi = min(lo + PROMPT_LOGPROBS_CHUNK, n)
            logits = self.compute_logits(hidden[idx[lo:hi]])
            if targets is None:
                continue
            if out is None:
                vocab = logits.shape[-1]
                k = vocab if h.prompt_lp_k == -1 else min(h.prompt_lp_k, vocab)
                dev = logits.device
                out = (torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.int64, device=dev),
                       torch.empty(n, k, dtype=torch.int64, device=dev), torch.empty(n, k, dtype=torch.float32, device=dev))
            if self.sampler.logprobs_mode == "raw_logprobs":
                lp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            else:
                lp = logits.float()
            del logits
            target_lp = lp.gather(1, targets[lo:hi, None])
            out[0][lo:hi] = target_lp[:, 0]
            out[1][lo:hi] = torch.count_nonzero(lp > target_lp, dim=-1) + 1
            if k:
                top_lp, top_ids = torch.topk(lp, k, dim=-1)
                out[2][lo:hi], out[3][lo:hi] = top_ids, top_lp
            del lp
        return out

    def take_prompt_logprobs(self) -> tuple[torch.Tensor, ...] | None:
        """The last step's prompt logprobs (prompt_logprobs), once."""
        out, self.prompt_logprobs_out = self.prompt_logprobs_out, None
        return out


def dummy_inputs(lens: list[int], block_size: int, device: torch.device):
    """(metadata, input ids, positions) of a prefill of requests of `lens` tokens that writes no KV (slots -1) and
    reads block 0: what warm-up and profiling run."""
    i32, i64 = torch.int32, torch.int64
    tokens = sum(lens)
    md = AttentionMetadata(torch.full((tokens,), -1, dtype=i64, device=device),
                           torch.zeros(len(lens), -(-max(lens) // block_size), dtype=i32, device=device),
                           torch.tensor(np.cumsum([0, *lens]), dtype=i32, device=device),
                           torch.tensor(lens, dtype=i32, device=device))
    positions = torch.cat([torch.arange(n, dtype=i64, device=device) for n in lens])
    return md, torch.zeros(tokens, dtype=i64, device=device), positions
