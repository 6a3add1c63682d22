"""One step's model inputs as host arrays (what the model runner builds from a scheduler output, what rank 0 sends
the other tensor-parallel ranks, and what data-parallel lockstep pads)."""
from dataclasses import dataclass, replace

import numpy as np


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
    rows: list  # the sequences that sample (engine/sequence.py), in the order of the logits rows
    # Async scheduling: input_ids[pending_dst[i]] is row pending_src[i] of the in-flight step's sampled tokens,
    # which are still on the device (input_ids holds 0 there until the device fills it in).
    pending_dst: list[int]
    pending_src: list[int]
    # Data-parallel lockstep (engine/dp_lockstep.py): the last num_pad tokens are padding every replica's step
    # to the same shape, and decode_graphs False keeps a uniform decode batch off the decode graphs because
    # another replica's step cannot replay one (their collectives must pair).
    decode_graphs: bool = True
    num_pad: int = 0
    # Speculative decoding: drafts per row (row i samples spec_lens[i] + 1 logits rows, in order); None: none has any
    spec_lens: list[int] | None = None
    # An MTP drafter (spec_decode/mtp_proposer.py): per request, the token after its last scheduled one when that is
    # a prompt token (mid-prompt chunks), else -1 (the step samples it); None without one
    next_token_ids: np.ndarray | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): the flat rows whose hidden states go through the LM head for
    # the logprob of the next prompt token (every rank runs the LM head on them: it all-gathers under tensor
    # parallel), that token's id for each (rank 0 only; None on the other ranks: they only run the LM head), and
    # the largest top-k asked (-1: the whole vocabulary). None: no such row.
    prompt_lp_indices: np.ndarray | None = None
    prompt_lp_targets: np.ndarray | None = None
    prompt_lp_k: int = 0
    # LoRA (runtime/worker/lora_manager.py): each token's adapter slot (-1: none; None: no token has one), and the
    # (slot, LoRARequest) writes every rank makes before the forward
    lora_slots: np.ndarray | None = None
    lora_loads: list | None = None

    def pending_index(self) -> np.ndarray | None:
        """[2, P] int64 (dst; src), or None when the pending ids are simply the first P sampled ones, in order."""
        n = len(self.pending_dst)
        if self.pending_dst == self.pending_src == list(range(n)):
            return None
        return np.array([self.pending_dst, self.pending_src], dtype=np.int64)



def empty_inputs() -> HostInputs:
    """A step with no tokens (a data-parallel replica with nothing to do pads it)."""
    i64, i32 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return HostInputs(i64, i64, i64, np.zeros((0, 1), dtype=np.int32), np.zeros(1, dtype=np.int32), i32, i64, [],
                      [], [])


@dataclass(frozen=True)
class DPStep:
    """The step shape data-parallel replicas in lockstep agreed on (engine/dp_lockstep.py)."""
    num_tokens: int  # the largest step over the replicas
    num_rows: int  # its rows (requests)
    uniform_decode: bool  # every replica's batch is one token per request: the decode graphs may replay
    stop: bool = False


def pad_inputs(h: HostInputs, step: DPStep) -> HostInputs:
    """h grown to the agreed shape with one-token padding rows (position 0, block 0, slot -1): num_rows rows when
    every batch is a uniform decode (the same decode graph replays on every replica), else num_tokens tokens and
    no decode graph anywhere (the same piecewise bucket, or the same eager shape)."""
    T, B = len(h.input_ids), len(h.seq_lens)
    n = step.num_rows - B if step.uniform_decode else step.num_tokens - T
    if n <= 0:
        return replace(h, decode_graphs=step.uniform_decode)
    tables = np.zeros((B + n, max(h.block_tables.shape[1], 1)), dtype=np.int32)
    tables[:B] = h.block_tables
    return replace(
        h, input_ids=np.concatenate([h.input_ids, np.zeros(n, dtype=np.int64)]),
        positions=np.concatenate([h.positions, np.zeros(n, dtype=np.int64)]),
        slot_mapping=np.concatenate([h.slot_mapping, np.full(n, -1, dtype=np.int64)]),
        block_tables=tables,
        query_start_loc=np.concatenate([h.query_start_loc, h.query_start_loc[-1] + np.arange(1, n + 1, dtype=np.int32)]),
        seq_lens=np.concatenate([h.seq_lens, np.ones(n, dtype=np.int32)]),
        decode_graphs=step.uniform_decode, num_pad=n)
