"""An engine core in a process of its own (vLLM v1's EngineCoreProc): `python -m graphinfer.runtime.engine.core_proc`,
its launch spec on stdin, talking to the CoreProcClient that started it (engine/core_client.py: the messages).

Two uses: a data-parallel replica d > 0 (its EngineCore, global rank d * tp, which starts its own tensor-parallel
ranks), and the server's engine core (an EngineCore, or with data_parallel_size > 1 the data-parallel front end over
every replica), so that HTTP, detokenization and the step loop do not share one interpreter lock.

The loop: take new requests and aborts, step, send the outputs and the load. Idle and on its own, it sleeps until a
message comes; a replica in data-parallel lockstep keeps stepping (each step waits in the round replica 0 drives).
Calls (expert load, statistics) are answered on the reader thread, also while the loop waits in a round.
"""
import logging
import pickle
import queue
import signal
import sys
import threading
from dataclasses import replace
from multiprocessing.connection import Client

from graphinfer import envs
from graphinfer.config import EngineConfig
from graphinfer.errors import GraphinferError
from graphinfer.platforms.cpu import release_freed_memory

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

    platform = spec["platform_cls"]()
    try:
        if spec["data_parallel"]:
            from graphinfer.runtime.engine.dp_core import DPEngineCore

            core = DPEngineCore(config, platform)
        else:
            from graphinfer.runtime.engine.core import EngineCore

            pc = config.parallel_config
            d = spec["rank"] // pc.tensor_parallel_size
            core = EngineCore(replace(config, parallel_config=replace(pc, data_parallel_rank=d)), platform)
    except GraphinferError as e:  # a refusal the user can act on: the front end shows it, no traceback here
        send("error", f"{type(e).__name__}: {e}")
        return 1
    except Exception as e:
        send("error", f"{type(e).__name__}: {e}")
        raise
    inbox: queue.Queue = queue.Queue()

    def read():  # calls are answered here, also while the step loop waits in a lockstep round
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "call":
                    send("reply", getattr(core, msg[1])(*msg[2]))
                else:
                    inbox.put(msg)
        except (EOFError, OSError):  # the front end is gone: stop
            inbox.put(("stop",))

    core.on_death(report_death)
    threading.Thread(target=read, name="graphinfer-core-read", daemon=True).start()
    send("ready", core.info())
    try:
        serve(core, send, inbox)
        send("stopped", core.stats())  # the load once every message before the stop was handled
    except Exception as e:
        logger.exception("the engine core failed")
        send("error", f"{type(e).__name__}: {e}")
        return 1
    finally:
        core.shutdown()
    return 0


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the front end decides
    logging.basicConfig(level=envs.GRAPHINFER_LOG_LEVEL,
                        format=f"(engine core {spec['rank']}) %(levelname)s %(name)s: %(message)s")
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
