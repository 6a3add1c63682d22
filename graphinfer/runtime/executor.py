"""Tensor parallel, seen from a replica's TP rank 0 (vLLM's MultiprocExecutor, cut to what graphinfer needs).

TP rank 0 runs the scheduler and the sampler; every rank runs the same compiled graph on its shard. The executor
starts the replica's other ranks on this node (graphinfer.runtime.worker), joins the world with them, hands the model runner
the StepChannel that sends each step's inputs, watches the ranks (a dead one is reported within seconds to
the engine and whoever listens: the server answers 503 and exits), and stops them at shutdown.
"""
import atexit
import logging
import os
import pickle

import torch

from graphinfer.config import EngineConfig, ParallelConfig
from graphinfer.distributed import launch
from graphinfer.distributed import parallel_state as ps
from graphinfer.platforms import Platform
from graphinfer.runtime.step_channel import StepChannel

logger = logging.getLogger(__name__)

WORKER_MODULE = "graphinfer.runtime.worker"


CONFIG_KEY = "graphinfer/engine_config"  # rank 0's EngineConfig, pickled, for the other nodes (worker.run_node)


def join_group(rank: int, pc: ParallelConfig, master_port: int, platform: Platform,
               publish: dict[str, bytes] | None = None) -> None:
    """Make this process global rank `rank` (of tp x dp): its device (cuda:<local rank>), the process groups, and
    on cpu its share of the node's cores (ranks of one node split them)."""
    local = rank % pc.ranks_per_node
    if platform.device_module is not None:
        platform.device_module.set_device(local)
    ps.init_distributed(rank, pc.world_size, pc.ranks_per_node, platform.dist_backend, pc.master_addr,
                        master_port, pc.timeout_s, publish, expert_parallel=pc.enable_expert_parallel,
                        tp=pc.tensor_parallel_size, mc2_group=platform.mc2_group)
    if platform.device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        from graphinfer.platforms.cpu import physical_cores

        torch.set_num_threads(max(1, physical_cores() // pc.ranks_per_node))


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, platform: Platform):
        pc = config.parallel_config
        self.port = pc.master_port or launch.free_port()
        self.backend = platform.dist_backend
        self.dead: str | None = None  # why the group broke, once a rank died
        self.death_listeners: list = []  # callbacks(message), e.g. the server's
        spec = {"config": config, "platform_cls": type(platform), "master_port": self.port}
        leader, here = pc.leader_rank, min(pc.tensor_parallel_size, pc.ranks_per_node)  # this replica's ranks here
        self.ranks = launch.start_ranks(WORKER_MODULE, list(range(leader + 1, leader + here)), spec)
        logger.info("tensor parallel: %d ranks on %d node(s); started ranks %s here", pc.tensor_parallel_size,
                    pc.nnodes, [r.rank for r in self.ranks])
        try:
            join_group(leader, pc, self.port, platform, {CONFIG_KEY: pickle.dumps(config)} if leader == 0 else None)
        except BaseException:
            launch.stop_ranks(self.ranks, timeout=0)
            raise
        self.channel = StepChannel()
        self.monitor = launch.RankMonitor(self.ranks, list(range(leader + here, leader + pc.tensor_parallel_size)),
                                          pc.master_addr, self.port, self._on_death)
        self._stopped = False
        atexit.register(self.shutdown)  # an engine never shut down still stops its ranks at exit

    def _on_death(self, message: str) -> None:
        self.dead = message
        logger.error("%s: the engine cannot run without it, stopping", message)
        if self.backend != "gloo":  # gloo fails at once when a peer's sockets close; NCCL / HCCL wait: abort them
            ps.abort()
        for listener in self.death_listeners:
            listener(message)

    def shutdown(self) -> None:
        """Tell the other ranks to stop (unless one died: then the rest end as their channel breaks), wait for
        them, and leave the group. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        self.monitor.stop()
        clean = self.dead is None and self.channel.broken is None  # else they may be stuck: terminate them
        if clean:
            try:
                self.channel.shutdown()
            except ps.DistributedError as e:
                logger.warning("tensor parallel shutdown: %s", e)
        launch.stop_ranks(self.ranks, timeout=10 if clean else 0)
        ps.destroy()
