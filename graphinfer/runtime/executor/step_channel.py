"""Rank 0 -> the other tensor-parallel ranks: each message (executor/step_encoding.py) in one broadcast over the gloo
group, of a fixed-capacity int64 tensor. A message that does not fit is preceded by one that grows every rank's
buffer (rare: the capacity only grows)."""
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

    def _check(self) -> None:
        if self.broken is not None:
            raise ps.DistributedError(f"The tensor-parallel ranks are out of step: {self.broken}. Shut this engine "
                                      f"down and start a new one.")

    def _broadcast(self) -> None:
        ps.collective("step message broadcast", ps.TP_GROUP,
                      lambda _: dist.broadcast(self.buf, src=ps.leader_rank(), group=self.group))

    def _send(self, msg) -> None:
        self._check()
        data = step_encoding.encode(msg)
        if len(data) > len(self.buf):
            capacity = 1 << (len(data) - 1).bit_length()
            self.buf[:2] = torch.tensor([GROW, capacity])
            self._broadcast()
            self.buf = torch.zeros(capacity, dtype=torch.int64)
        self.buf[:len(data)] = torch.from_numpy(data)
        self._broadcast()

    def send_step(self, h: HostInputs, share_sampled: bool) -> None:
        self.steps += 1
        self._send(StepMessage(self.steps, h, share_sampled))

    def call(self, method: str, *args) -> None:
        """Have every other rank run worker.<method>(*args) (control: off the step path)."""
        self._send(CallMessage(method, args))

    def shutdown(self) -> None:
        self._send(Shutdown())

    def recv(self):
        """On ranks > 0: the next StepMessage, CallMessage or Shutdown."""
        while True:
            self._broadcast()
            if int(self.buf[0]) == GROW:
                self.buf = torch.zeros(int(self.buf[1]), dtype=torch.int64)
                continue
            return step_encoding.decode(self.buf.numpy())
