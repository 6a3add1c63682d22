"""The Executor interface (vLLM's): run each scheduled step on every rank of one engine replica and return rank 0's
output; and the UniprocExecutor (one rank: the Worker in this process). executor/factory.py picks one per layout."""
import torch

from graphinfer.config import EngineConfig
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.engine.scheduler import SchedulerOutput
from graphinfer.runtime.startup_timer import StartupTimer
from graphinfer.runtime.worker.inputs import DPStep
from graphinfer.runtime.worker.worker import ModelOutput, Worker


class Executor:
    driver_worker: Worker  # rank 0's, in this process
    dead: str | None = None  # why a rank this engine needs is gone, once it is

    def execute_model(self, sched: SchedulerOutput | None, prev_tokens: torch.Tensor | None = None,
                      share_sampled: bool = False, dp_step: DPStep | None = None, mask_logits=None) -> ModelOutput:
        """Run the scheduled step on every rank (sched None: a data-parallel padding-only step, padded to dp_step)
        and sample on rank 0. prev_tokens: the in-flight step's sampled ids (async scheduling), which, with
        share_sampled, the other ranks get too; mask_logits: structured outputs' hook (ModelRunner.execute)."""
        h = self.driver_worker.model_runner.prepare_inputs(sched, dp_step)
        return self.driver_worker.execute(h, prev_tokens, mask_logits)

    def collective_rpc(self, method: str, *args):
        """Every rank runs worker.<method>(*args); returns rank 0's result."""
        return getattr(self.driver_worker, method)(*args)

    def on_death(self, callback) -> None:
        """callback(message) once a rank this engine needs dies."""

    def shutdown(self, free_weights: bool = True) -> None:
        """Stop the other ranks and free rank 0's worker: graphs, KV cache and (free_weights) its weights, also those
        of modules something else still refers to. Idempotent."""
        self.driver_worker.release(tensors=free_weights)


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform, backend: KernelBackend, timer: StartupTimer):
        self.driver_worker = Worker(config, platform, backend, timer)
