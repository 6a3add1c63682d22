"""An engine core in a process of its own (engine/core_proc.py), seen from the process that started it: vLLM v1's
EngineCoreClient over one multiprocessing connection (pickles; every message a tuple whose first item names it).

  to the core     ("add", [EngineCoreRequest]), ("abort", [request id]), ("call", method, args), ("stop",)
  from the core   ("ready", EngineCoreInfo), ("outputs", [EngineCoreOutput], stats), ("aborted", [request id], stats),
                  ("reply", value), ("stopped", stats), ("error", message)

A reader thread takes what the core sends: outputs and abort acknowledgements queue up in arrival order (get_outputs),
the load it reports with them replaces the last (stats), replies answer call(). The core's process ending, or its
connection breaking, is a death: on_death callbacks run once and every wait ends.

Structured outputs: a request's compiled grammar crosses as xgrammar's serialization (the core rebuilds it against
its own tokenizer info), not as a pickle of the C++ object.
"""
import logging
import queue
import secrets
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Listener

from graphinfer import envs
from graphinfer.config import EngineConfig
from graphinfer.distributed import launch
from graphinfer.errors import GraphinferError
from graphinfer.runtime.engine.core import EngineCoreInfo
from graphinfer.runtime.engine.replica_listener import SILENCE_S
from graphinfer.runtime.engine.request import EngineCoreRequest
from graphinfer.runtime.structured_output import serialize_grammar

logger = logging.getLogger(__name__)

CORE_PROC_MODULE = "graphinfer.runtime.engine.core_proc"


class CoreProcClient:
    def __init__(self, config: EngineConfig, platform_cls: type, name: str, rank: int = 0, data_parallel: bool = False,
                 outputs: queue.Queue | None = None):
        """Start the core's process (it builds its engine meanwhile: wait_ready). name: what errors call it ("data-
        parallel replica 1", "the engine core"); rank: the global rank of its replica's leader (data parallel:
        d * tensor_parallel_size); data_parallel: the process runs the data-parallel front end (engine/dp_core.py)
        over every replica, not one replica; outputs: the queue its outputs go to (several cores may share one)."""
        self._init(name, outputs)
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {"config": config, "address": self._listener.address, "authkey": authkey, "platform_cls": platform_cls,
                "data_parallel": data_parallel}
        self.proc = launch.start_ranks(CORE_PROC_MODULE, [rank], spec)[0]
        self._monitor = launch.RankMonitor([self.proc], [], config.parallel_config.master_addr, 0,
                                           lambda m: self._on_death(f"{self.name}'s process ended ({m})"),
                                           kind="engine-core process of rank")
        # a process that lives but never connects (stuck before its engine starts) ends the wait too
        self._deadline = threading.Timer(config.parallel_config.distributed_timeout, self._connect_deadline,
                                         (config.parallel_config.distributed_timeout,))
        self._deadline.daemon = True
        self._deadline.start()
        threading.Thread(target=self._accept, name=f"graphinfer-core{rank}-accept", daemon=True).start()

    def _init(self, name: str, outputs: queue.Queue | None) -> None:
        self.name = name
        self.proc = None
        self.conn = None
        self._send_lock = threading.Lock()
        self._call_lock = threading.Lock()  # one call() at a time: replies come back in order, unlabelled
        self._connected = threading.Event()
        self._info: EngineCoreInfo | None = None
        self._ready = threading.Event()
        # lists of EngineCoreOutput, or ("aborted", ids); None: a death
        self.outputs: queue.Queue = outputs if outputs is not None else queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.last_stats: dict = {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_blocks_in_use": 0, "preemptions": 0}
        self.dead: str | None = None
        self.death_listeners: list = []
        self._stopped = False
        self._reader_done = threading.Event()

    def _connect_deadline(self, seconds: float) -> None:
        if not self._connected.is_set():
            self._on_death(f"{self.name} did not connect within {seconds:g} s of its start (--distributed-timeout)")

    # ----- connection -----
    def _accept(self) -> None:
        try:
            conn = self._listener.accept()
        except OSError:  # closed at shutdown
            return
        self._deadline.cancel()
        self._read(conn)

    def _read(self, conn, heartbeat: bool = False) -> None:
        """Take what the core sends until its connection ends; heartbeat: it sends one at least every
        HEARTBEAT_S (a core on another node), and SILENCE_S of silence is its death."""
        self.conn = conn
        self._connected.set()
        try:
            while True:
                if heartbeat and not conn.poll(SILENCE_S):
                    return self._on_death(f"{self.name} sent nothing for {SILENCE_S:g} s (its node is "
                                          f"down or cut off)")
                kind, *body = conn.recv()
                if kind == "outputs":
                    outs, self.last_stats = body
                    self.outputs.put(outs)
                elif kind == "aborted":  # the ids (their outputs end there) and the load without them
                    ids, self.last_stats = body
                    self.outputs.put(("aborted", ids))
                elif kind == "stopped":  # the load with every earlier message handled (its last word)
                    self.last_stats = body[0]
                elif kind == "ready":
                    self._info = body[0]
                    self._ready.set()
                elif kind == "reply":
                    self.replies.put(body[0])
                elif kind == "error":
                    return self._on_death(f"{self.name} failed: {body[0]}")
        except (EOFError, OSError):
            if not self._stopped:
                self._on_death(f"{self.name} went away")
        finally:
            self._reader_done.set()

    def _on_death(self, message: str) -> None:
        if self._stopped or self.dead:
            return
        self.dead = message
        logger.error("%s: the engine cannot run without it, stopping", message)
        self.outputs.put(None)  # wake a wait for outputs
        self.replies.put(None)
        self._ready.set()
        for listener in self.death_listeners:
            listener(message)

    def on_death(self, callback) -> None:
        self.death_listeners.append(callback)

    def check(self) -> None:
        if self.dead:
            raise GraphinferError(f"The engine cannot run: {self.dead}")

    def wait_ready(self) -> EngineCoreInfo:
        """Block until the core has built its engine; raises if it failed or took longer than
        GRAPHINFER_ENGINE_READY_TIMEOUT_S (a live process stuck in its build would otherwise hold the front end)."""
        seconds = float(envs.GRAPHINFER_ENGINE_READY_TIMEOUT_S)
        if not self._ready.wait(seconds):
            self._on_death(f"{self.name} did not build its engine within {seconds:g} s "
                           "(GRAPHINFER_ENGINE_READY_TIMEOUT_S)")
        if self._info is None:
            raise GraphinferError(f"{self.dead} (while it started)")
        return self._info

    info = wait_ready

    def _send(self, *msg) -> None:
        while not self._connected.wait(0.1):
            self.check()
        self.check()
        with self._send_lock:
            self.conn.send(msg)

    # ----- requests -----
    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        self._send("add", [replace(r, grammar=serialize_grammar(r.grammar)) if r.grammar is not None else r
                           for r in reqs])

    def abort_requests(self, request_ids: list[str]) -> None:
        if not self.dead:
            self._send("abort", list(request_ids))

    # ----- the EngineCore interface, for a front end (entrypoints/llm_engine.py) -----
    def step(self, timeout: float = 0.05) -> list:
        """The outputs the core sent since the last call, waiting up to `timeout` s for the first."""
        self.check()
        outs, items = [], []
        try:
            items.append(self.outputs.get(timeout=timeout))
        except queue.Empty:
            return outs
        while not self.outputs.empty():
            items.append(self.outputs.get_nowait())
        for item in items:
            if isinstance(item, list):
                outs += item
        self.check()
        return outs

    def has_unfinished_requests(self) -> bool:
        return False  # the front end knows its requests; the core reports nothing else

    def stats(self) -> dict:
        """The load the core reported with its last outputs."""
        return self.last_stats

    def expert_load(self) -> dict:
        return self.call("expert_load")

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        return self.call("expert_load_summary", ep_size)

    def reset_expert_load(self) -> None:
        self.call("reset_expert_load")

    def spec_decode_stats(self) -> dict:
        return self.call("spec_decode_stats")

    def eplb_stats(self) -> dict:
        return self.call("eplb_stats")

    def save_expert_map(self, path: str) -> str:
        return self.call("save_expert_map", path)

    def add_lora(self, request) -> str | None:
        return self.call("add_lora", request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.call("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        return self.call("list_loras")

    def wait_for_kv_cache_pages(self) -> None:
        """The core's process commits its pages in its idle time (as a server does)."""

    def call(self, method: str, *args, timeout: float = 60):
        """core.<method>(*args) in the core's process (answered on its reader thread, also while it steps)."""
        with self._call_lock:
            self._send("call", method, args)
            try:
                reply = self.replies.get(timeout=timeout)
            except queue.Empty:
                raise GraphinferError(f"{self.name} did not answer {method}() within {timeout:g} s") from None
        self.check()
        return reply

    def request_stop(self) -> None:
        """Tell the core to stop (its process ending is no longer a death). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.proc is not None:
            self._monitor.stop()
        if self.conn is not None and not self.dead:
            try:
                with self._send_lock:
                    self.conn.send(("stop",))
            except OSError:
                pass

    def shutdown(self, timeout: float = 30) -> None:
        """request_stop, then wait for the core's process (terminate it after `timeout` s). Idempotent."""
        self.request_stop()
        if self.proc.process.returncode is None:
            launch.stop_ranks([self.proc], timeout=timeout if not self.dead else 0)
        self._listener.close()


class RemoteCoreClient(CoreProcClient):
    """A data-parallel replica on another node (a `--headless` node's engine-core process): no process of ours; its
    connection comes from the front end's ReplicaListener once it registers (engine/replica_listener.py), and carries
    a heartbeat each way."""

    def __init__(self, listener, d: int, name: str, outputs: queue.Queue | None = None):
        self._init(name, outputs)
        self.dp_rank = d
        threading.Thread(target=self._wait_register, args=(listener,), name=f"graphinfer-replica{d}-register",
                         daemon=True).start()

    def _wait_register(self, listener) -> None:
        seconds = listener.pc.distributed_timeout
        conn = listener.wait_for(self.dp_rank, seconds)
        if conn is None:
            if not self._stopped:
                self._on_death(listener.missing_message() or f"{self.name} did not register")
            return
        threading.Thread(target=self._heartbeat, args=(conn,), name=f"graphinfer-replica{self.dp_rank}-heartbeat",
                         daemon=True).start()
        self._read(conn, heartbeat=True)

    def _heartbeat(self, conn) -> None:
        while not self._stopped and not self.dead:
            try:
                with self._send_lock:
                    conn.send(("alive",))
            except OSError:
                return
            time.sleep(launch.HEARTBEAT_S)

    def shutdown(self, timeout: float = 30) -> None:
        """request_stop, then wait up to `timeout` s for the replica's last word (its connection closing)."""
        self.request_stop()
        if self.conn is not None:
            self._reader_done.wait(timeout)
            self.conn.close()
