"""The other ranks' processes: started on this node, watched, stopped.

Node 0's main process is rank 0 and starts node 0's other ranks; on node R > 0 the main process runs the first
of its ranks itself and starts the rest (torchrun-style: every node runs the same command). A rank is a fresh
`python -m <module>` reading its launch spec (pickled) on stdin, so nothing of the user's __main__ runs
again, as it would under multiprocessing's spawn.

RankMonitor (on rank 0) reports a rank that ends before its shutdown within seconds: a local rank by its
process's exit, a rank on another node by its heartbeat in the rendezvous store going quiet.
"""
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HEARTBEAT_DEAD_S = 6.0  # a remote rank whose heartbeat is this quiet is taken for dead


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen


def start_ranks(module: str, ranks: list[int], spec: dict) -> list[RankProcess]:
    """Start `python -m module` once per rank, each reading {**spec, "rank": rank} on stdin. The child sees this
    process's sys.path (so classes in the spec, a plugin platform say, unpickle there) and ignores Ctrl-C: rank 0
    decides when the group stops."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = []
    for rank in ranks:
        p = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)
        p.stdin.write(pickle.dumps({**spec, "rank": rank}))
        p.stdin.close()
        started.append(RankProcess(rank, p))
    return started


def stop_ranks(ranks: list[RankProcess], timeout: float = 10.0) -> None:
    """Wait for ranks told to shut down; terminate (then kill) those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    for r in ranks:
        try:
            r.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.process.terminate()
            try:
                r.process.wait(3)
            except subprocess.TimeoutExpired:
                r.process.kill()


def _heartbeat_key(rank: int) -> str:
    return f"graphinfer/heartbeat/{rank}"


def start_heartbeat(master_addr: str, master_port: int, rank: int) -> None:
    """On a rank of another node: count up a key in the rendezvous store every second, for RankMonitor."""
    store = dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False)

    def beat():
        while True:
            try:
                store.add(_heartbeat_key(rank), 1)
            except Exception:  # rank 0 is gone: its step channel ends this process
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="graphinfer-heartbeat", daemon=True).start()


class RankMonitor:
    """Calls on_death(message) once when a rank ends before stop() was called."""

    def __init__(self, local: list[RankProcess], remote_ranks: list[int], master_addr: str, master_port: int,
                 on_death: Callable[[str], None], kind: str = "tensor-parallel rank",
                 label: Callable[[int], str] | None = None):
        """kind: what the messages call a local process (its rank follows); label(rank): the whole name instead
        (e.g. with its pipeline stage)."""
        self.on_death = on_death
        self.label = label or (lambda rank: f"{kind} {rank}")
        self.stopping = False
        self._reported = threading.Lock()
        for r in local:
            threading.Thread(target=self._wait, args=(r,), name=f"graphinfer-rank{r.rank}-watch", daemon=True).start()
        if remote_ranks:
            store = dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False)
            threading.Thread(target=self._heartbeats, args=(store, remote_ranks), name="graphinfer-heartbeat-watch",
                             daemon=True).start()

    def stop(self) -> None:
        self.stopping = True

    def _report(self, message: str) -> None:
        if not self.stopping and self._reported.acquire(blocking=False):
            self.on_death(message)

    def _wait(self, r: RankProcess) -> None:
        code = r.process.wait()
        self._report(f"{self.label(r.rank)} (pid {r.process.pid}) exited with code {code}")

    def _heartbeats(self, store, ranks: list[int]) -> None:
        last = {r: (-1, time.monotonic()) for r in ranks}
        while not self.stopping:
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for r in ranks:
                try:
                    count = store.add(_heartbeat_key(r), 0)
                except Exception:  # the store lives in this process: gone only at exit
                    return
                if count != last[r][0]:
                    last[r] = (count, now)
                elif now - last[r][1] > HEARTBEAT_DEAD_S:
                    self._report(f"{self.label(r)} (on another node) sent no heartbeat for "
                                 f"{now - last[r][1]:.0f} s")
                    return
