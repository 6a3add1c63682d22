"""An engine core in a process of its own (vLLM v1's EngineCoreProc): `python -m graphinfer.runtime.engine.core_proc`,
its launch spec on stdin, talking to the CoreProcClient that started it (engine/core_client.py: the messages).

Two uses: a data-parallel replica d > 0 (its EngineCore, global rank d * tp, which starts its own tensor-parallel
ranks; a `--headless` node's replica, spec["remote"], registers with node 0's front end over the network instead:
engine/replica_listener.py, heartbeats both ways), and the server's engine core (an EngineCore, or with
data_parallel_size > 1 the data-parallel front end over every replica), so that HTTP, detokenization and the step
loop do not share one interpreter lock.

The loop: take new requests and aborts, step, send the outputs and the load. Idle and on its own, it sleeps until a
message comes; a replica in data-parallel lockstep keeps stepping (each step waits in the round replica 0 drives).
Calls (expert load, statistics) are answered on the reader thread, also while the loop waits in a round.
"""
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Client

from graphinfer import envs
from graphinfer.config import EngineConfig
from graphinfer.distributed.launch import HEARTBEAT_DEAD_S, HEARTBEAT_S
from graphinfer.errors import GraphinferError
from graphinfer.platforms import platform_for_device
from graphinfer.platforms.cpu import release_freed_memory
from graphinfer.runtime.engine.replica_listener import SILENCE_S, register

logger = logging.getLogger(__name__)


def serve(core, send, inbox: queue.Queue) -> None:
    """The step loop: take new requests and aborts, step, report outputs and load, until told to stop."""
    lockstep = getattr(core, "dp_lockstep", False)
    busy = False
    while True:
        # idle and on its own: sleep until a message comes; else take what has come
        idle = not lockstep and not core.has_unfinished_requests()
        if idle and busy:  # the work just ended: return its spike's freed memory (unless retained on purpose)
            release_freed_memory()
        msgs = [inbox.get()] if idle else []
        while not inbox.empty():
            msgs.append(inbox.get_nowait())
        for msg in msgs:
            if msg[0] == "stop" and not lockstep:  # lockstep: the front end's stop round ends it
                return
            if msg[0] == "add":
                core.add_requests(msg[1])
            elif msg[0] == "abort":
                core.abort_requests(msg[1])
                # the load goes with it: in lockstep the next report waits for a round the front end may not run
                send("aborted", msg[1], core.stats())
        busy = core.has_unfinished_requests() or bool(msgs)  # msgs: an abort changes the load too
        outs = core.step()  # lockstep: one round, a padding-only step when only other replicas have work
        if getattr(core, "lockstep", None) is not None and core.lockstep.stopped:
            return
        if busy or outs:
            send("outputs", outs, core.stats())


def run(spec: dict) -> int:
    remote = spec.get("remote") is not None  # a replica of a --headless node: registers over the network
    if remote:
        try:
            conn, config = register(spec["remote"], spec["rank"])
        except GraphinferError as e:  # node 0 unreachable, or it refused this replica: the message says why
            logger.error("%s", e)
            return 1
    else:
        config: EngineConfig = spec["config"]
        conn = Client(spec["address"], authkey=spec["authkey"])
    lock = threading.Lock()

    def send(*msg):
        with lock:
            conn.send(msg)

    def report_death(message: str) -> None:  # from a rank monitor's thread; the connection may be gone too
        try:
            send("error", message)
        except OSError:
            pass

    if remote:  # node 0's front end watches this heartbeat (it may sit in a lockstep round meanwhile)
        threading.Thread(target=_heartbeat, args=(send,), name="graphinfer-heartbeat", daemon=True).start()
    platform = spec["platform_cls"]() if spec.get("platform_cls") else \
        platform_for_device(str(config.model_config.device).split(":")[0])
    try:
        if spec["data_parallel"]:
            from graphinfer.runtime.engine.dp_core import DPEngineCore

            core = DPEngineCore(config, platform)
        else:
            from graphinfer.runtime.engine.core import EngineCore

            pc = config.parallel_config
            d = spec["rank"] if remote else spec["rank"] // pc.replica_size
            core = EngineCore(replace(config, parallel_config=replace(pc, data_parallel_rank=d)), platform)
    except GraphinferError as e:  # a refusal the user can act on: the front end shows it, no traceback here
        send("error", f"{type(e).__name__}: {e}")
        return 1
    except Exception as e:
        send("error", f"{type(e).__name__}: {e}")
        raise
    inbox: queue.Queue = queue.Queue()
    told_to_stop, front_end_gone = threading.Event(), threading.Event()

    def read():  # calls are answered here, also while the step loop waits in a lockstep round
        try:
            while True:
                if remote and not conn.poll(SILENCE_S):
                    raise EOFError(f"nothing for {SILENCE_S:g} s")
                msg = conn.recv()
                if msg[0] == "call":
                    send("reply", getattr(core, msg[1])(*msg[2]))
                elif msg[0] != "alive":
                    if msg[0] == "stop":
                        told_to_stop.set()
                    inbox.put(msg)
        except (EOFError, OSError) as e:  # the front end is gone: stop
            if remote and not told_to_stop.is_set():  # and no orphan: a round or a step may wait on node 0 for good
                logger.error("node 0's front end went away (%s); replica %d stops", e or "connection closed",
                             spec["rank"])
                front_end_gone.set()
                threading.Timer(HEARTBEAT_DEAD_S, os._exit, (1,)).start()
            inbox.put(("stop",))

    core.on_death(report_death)
    threading.Thread(target=read, name="graphinfer-core-read", daemon=True).start()
    send("ready", core.info())
    try:
        serve(core, send, inbox)
        if front_end_gone.is_set():
            return 1
        send("stopped", core.stats())  # the load once every message before the stop was handled
    except Exception as e:
        if front_end_gone.is_set():  # what failed waited on node 0 (its log says why it went)
            logger.error("stopped: %s: %s", type(e).__name__, e)
        else:
            logger.exception("the engine core failed")
            report_death(f"{type(e).__name__}: {e}")
        return 1
    finally:
        core.shutdown()
    return 0


def _heartbeat(send) -> None:
    while True:
        try:
            send("alive")
        except OSError:
            return
        time.sleep(HEARTBEAT_S)


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the front end decides
    name = f"data-parallel replica {spec['rank']}" if spec.get("remote") else f"engine core {spec['rank']}"
    logging.basicConfig(level=envs.GRAPHINFER_LOG_LEVEL, format=f"({name}) %(levelname)s %(name)s: %(message)s")
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
