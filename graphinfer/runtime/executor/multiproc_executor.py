"""Tensor and pipeline parallel, seen from a replica's rank 0 (vLLM's MultiprocExecutor, cut to what graphinfer needs).

TP rank 0 runs the scheduler and the sampler; every rank runs the same compiled graph on its shard. The executor
starts the replica's other ranks on this node (executor/worker_proc.py), joins the world with them, builds
rank 0's Worker (every rank builds its own in the same order, so the collectives in their start-ups pair up), sends
each step's inputs over the StepChannel before rank 0 runs it, watches the ranks (a dead one is reported within
seconds to the engine and whoever listens: the server answers 503 and exits), and stops them at shutdown.

Pipeline parallel: rank 0 is the first stage's TP rank 0. A step is sent to every rank, rank 0 runs the first
stage's forward (its hidden state goes on to the next stage inside the graph) and returns at once a PipelineOutput;
the engine schedules and launches further batches meanwhile (one per stage, engine/core.py), and lands the step
when it needs its tokens: the last stage's final hidden rows come back, the first stage's LM head and rank 0's
sampler make the tokens.
"""
import atexit
import contextlib
import logging
import os
import pickle
import threading

import torch

from graphinfer.config import EngineConfig, ParallelConfig
from graphinfer.distributed import launch
from graphinfer.distributed import parallel_state as ps
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.engine.scheduler import SchedulerOutput
from graphinfer.runtime.executor.abstract import Executor
from graphinfer.runtime.executor.step_channel import StepChannel
from graphinfer.runtime.startup_timer import StartupTimer
from graphinfer.runtime.worker.inputs import DPStep, HostInputs
from graphinfer.runtime.worker.worker import ModelOutput, Worker

logger = logging.getLogger(__name__)

WORKER_MODULE = "graphinfer.runtime.executor.worker_proc"


# A collective can fail (gloo sees the peer's sockets close) a moment before the monitor sees the rank's exit: wait
# this long for it, so the error names the dead rank instead of "another rank died or stalled".
DEATH_GRACE_S = 3.0

CONFIG_KEY = "graphinfer/engine_config"  # rank 0's EngineConfig, pickled, for the other nodes (worker.run_node)


def join_group(rank: int, pc: ParallelConfig, master_port: int, platform: Platform,
               publish: dict[str, bytes] | None = None) -> None:
    """Make this process global rank `rank` (of tp x pp x dp): its device (cuda:<local rank>), the process groups, and
    on cpu its share of the node's cores (ranks of one node split them)."""
    if platform.device_module is not None:
        platform.device_module.set_device(rank - pc.node_first_rank)
    ps.init_distributed(rank, pc.world_size, pc.ranks_per_node, platform.dist_backend, pc.master_addr,
                        master_port, pc.distributed_timeout, publish, expert_parallel=pc.enable_expert_parallel,
                        tp=pc.tensor_parallel_size, mc2_group=platform.mc2_group, pp=pc.pipeline_parallel_size,
                        pp_layer_partition=pc.pp_layer_partition, node_first_rank=pc.node_first_rank)
    if platform.device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        from graphinfer.platforms.cpu import physical_cores

        torch.set_num_threads(max(1, physical_cores() // pc.ranks_per_node))


class PipelineOutput:
    """A launched pipeline-parallel step (ModelOutput's interface): wait() lands it, once."""
    prompt_logprobs = None

    def __init__(self, executor: "MultiprocExecutor", h: HostInputs, step: int, mask_logits):
        self.executor, self.h, self.step, self.mask_logits = executor, h, step, mask_logits
        self.output: ModelOutput | None = None

    def wait(self):
        if self.output is None:
            self.output = self.executor.land(self.h, self.step, self.mask_logits)
        return self.output.wait()

    def wait_prompt_logprobs(self):
        return None


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, platform: Platform, backend: KernelBackend, timer: StartupTimer):
        pc = config.parallel_config
        self.port = pc.master_port or launch.free_port()
        self.backend = platform.dist_backend
        self.dead: str | None = None  # why the group broke, once a rank died
        self._died = threading.Event()
        self.death_listeners: list = []  # callbacks(message), e.g. the server's
        self.channel: StepChannel | None = None
        self._stopped = False
        spec = {"config": config, "platform_cls": type(platform), "master_port": self.port}
        leader, here = pc.leader_rank, min(pc.replica_size, pc.ranks_per_node)  # this replica's ranks here
        self.ranks = launch.start_ranks(WORKER_MODULE, list(range(leader + 1, leader + here)), spec)
        logger.info("tensor x pipeline parallel: %d x %d ranks on %d node(s); started ranks %s here",
                    pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.nnodes, [r.rank for r in self.ranks])
        try:
            join_group(leader, pc, self.port, platform, {CONFIG_KEY: pickle.dumps(config)} if leader == 0 else None)
            self.channel = StepChannel() if ps.replica_size() > 1 else None
            tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
            label = (lambda r: f"rank {r} (pipeline stage {r // tp % pp})") if pp > 1 else None
            self.monitor = launch.RankMonitor(self.ranks, list(range(leader + here, leader + pc.replica_size)),
                                              pc.master_addr, self.port, self._on_death, label=label)
            atexit.register(self.shutdown)  # an engine never shut down still stops its ranks at exit
            self.driver_worker = Worker(config, platform, backend, timer)
        except BaseException as e:  # stop the other ranks; say why the group broke, if a rank died
            self.shutdown()
            self._raise_with_cause(e, "while the engine started")
            raise

    def execute_model(self, sched: SchedulerOutput | None, prev_tokens: torch.Tensor | None = None,
                      share_sampled: bool = False, dp_step: DPStep | None = None, mask_logits=None) -> ModelOutput:
        h = self.driver_worker.model_runner.prepare_inputs(sched, dp_step)
        if self.channel is None:
            return self.driver_worker.execute(h, prev_tokens, mask_logits)
        share = share_sampled and len(h.logits_indices) > 0
        with self._step_failures(self.channel.steps + 1):
            self.channel.send_step(h, share)  # the other ranks run the same step on the same inputs
            ps.set_phase(f"step {self.channel.steps}")
            if ps.pp_size() > 1:  # the first stage's forward; the tokens come when the engine lands the step
                self.driver_worker.stage_step(h)
                return PipelineOutput(self, h, self.channel.steps, mask_logits)
            out = self.driver_worker.execute(h, prev_tokens, mask_logits)
            if share:
                ps.broadcast_from_rank0(out.sampled.sampled_token_ids)
        return out

    def land(self, h: HostInputs, step: int, mask_logits) -> ModelOutput:
        """Pipeline parallel: step `step`'s tokens (PipelineOutput.wait), once the last stage's rows are back."""
        with self._step_failures(step):
            ps.set_phase(f"step {step} (waiting for the last pipeline stage)")
            if ps.tp_size() > 1 and len(h.logits_indices):  # the first stage's TP ranks run the LM head with rank 0
                self.channel.call("pipeline_logits", len(h.logits_indices), first_stage_only=True)
            return self.driver_worker.land(h, mask_logits)

    @contextlib.contextmanager
    def _step_failures(self, step: int):
        """A failure inside step `step` leaves the other ranks out of step: no further step, and the error names the
        rank that died, if one did (sending the step fails too when a rank died (gloo): the same grace)."""
        try:
            yield
        except BaseException as e:  # the other ranks may wait in a collective of this step: no further step
            if self.channel.broken is None:
                self.channel.broken = f"step {step} failed on rank 0 ({type(e).__name__}: {e})"
            self._raise_with_cause(e, f"during step {step}")
            raise

    def pipeline_busy(self) -> list[float]:
        """Each pipeline stage's busy seconds so far (its busiest rank's): the time it computed, waits excluded."""
        busy = self.collective_rpc("pipeline_busy")
        tp = ps.tp_size()
        return [max(busy[s * tp:(s + 1) * tp]) for s in range(ps.pp_size())]

    def _raise_with_cause(self, e: BaseException, when: str) -> None:
        """A failed collective because a rank died: raise it again, naming the rank (see DEATH_GRACE_S)."""
        if isinstance(e, ps.DistributedError) and self._died.wait(DEATH_GRACE_S):
            raise ps.DistributedError(f"{self.dead} {when}: {e}") from None

    def collective_rpc(self, method: str, *args):
        if self.channel is not None:
            self.channel.call(method, *args)
        return getattr(self.driver_worker, method)(*args)

    def on_death(self, callback) -> None:
        self.death_listeners.append(callback)

    def _on_death(self, message: str) -> None:
        self.dead = message
        self._died.set()
        logger.error("%s: the engine cannot run without it, stopping", message)
        if self.backend != "gloo":  # gloo fails at once when a peer's sockets close; NCCL / HCCL wait: abort them
            ps.abort()
        for listener in self.death_listeners:
            listener(message)

    def shutdown(self, free_weights: bool = True) -> None:
        """Tell the other ranks to stop (unless one died: then the rest end as their channel breaks), wait for
        them, release rank 0's worker, and leave the group. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        if (monitor := getattr(self, "monitor", None)) is not None:
            monitor.stop()
        clean = self.dead is None and (self.channel is None or self.channel.broken is None)  # else: terminate them
        if clean and self.channel is not None:
            try:
                self.channel.shutdown()
            except ps.DistributedError as e:
                logger.warning("tensor parallel shutdown: %s", e)
        launch.stop_ranks(self.ranks, timeout=10 if clean else 0)
        if (worker := getattr(self, "driver_worker", None)) is not None:
            worker.release(tensors=free_weights)
        ps.destroy()
