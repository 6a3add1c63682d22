"""Pipeline parallel, the runner side: where a stage's work starts and ends, and how busy it is.

The hidden state goes from stage to stage inside the stage graphs (graphinfer::send / recv). What the runner adds:
the last stage sends each step's final hidden rows of the sampling positions back to the first stage, whose LM head
and sampler (on the rank that schedules) turn them into tokens; and every stage counts the seconds it computes
(a step's time less its waits for the previous stage), what `bench throughput` reports as each stage's busy share.
"""
import time

import torch

from graphinfer.distributed import parallel_state as ps
from graphinfer.models.layers import activation_dtype


class PipelineEnds:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.stage, self.stages = ps.pp_rank(), ps.pp_size()
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.hidden_size, self.dtype, self.device = model.config.hidden_size, activation_dtype(model), device
        self.busy_s = 0.0

    def send_rows(self, rows: torch.Tensor) -> None:
        """Last stage: a step's final hidden rows [R, hidden] to the first stage (not waiting for it)."""
        ps.isend(rows, 0, "the final hidden rows")

    def recv_rows(self, rows: int) -> torch.Tensor:
        """First stage: the next step's final hidden rows from the last stage."""
        return ps.recv((rows, self.hidden_size), self.dtype, self.device, self.stages - 1, "the final hidden rows")

    def timed(self, fn, *args):
        """fn(*args), its seconds less those spent waiting for another stage counted as busy."""
        start, waited = time.perf_counter(), ps.pipeline_wait_seconds()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - start - (ps.pipeline_wait_seconds() - waited)
