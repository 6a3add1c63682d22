"""A `--headless` node (vLLM's): this node's data-parallel replicas and nothing else (no API server, no front end).

Each replica is an engine-core process (engine/core_proc.py) that registers with node 0's front end at
--data-parallel-address:--data-parallel-rpc-port (engine/replica_listener.py), takes its engine settings, builds its
engine (and starts its tensor-parallel ranks) and is driven from there. This process waits: the node ends when one
of its replicas ends (the others are stopped; a failure is a non-zero exit), or on SIGTERM / Ctrl-C.
"""
import logging
import signal
import threading

from graphinfer.config import ParallelConfig
from graphinfer.distributed import launch
from graphinfer.runtime.engine.core_client import CORE_PROC_MODULE

logger = logging.getLogger(__name__)


def run_headless(pc: ParallelConfig) -> int:
    ranks = list(pc.local_data_parallel_ranks())
    replicas = launch.start_ranks(CORE_PROC_MODULE, ranks, {"remote": pc, "data_parallel": False, "platform_cls": None})
    logger.info("headless node: data-parallel replicas %s of %d, registering with %s:%d", ranks, pc.data_parallel_size,
                pc.data_parallel_address, pc.data_parallel_rpc_port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and all(r.process.poll() is None for r in replicas):
        pass
    codes = {r.rank: r.process.poll() for r in replicas}
    ended = {d: c for d, c in codes.items() if c is not None}
    failed = any(ended.values()) or stop.is_set()
    if ended:
        logger.log(logging.ERROR if failed else logging.INFO, "headless node: replica(s) %s ended (exit codes %s)%s",
                   sorted(ended), sorted(ended.values()), "; stopping the others" if len(ended) < len(codes) else "")
    launch.stop_ranks(replicas, timeout=0 if failed else 10)
    return 0 if stop.is_set() else int(any(r.process.returncode for r in replicas))
