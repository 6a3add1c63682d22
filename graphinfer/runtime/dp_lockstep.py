"""Data-parallel lockstep, for MoE models with expert parallel over several replicas (vLLM's DP + EP).

Every replica's MoE layers exchange tokens with every other's (ep_dispatch / ep_combine over the whole world), so
every replica must run every step, with the same token count and the same graph path, or an all-to-all waits
forever. Before each step the replicas' leaders agree, in one all-reduce(max) on the "dp" gloo group, on the
largest token and row counts, whether every batch is a uniform decode, and whether to stop; each then pads its
step to that shape. A replica with nothing to do runs a padding-only step (vLLM's dummy batch). Padding rows write
no KV (slot -1), sample nothing and count no expert load. Dense replicas never need this: they share no collective.
"""
from dataclasses import dataclass, replace

import numpy as np

from graphinfer.distributed import parallel_state as ps
from graphinfer.runtime.model_runner import HostInputs
from graphinfer.runtime.scheduler import SchedulerOutput


@dataclass(frozen=True)
class DPStep:
    num_tokens: int  # the largest step over the replicas
    num_rows: int  # its rows (requests)
    uniform_decode: bool  # every replica's batch is one token per request: the decode graphs may replay
    stop: bool = False


def agree(sched: SchedulerOutput | None, stop: bool = False) -> DPStep:
    """This replica's step shape against every other's (leaders only; every leader calls it once per step)."""
    counts = [n for _, n in sched.scheduled] if sched is not None else []
    nonuniform = int(any(n != 1 for n in counts))
    T, B, nonuniform, stop = ps.dp_all_reduce_max([sum(counts), len(counts), nonuniform, int(stop)])
    return DPStep(T, B, not nonuniform, bool(stop))


class Lockstep:
    """One replica's side of the rounds; enabled for MoE + expert parallel over several replicas (else every method
    is a no-op)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.stopped = False  # the front end ended the rounds

    def agree(self, sched: SchedulerOutput | None, stop: bool = False) -> DPStep | None:
        """The step shape every replica pads to, or None when no replica has work, the rounds stopped, or lockstep
        is off."""
        if not self.enabled:
            return None
        step = agree(sched, stop)
        self.stopped |= step.stop
        return step if step.num_tokens and not step.stop else None

    def stop_rounds(self) -> None:
        """Front end (replica 0), at shutdown: one last round that tells the other lockstep replicas to stop."""
        if self.enabled and not self.stopped:
            self.agree(None, stop=True)


def empty_inputs() -> HostInputs:
    i64, i32 = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return HostInputs(i64, i64, i64, np.zeros((0, 1), dtype=np.int32), np.zeros(1, dtype=np.int32), i32, i64, [],
                      [], [])


def pad(h: HostInputs, step: DPStep) -> HostInputs:
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
