"""Rank 0 -> the other ranks of its replica: each message (executor/step_encoding.py) in one broadcast over the gloo
group, of a fixed-capacity int64 tensor. A message that does not fit is preceded by one that grows every rank's
buffer (rare: the capacity only grows).

Pipeline parallel: point to point instead (its length, then the message, to each rank), without waiting for the
receives, so rank 0 goes on with the next batch while later stages still work on earlier ones (a broadcast, like
gloo's send, waits for every receiver)."""
import torch
import torch.distributed as dist

from graphinfer.distributed import parallel_state as ps
from graphinfer.runtime.executor import step_encoding
from graphinfer.runtime.executor.step_encoding import CallMessage, Shutdown, StepMessage
from graphinfer.runtime.worker.inputs import HostInputs

GROW = 3  # the transport's own message: the next buffer's capacity
_INITIAL_CAPACITY = 1 << 13


class StepChannel:
    def __init__(self):
        self.group = ps.cpu_group()
        self.buf = torch.zeros(_INITIAL_CAPACITY, dtype=torch.int64)
        self.steps = 0
        self.broken: str | None = None  # rank 0 failed inside a step: the ranks are out of step for good
        self.p2p = ps.pp_size() > 1
        self.peers = [r for r in range(ps.leader_rank(), ps.leader_rank() + ps.replica_size()) if r != ps.leader_rank()]
        self.first_stage = self.peers[:ps.tp_size() - 1]  # rank 0's TP peers in the first stage
        self.in_flight: list = []  # p2p: (work, tensor) of sends not yet received

    def _check(self) -> None:
        if self.broken is not None:
            raise ps.DistributedError(f"The tensor-parallel ranks are out of step: {self.broken}. Shut this engine "
                                      f"down and start a new one.")

    def _broadcast(self) -> None:
        ps.collective("step message broadcast", ps.TP_GROUP,
                      lambda _: dist.broadcast(self.buf, src=ps.leader_rank(), group=self.group))

    def _send(self, msg, peers: list[int] | None = None) -> None:
        self._check()
        if self.p2p:
            return self._send_p2p(step_encoding.encode(msg), self.peers if peers is None else peers)
        data = step_encoding.encode(msg)
        if len(data) > len(self.buf):
            capacity = 1 << (len(data) - 1).bit_length()
            self.buf[:2] = torch.tensor([GROW, capacity])
            self._broadcast()
            self.buf = torch.zeros(capacity, dtype=torch.int64)
        self.buf[:len(data)] = torch.from_numpy(data)
        self._broadcast()

    def _send_p2p(self, data, peers: list[int]) -> None:
        """The message's length, then the message, to each peer; not waiting (the tensors kept until delivered)."""
        while self.in_flight and self.in_flight[0][0].is_completed():
            self.in_flight.pop(0)
        parts = (torch.tensor([len(data)], dtype=torch.int64), torch.from_numpy(data))

        def run(_):
            self.in_flight.extend((dist.isend(t, peer, group=self.group), t) for peer in peers for t in parts)

        ps.collective("step message send", ps.TP_GROUP, run)

    def _recv_p2p(self):
        length = torch.zeros(1, dtype=torch.int64)
        ps.collective("step message receive", ps.TP_GROUP,
                      lambda _: dist.recv(length, ps.leader_rank(), group=self.group))
        buf = torch.zeros(int(length), dtype=torch.int64)
        ps.collective("step message receive", ps.TP_GROUP, lambda _: dist.recv(buf, ps.leader_rank(), group=self.group))
        return step_encoding.decode(buf.numpy())

    def send_step(self, h: HostInputs, share_sampled: bool) -> None:
        self.steps += 1
        self._send(StepMessage(self.steps, h, share_sampled))

    def call(self, method: str, *args, first_stage_only: bool = False) -> None:
        """Have every other rank (first_stage_only: rank 0's TP peers in the first pipeline stage) run
        worker.<method>(*args)."""
        self._send(CallMessage(method, args), self.first_stage if first_stage_only else None)

    def shutdown(self) -> None:
        self._send(Shutdown())

    def recv(self):
        """On ranks > 0: the next StepMessage, CallMessage or Shutdown."""
        if self.p2p:
            return self._recv_p2p()
        while True:
            self._broadcast()
            if int(self.buf[0]) == GROW:
                self.buf = torch.zeros(int(self.buf[1]), dtype=torch.int64)
                continue
            return step_encoding.decode(self.buf.numpy())
