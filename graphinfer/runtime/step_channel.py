"""Rank 0 -> the other tensor-parallel ranks: each step's inputs in one message.

A message is one broadcast, over the gloo group, of a fixed-capacity int64 tensor: a header, then the step's
host arrays packed end to end (input ids, positions, slots, block tables, query starts, context lengths,
logits rows, pending ids), not a pickle per field. A message that does not fit is preceded by one that
grows every rank's buffer (rare: the capacity only grows). Control calls (save this rank's weights, shut
down) travel as pickles, off the hot path.
"""
import pickle
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from graphinfer.distributed import parallel_state as ps
from graphinfer.runtime.model_runner import HostInputs

_STEP, _CALL, _GROW, _SHUTDOWN = 1, 2, 3, 4
_HEADER = 11  # cmd, payload length, step, T, B, W, R, P, share sampled, no decode graphs, data-parallel padding
_INITIAL_CAPACITY = 1 << 13


@dataclass
class StepMessage:
    step: int
    inputs: HostInputs
    share_sampled: bool  # rank 0 broadcasts the sampled ids after this step (async scheduling's pending ids)


class StepChannel:
    def __init__(self):
        self.group = ps.cpu_group()
        self.buf = torch.zeros(_INITIAL_CAPACITY, dtype=torch.int64)
        self.steps = 0
        self.broken: str | None = None  # rank 0 failed inside a step: the ranks are out of step for good

    def _check(self) -> None:
        if self.broken is not None:
            raise ps.DistributedError(f"The tensor-parallel ranks are out of step: {self.broken}. Shut this engine "
                                      f"down and start a new one.")

    def _broadcast(self) -> None:
        ps.collective("step message broadcast", ps.TP_GROUP,
                      lambda _: dist.broadcast(self.buf, src=ps.leader_rank(), group=self.group))

    def _send(self, cmd: int, header: list[int], payload: np.ndarray) -> None:
        self._check()
        need = _HEADER + len(payload)
        if need > len(self.buf):
            capacity = 1 << (need - 1).bit_length()
            self.buf[:2] = torch.tensor([_GROW, capacity])
            self._broadcast()
            self.buf = torch.zeros(capacity, dtype=torch.int64)
        head = [cmd, len(payload), *header]
        self.buf[:len(head)] = torch.tensor(head)
        self.buf[_HEADER:need] = torch.from_numpy(payload)
        self._broadcast()

    def send_step(self, h: HostInputs, share_sampled: bool) -> None:
        self.steps += 1
        B, W = h.block_tables.shape
        parts = [h.input_ids, h.positions, h.slot_mapping, h.block_tables.ravel(), h.query_start_loc, h.seq_lens,
                 h.logits_indices, np.asarray(h.pending_dst, dtype=np.int64), np.asarray(h.pending_src, dtype=np.int64)]
        payload = np.concatenate([p.astype(np.int64, copy=False) for p in parts])
        self._send(_STEP, [self.steps, len(h.input_ids), B, W, len(h.logits_indices), len(h.pending_dst),
                           int(share_sampled), int(not h.decode_graphs), h.num_pad], payload)

    def call(self, method: str, *args) -> None:
        """Have every other rank run engine.<method>(*args) (control: off the step path)."""
        data = pickle.dumps((method, args))
        padded = bytearray(data + bytes(-len(data) % 8))  # writable: torch.from_numpy warns on a read-only array
        self._send(_CALL, [len(data)], np.frombuffer(padded, dtype=np.int64))

    def shutdown(self) -> None:
        self._send(_SHUTDOWN, [], np.zeros(0, dtype=np.int64))

    def recv(self):
        """On ranks > 0: the next StepMessage, ("call", method, args), or None (shut down)."""
        while True:
            self._broadcast()
            cmd, n = int(self.buf[0]), int(self.buf[1])
            if cmd == _GROW:
                self.buf = torch.zeros(n, dtype=torch.int64)
                continue
            head = self.buf[2:_HEADER].tolist()
            payload = self.buf[_HEADER:_HEADER + n].numpy()
            if cmd == _SHUTDOWN:
                return None
            if cmd == _CALL:
                return ("call", *pickle.loads(payload.view(np.uint8)[:head[0]].tobytes()))
            step, T, B, W, R, P, share, no_graphs, num_pad = head[:9]
            sizes = [T, T, T, B * W, B + 1, B, R, P, P]
            a = np.split(payload, np.cumsum(sizes)[:-1])
            inputs = HostInputs(a[0].copy(), a[1].copy(), a[2].copy(), a[3].reshape(B, W).astype(np.int32),
                                a[4].astype(np.int32), a[5].astype(np.int32), a[6].copy(), [], a[7].tolist(),
                                a[8].tolist(), decode_graphs=not no_graphs, num_pad=num_pad)
            return StepMessage(step, inputs, bool(share))
