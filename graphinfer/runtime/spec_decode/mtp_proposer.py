"""MTP proposer (vLLM's EagleProposer running DeepSeek's MTP): the target checkpoint's own multi-token-prediction
layer (models/deepseek_mtp.py) proposes k tokens per request from the target's hidden states, greedily.

It lives in the model runner, as vLLM's drafter does: the layer's paged latent cache is indexed by the target's block
tables, so the target's KV budget counts it, a prefix-cache hit serves its rows with the target's, and freeing a
sequence frees both. After every target step, with the step's hidden states [T, H] (the target's forward output,
after its final norm) and its sampled tokens:

  1. catch-up: for every scheduled request, the layer runs over the positions the target computed and kept (a prefill
     chunk's, a decode's token, a verification's token and accepted drafts), each with its next token (the prompt's,
     or the tokens the step emitted), writing its cache rows there. Every kept position gets its row in the step that
     computed it, so later steps never need old hidden states;
  2. for each request that sampled: draft 1 = argmax of the logits at its last kept position; drafts 2..k reuse the
     layer one token at a time on the previous draft and the previous output h' (pre-norm, as vLLM chains it),
     writing rows past the kept positions (the sequence's own lookahead slots, else scratch blocks past the shared
     ones), which the next catch-up overwrites with the real rows.

The drafts wait here until the engine core's next propose_for hands them to the sequences (budgeted as the other
proposers' are). Reading the emitted tokens on the host costs no extra wait: speculative decoding steps synchronously.
A cache row of position p depends on token p + 1, which the block hash of p's block does not cover, so prefix-cache
hits leave their last block to recompute (use_eagle, vLLM's rule for drafters that read hidden states).

The layer runs eagerly (its graphinfer:: ops on the platform's kernels), in the expanded MLA form: it is not traced,
passed or captured.
"""
import logging
import os

import numpy as np
import torch
from torch import Tensor

from graphinfer.config import EngineConfig
from graphinfer.errors import InvalidConfigError
from graphinfer.models.deepseek_mtp import DeepSeekMTP, check_mtp_config, load_deepseek_mtp
from graphinfer.models.layers import AttentionMetadata, PagedAttention, allocate_kv_cache
from graphinfer.runtime.spec_decode.ngram_proposer import draft_budget

logger = logging.getLogger(__name__)


def check_mtp_engine(config: EngineConfig, target_config) -> None:
    """Refuse, before anything loads, an engine that method "mtp" cannot run on (target_config: the model's HF
    config)."""
    spec, mc, pc = config.speculative_config, config.model_config, config.parallel_config
    if config.artifact:
        raise InvalidConfigError("speculative_config method 'mtp' reads the MTP layer from the checkpoint, which an "
                                 "artifact does not carry yet: run the checkpoint directory instead of the artifact.")
    if pc.world_size > 1:
        raise InvalidConfigError("speculative_config method 'mtp' runs at tensor_parallel_size=1 and "
                                 "data_parallel_size=1 for now; use method 'ngram' with parallel layouts.")
    if spec.model is not None and os.path.abspath(spec.model) != os.path.abspath(mc.model):
        raise InvalidConfigError(f"speculative_config method 'mtp' drafts with the target's own MTP layers; its "
                                 f"\"model\" {spec.model!r} is not the target {mc.model!r}. Leave \"model\" unset.")
    check_mtp_config(target_config, repr(mc.model))
    if getattr(target_config, "quantization_config", None) is not None:
        raise InvalidConfigError("speculative_config method 'mtp' with a quantized checkpoint (quantization_config) "
                                 "is not supported yet; use method 'ngram'.")


class MTPProposer:
    use_eagle = True  # its drafts read the target's hidden states (see the module docstring)

    def __init__(self, model: DeepSeekMTP, config: EngineConfig):
        self.model = model
        self.k = config.speculative_config.num_speculative_tokens
        self.block_size = bs = config.cache_config.block_size
        # the chain's rows past a sequence's blocks: at most ceil((k - 1) / block_size) blocks per sampling row
        self.scratch_per_row = -(-(self.k - 1) // bs)
        self.num_scratch_blocks = config.scheduler_config.max_num_seqs * self.scratch_per_row
        self.dtype = model.layer.enorm.weight.dtype
        a = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.bytes_per_block = len(a) * a[0].cache_planes * bs * a[0].num_kv_heads * a[0].head_dim * \
            torch.empty((), dtype=self.dtype).element_size()
        self.kv_cache = None
        self.drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (its token count, the drafts that follow)

    @classmethod
    def load(cls, config: EngineConfig, target, hf_config, device) -> "MTPProposer":
        """The proposer with the checkpoint's MTP layer, beside the loaded target model."""
        mc = config.model_config
        return cls(load_deepseek_mtp(mc.model, hf_config, target, mc.torch_dtype, device), config)

    def bind(self, runner) -> None:
        """Allocate the layer's cache over the runner's blocks (plus the scratch ones) and take the runner's host
        copies and, where the head is the target's, its lowered LM head."""
        self.num_blocks, self.max_model_len = runner.num_blocks, runner.max_model_len
        self.to_device = runner.to_device
        self.kv_cache = allocate_kv_cache(self.model, runner.num_blocks + self.num_scratch_blocks, self.block_size,
                                          self.dtype)
        head = self.model.layer.shared_head
        lm_head = runner.compute_logits if head.head is runner.model.lm_head else head.head
        self.compute_logits = lambda h: lm_head(head.norm(h))

    def release(self) -> None:
        for layer in self.model.modules():
            if isinstance(layer, PagedAttention):
                layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache, self.drafts = None, {}

    # ----- the engine core's side -----
    def propose_for(self, seqs) -> None:
        """Set each sequence's spec_token_ids: the drafts the last step made for it, within draft_budget."""
        drafts, self.drafts = self.drafts, {}
        for seq in seqs:
            entry = drafts.get(seq.request_id)
            ok = entry is not None and entry[0] == len(seq.token_ids)  # made after the tokens it has now
            seq.spec_token_ids = entry[1][:draft_budget(seq, self.k)] if ok else []

    # ----- the model runner's side -----
    @torch.inference_mode()
    def propose(self, h, hidden: Tensor, sampled) -> None:
        """After the target step h (runner HostInputs with next_token_ids) whose forward returned `hidden` and whose
        sampler returned `sampled` (None: no row sampled): catch up the layer's cache, then draft for the rows."""
        self.drafts = {}
        emitted = []  # per sampling row: the tokens the step emits (accepted drafts and one more)
        if sampled is not None:
            tokens = sampled.output_token_ids if sampled.output_token_ids is not None \
                else sampled.sampled_token_ids[:, None]
            emitted = [[t for t in row if t >= 0] for row in tokens.cpu().tolist()]
        qsl, ids, nxt = h.query_start_loc, h.input_ids, h.next_token_ids
        # per request: positions kept and their next tokens; per sampling row: (request, seq, last kept position P,
        # tokens emitted)
        keep, shifted, rows = [], [], []
        r = 0
        for i in range(len(h.seq_lens)):
            s, e = int(qsl[i]), int(qsl[i + 1])
            if nxt[i] >= 0:  # mid-prompt: every position kept, the last one's next token is the prompt's
                keep.append(e - s)
                shifted += [ids[s + 1:e], [nxt[i]]]
                continue
            k = h.spec_lens[r] if h.spec_lens else 0
            toks = emitted[r]
            keep.append(e - s - k - 1 + len(toks))  # its known tokens' positions, then the accepted drafts'
            shifted += [ids[s + 1:e - k], toks]
            rows.append((i, h.rows[r], int(h.positions[s]) + keep[-1] - 1, len(toks)))
            r += 1
        starts = qsl[:-1].astype(np.int64)
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, keep)])
        cu = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
        t = self.to_device
        md = AttentionMetadata(t(h.slot_mapping[index]), t(h.block_tables), t(cu),
                               t((h.positions[starts] + keep).astype(np.int32)))
        out = self.model(t(np.concatenate(shifted).astype(np.int64)), t(h.positions[index]), hidden[t(index)], md)
        self._draft(rows, out, cu)

    def _draft(self, rows, out: Tensor, cu: np.ndarray) -> None:
        """Drafts for the sampling rows (i: request index, seq, P: last kept position, n: tokens the step emitted):
        as many as the request can still take (draft_budget after this step's tokens, max_model_len)."""
        want = []
        for i, seq, P, n in rows:
            length = len(seq.token_ids) + n  # after this step's tokens land
            budget = min(self.k, seq.max_tokens - len(seq.output_token_ids) - n - 1, self.max_model_len - length)
            if seq.grammar is None and budget > 0:  # structured requests get no drafts
                want.append((i, seq, P, length, budget))
        if not want:
            return
        want.sort(key=lambda w: -w[-1])  # by budget: the rows still drafting at step j are a prefix
        g = out[self.to_device(cu[[i + 1 for i, *_ in want]] - 1)]
        drafts = [self.compute_logits(g).argmax(dim=-1)]
        for j in range(1, want[0][-1]):
            m = sum(1 for w in want if w[-1] > j)
            md, positions = self._chain_inputs(want[:m], j)
            g = self.model(drafts[-1][:m], self.to_device(positions), g[:m], md)
            step = torch.full((len(want),), -1, dtype=torch.int64, device=g.device)
            step[:m] = self.compute_logits(g).argmax(dim=-1)
            drafts.append(step)
        for w, row in zip(want, torch.stack(drafts, dim=1).cpu().tolist()):
            self.drafts[w[1].request_id] = (w[3], row[:w[-1]])

    def _chain_inputs(self, live, j: int) -> tuple[AttentionMetadata, np.ndarray]:
        """Metadata of chain step j: position P + j for each live row. A row's blocks past its sequence's table are
        scratch blocks, after the shared ones: row n owns scratch_per_row of them."""
        bs = self.block_size
        positions = np.array([P + j for _, _, P, _, _ in live], dtype=np.int64)
        width = int(positions.max()) // bs + 1
        tables = np.zeros((len(live), width), dtype=np.int32)
        for n, (_, seq, _, _, _) in enumerate(live):
            own = seq.block_table[:width]
            tables[n, :len(own)] = own
            first = self.num_blocks + n * self.scratch_per_row
            tables[n, len(own):] = np.arange(first, first + width - len(own))
        slots = tables[np.arange(len(live)), positions // bs].astype(np.int64) * bs + positions % bs
        md = AttentionMetadata(self.to_device(slots), self.to_device(tables),
                               self.to_device(np.arange(len(live) + 1, dtype=np.int32)),
                               self.to_device((positions + 1).astype(np.int32)))
        return md, positions
