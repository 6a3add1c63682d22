"""Turns a scheduled step into flat model inputs, runs the model, and samples.

Owns the paged KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
whose per-layer views are handed to the model's attention modules.
"""
import logging

import numpy as np
import torch

from graphinfer.config import CacheConfig
from graphinfer.models.layers import AttentionMetadata, PagedAttention
from graphinfer.runtime.sampler import Sampler, SamplerOutput
from graphinfer.runtime.scheduler import SchedulerOutput
from graphinfer.runtime.sequence import Sequence

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 1 << 30


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
    def __init__(self, model, cache_config: CacheConfig, device: torch.device, eos_token_ids: set[int], seed: int):
        self.model = model
        self.graph = model  # what runs the forward: the compiled fx graph once the engine has one
        self.device = device
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
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int((free - (1 - cfg.gpu_memory_utilization) * total) * 0.9)
        return max(1, budget // self._block_bytes())

    def prepare_inputs(self, out: SchedulerOutput):
        """Flat input_ids/positions over all scheduled tokens, the attention metadata, and the rows
        (last token of each sequence that completes its prompt or decodes) whose logits get sampled."""
        bs = self.block_size
        input_ids, positions, query_start_loc, seq_lens, logits_indices, rows = [], [], [0], [], [], []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.append(np.arange(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            if start + n == seq.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                rows.append(seq)
        max_blocks = max(len(seq.block_table) for seq, _ in out.scheduled)
        block_tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        for i, (seq, _) in enumerate(out.scheduled):
            block_tables[i, :len(seq.block_table)] = seq.block_table
        positions = np.concatenate(positions)
        row = np.repeat(np.arange(len(out.scheduled)), np.diff(query_start_loc))
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs

        def t(x, dtype):
            return torch.as_tensor(np.asarray(x), dtype=dtype).to(self.device, non_blocking=True)

        md = AttentionMetadata(slot_mapping=t(slot_mapping, torch.int64), block_tables=t(block_tables, torch.int32),
                               query_start_loc=t(query_start_loc, torch.int32), seq_lens=t(seq_lens, torch.int32))
        return t(input_ids, torch.int64), t(positions, torch.int64), md, t(logits_indices, torch.int64), rows

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput | None]:
        """Run one step; returns the sequences that sample this step and the sampler's output."""
        input_ids, positions, md, logits_indices, rows = self.prepare_inputs(out)
        hidden = self.graph(input_ids, positions, md)
        if not rows:  # every sequence is mid-prompt (chunked prefill): nothing to sample yet
            return rows, None
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        return rows, self.sampler(logits, rows)
