"""A tensor- or pipeline-parallel rank other than 0: `python -m graphinfer.runtime.executor.worker_proc`, launch spec on stdin
(see distributed/launch.py), or a node > 0's main process (run_node).

It joins the group, builds its Worker in the same order as rank 0 (weights: its shard; passes and their checks; KV
cache; capture: the collectives in them pair up), then runs each step rank 0 sends: the same forward on its shard,
no scheduling and no sampling; under pipeline parallel its stage's part of each step (and on the first stage's TP
ranks, the LM head of each step rank 0 lands: a CallMessage).
"""
import logging
import pickle
import signal
import sys

import torch

from graphinfer import envs
from graphinfer.config import EngineConfig, ParallelConfig
from graphinfer.distributed import launch
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import GraphinferError
from graphinfer.platforms import platform_for_device
from graphinfer.runtime.executor.multiproc_executor import CONFIG_KEY, WORKER_MODULE, join_group
from graphinfer.runtime.executor.step_channel import StepChannel
from graphinfer.runtime.executor.step_encoding import CallMessage, Shutdown
from graphinfer.runtime.worker.worker import Worker

logger = logging.getLogger(__name__)


def run_rank(config: EngineConfig, rank: int, master_port: int, platform_cls=None) -> int:
    """Be rank `rank` until rank 0 shuts the group down (0) or goes away (1)."""
    pc = config.parallel_config
    platform = platform_cls() if platform_cls is not None else \
        platform_for_device(str(config.model_config.device).split(":")[0])
    worker = None
    try:
        join_group(rank, pc, master_port, platform)
        if pc.nnodes > 1 and rank >= pc.ranks_per_node:  # a TP rank on another node: heartbeats say it lives
            launch.start_heartbeat(pc.master_addr, master_port, rank)
        worker = Worker(config, platform, platform.activate(config.compile_config.kernels))
        serve_steps(worker)
    except GraphinferError as e:  # the group broke, or a refusal every rank made (e.g. a damaged artifact)
        logger.error("%s; exiting", e)
        return 1
    finally:
        if worker is not None:
            worker.release()
        ps.destroy()
    return 0


def serve_steps(worker: Worker) -> None:
    """Run what rank 0 sends until it says shut down."""
    channel, runner = StepChannel(), worker.model_runner
    prev = None  # the last shared sampled ids (async scheduling fills pending input ids from them)
    while True:
        ps.set_phase("the wait for rank 0's next message")
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, CallMessage):
            getattr(worker, msg.method)(*msg.args)
            continue
        ps.set_phase(f"step {msg.step}")
        if runner.pipeline is not None:
            worker.stage_step(msg.inputs)
            continue
        runner.step_logits(msg.inputs, prev)
        if msg.share_sampled:
            prev = torch.empty(len(msg.inputs.logits_indices), dtype=torch.int64, device=worker.device)
            ps.broadcast_from_rank0(prev)


def run_node(pc: ParallelConfig) -> int:
    """Node rank > 0 (`--node-rank R`): take rank 0's engine config from the rendezvous store (so every rank
    builds the same engine, whatever else this node's command line says), start this node's ranks, be the
    first of them, and wait for the others."""
    config = pickle.loads(ps.fetch(pc.master_addr, pc.master_port, CONFIG_KEY, pc.distributed_timeout))
    config.parallel_config.node_rank = pc.node_rank
    first = pc.node_rank * pc.ranks_per_node
    spec = {"config": config, "platform_cls": None, "master_port": pc.master_port}
    others = launch.start_ranks(WORKER_MODULE, list(range(first + 1, first + pc.ranks_per_node)), spec)
    logger.info("node %d of %d: ranks %d..%d of %s (rendezvous %s:%d)", pc.node_rank, pc.nnodes, first,
                first + pc.ranks_per_node - 1, config.model_config.model, pc.master_addr, pc.master_port)
    code = run_rank(config, first, pc.master_port)
    launch.stop_ranks(others)
    return code or max((r.process.returncode or 0 for r in others), default=0)


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    logging.basicConfig(level=envs.GRAPHINFER_LOG_LEVEL,
                        format=f"(rank {spec['rank']}) %(levelname)s %(name)s: %(message)s")
    return run_rank(spec["config"], spec["rank"], spec["master_port"], spec["platform_cls"])


if __name__ == "__main__":
    sys.exit(main())
