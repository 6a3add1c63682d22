"""Data parallel (vLLM's data_parallel_size): dp engine replicas, each of tensor_parallel_size ranks with its own
scheduler and KV cache, behind one front end that sends each request to the replica with the fewest outstanding
tokens (vLLM's DP load balancing).

Replica 0 runs in the front end's process (the LLM, the server). Replica d > 0 is a process of its own (`python -m
graphinfer.runtime.dp_engine`, global rank d * tp, which starts its TP workers as replica 0 does), fed over a
multiprocessing connection: requests and aborts in; outputs and its scheduler's load out after each step. All
replicas join one torch.distributed world (tp x dp ranks): MoE + expert parallel replicas exchange tokens in every
MoE layer and step in lockstep (runtime/dp_lockstep.py): replica 0 drives the rounds while any replica has work,
the others follow, idle ones with padding-only steps. Dense replicas share nothing and step on their own.
"""
import logging
import pickle
import queue
import secrets
import sys
import threading
from dataclasses import replace
from multiprocessing.connection import Client, Connection, Listener

from graphinfer import envs
from graphinfer.config import EngineConfig
from graphinfer.distributed import launch
from graphinfer.errors import GraphinferError, InvalidRequestError
from graphinfer.outputs import RequestOutput
from graphinfer.runtime import llm_engine
from graphinfer.runtime.llm_engine import LLMEngine
from graphinfer.runtime.parallel_layout import check_parallel_config
from graphinfer.runtime.sequence import Sequence

logger = logging.getLogger(__name__)

CORE_MODULE = "graphinfer.runtime.dp_engine"


class Replica:
    """The front end's view of replica d > 0: its connection, its requests, its last reported load."""

    def __init__(self, dp_rank: int, conn: Connection):
        self.dp_rank, self.conn = dp_rank, conn
        self.send_lock = threading.Lock()
        self.replies: queue.Queue = queue.Queue()
        self.stats: dict = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0}
        self.ready = threading.Event()

    def send(self, *msg) -> None:
        with self.send_lock:
            self.conn.send(msg)


class DPEngine:
    """The front end: the LLMEngine methods the LLM and the server use, over dp replicas. Anything else (the
    tokenizer, the config, max_model_len, ...) is replica 0's."""

    def __init__(self, config: EngineConfig, platform=None):
        # every replica on the same platform (class): their graph paths, and so their collectives, must pair
        platform = platform or llm_engine.platform_for_device(str(config.model_config.device).split(":")[0])
        check_parallel_config(config)  # before any replica starts
        pc = config.parallel_config
        pc.master_port = pc.master_port or launch.free_port()
        self.dp_size, tp = pc.data_parallel_size, pc.tensor_parallel_size
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {"config": config, "address": self._listener.address, "authkey": authkey,
                "platform_cls": type(platform)}
        self.procs = launch.start_ranks(CORE_MODULE, [d * tp for d in range(1, self.dp_size)], spec)
        self.replicas: dict[int, Replica] = {}
        self.dead: str | None = None
        self.death_listeners: list = []
        self._outputs: queue.Queue = queue.Queue()  # the remote replicas' RequestOutputs, in arrival order
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its cost in tokens)
        self.outstanding = [0] * self.dp_size  # tokens each replica still has to process (prompt + max new)
        self.requests_routed = [0] * self.dp_size
        self._stopped = False
        threading.Thread(target=self._accept, name="graphinfer-dp-accept", daemon=True).start()
        self._monitor = launch.RankMonitor(self.procs, [], pc.master_addr, pc.master_port,
                                           lambda m: self._on_death(f"a data-parallel replica's process ended ({m})"))
        try:
            self.local = LLMEngine(replace(config, parallel_config=replace(pc, data_parallel_rank=0)), platform)
            for d in range(1, self.dp_size):
                while not self._replica(d).ready.wait(0.5):
                    if self.dead:
                        raise GraphinferError(f"data-parallel replica start-up failed: {self.dead}")
        except BaseException:
            self.shutdown()
            raise
        self.local.on_death(self._on_death)
        logger.info("data parallel: %d replicas of %d rank(s)", self.dp_size, tp)

    # ----- connections -----
    def _accept(self) -> None:
        for _ in range(1, self.dp_size):
            try:
                conn = self._listener.accept()
            except OSError:  # closed at shutdown
                return
            d = conn.recv()
            self.replicas[d] = Replica(d, conn)
            threading.Thread(target=self._read, args=(self.replicas[d],), name=f"graphinfer-dp{d}-read",
                             daemon=True).start()

    def _replica(self, d: int) -> Replica:
        while d not in self.replicas:
            if self.dead:
                raise GraphinferError(f"data-parallel replica {d} never connected: {self.dead}")
            threading.Event().wait(0.05)
        return self.replicas[d]

    def _read(self, r: Replica) -> None:
        try:
            while True:
                kind, *body = r.conn.recv()
                if kind == "outputs":
                    outs, r.stats = body
                    for out in outs:
                        self._outputs.put(out)
                elif kind == "ready":
                    r.ready.set()
                elif kind == "aborted":  # the request id (step() forgets it there) and the load without it
                    request_id, r.stats = body
                    self._outputs.put(request_id)
                elif kind == "reply":
                    r.replies.put(body[0])
                elif kind == "error":
                    return self._on_death(f"data-parallel replica {r.dp_rank} failed: {body[0]}")
        except (EOFError, OSError):
            if not self._stopped:
                self._on_death(f"data-parallel replica {r.dp_rank} went away")

    def _on_death(self, message: str) -> None:
        if self._stopped or self.dead:
            return
        self.dead = message
        logger.error("%s: the engine cannot run without it, stopping", message)
        self._outputs.put(None)  # wake a step waiting for outputs
        for listener in self.death_listeners:
            listener(message)

    def on_death(self, callback) -> None:
        self.death_listeners.append(callback)

    def __getattr__(self, name):  # tokenizer, config, max_model_len, hf_config, model_runner, startup, ...
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    # ----- requests -----
    def make_sequence(self, prompt, params, request_id: str | None = None) -> Sequence:
        if request_id is not None and request_id in self._owner:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.")
        return self.local.make_sequence(prompt, params, request_id)

    def add_sequence(self, seq: Sequence, dp_rank: int | None = None) -> None:
        """Queue seq on replica dp_rank (None: the one with the fewest outstanding tokens, the lowest on a tie)."""
        d = min(range(self.dp_size), key=lambda i: (self.outstanding[i], i)) if dp_rank is None else dp_rank
        # a parallel-sampling request stays whole on one replica (its children share the prompt's KV blocks there)
        cost = seq.num_prompt_tokens + seq.max_tokens * seq.sampling_params.num_candidates
        self._owner[seq.request_id] = (d, cost)
        self.outstanding[d] += cost
        self.requests_routed[d] += 1
        if d == 0:
            self.local.add_sequence(seq)
        else:
            self._check()
            self.replicas[d].send("add", seq.prompt, seq.prompt_token_ids, seq.sampling_params, seq.request_id)

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request was routed to (None once it finished or was aborted)."""
        owner = self._owner.get(request_id)
        return owner[0] if owner is not None else None

    def abort_request(self, request_id: str) -> None:
        d, _ = self._owner.get(request_id, (None, 0))
        if d == 0:
            self._finish(request_id)
            self.local.abort_request(request_id)
        elif d is not None and not self.dead:  # outstanding until the replica says it freed it (its next step)
            self.replicas[d].send("abort", request_id)

    def _finish(self, request_id: str) -> int | None:
        d, cost = self._owner.pop(request_id, (None, 0))
        if d is not None:
            self.outstanding[d] -= cost
        return d

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or self.local.has_unfinished_requests()

    def _check(self) -> None:
        if self.dead:
            raise GraphinferError(f"The data-parallel engine cannot run: {self.dead}")

    def step(self) -> list[RequestOutput]:
        """One step of replica 0 (in lockstep: one round of every replica), and whatever the others sent."""
        self._check()
        arrived = []
        if self.local.dp_lockstep or self.local.has_unfinished_requests():
            outs = self.local.step()
        else:  # only other replicas have work: wait for what they send instead of spinning
            outs = []
            try:
                arrived.append(self._outputs.get(timeout=0.01))
            except queue.Empty:
                pass
        while not self._outputs.empty():
            arrived.append(self._outputs.get_nowait())
        for item in arrived:
            if isinstance(item, str):  # a replica freed an aborted request
                self._finish(item)
            elif item is not None:  # None: a death's wake-up
                outs.append(item)
        self._check()
        for out in outs:
            if out.finished:
                self._finish(out.request_id)
        return outs

    # ----- load and statistics -----
    def scheduler_stats(self) -> dict:
        """Summed over the replicas, with each replica's own under "engines" (label engine=<dp rank>)."""
        engines = [self.local.scheduler_stats()] + [self.replicas[d].stats for d in range(1, self.dp_size)]
        for d, e in enumerate(engines):
            e["requests"] = self.requests_routed[d]
        total = {k: sum(e[k] for e in engines) for k in ("running", "waiting", "preemptions")}
        return {**total, "kv_usage": sum(e["kv_usage"] for e in engines) / len(engines), "engines": engines}

    def _call_all(self, method: str) -> list:
        """engine.<method>() on every replica (a side thread answers it there, also while it waits for a round)."""
        for d in range(1, self.dp_size):
            self.replicas[d].send("call", method)
        return [getattr(self.local, method)()] + [self.replicas[d].replies.get(timeout=60) for d in
                                                   range(1, self.dp_size)]

    def expert_load(self) -> dict[int, list[int]]:
        """Every replica's tokens per expert, summed (each replica counts the tokens it scheduled)."""
        total: dict[int, list[int]] = {}
        for load in self._call_all("expert_load"):
            for layer, counts in load.items():
                total[layer] = [a + b for a, b in zip(total.get(layer, [0] * len(counts)), counts)]
        return total

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        from graphinfer.runtime.expert_load import summarize

        return summarize(self.expert_load(), ep_size or self.local.expert_parallel_size)

    def reset_expert_load(self) -> None:
        self._call_all("reset_expert_load")

    def shutdown(self) -> None:
        """Stop the other replicas (each shuts its engine and TP workers down), then replica 0. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._monitor.stop()
        for r in self.replicas.values():
            try:
                r.send("stop")
            except OSError:
                pass
        local = self.__dict__.get("local")
        if local is not None and local.model_runner is not None and not self.dead:
            local.lockstep.stop_rounds()  # lockstep replicas wait in a round: this one tells them to stop
        launch.stop_ranks(self.procs, timeout=30 if local is not None and not self.dead else 0)
        self._listener.close()
        if local is not None:
            local.shutdown()


# ----- replica d > 0 -----
def serve_replica(engine: LLMEngine, send, inbox: queue.Queue) -> None:
    """The replica's step loop: take new requests and aborts, step, report outputs and load."""
    while True:
        # idle and on its own: sleep until a message comes; else take what has come
        msgs = [] if engine.dp_lockstep or engine.has_unfinished_requests() else [inbox.get()]
        while not inbox.empty():
            msgs.append(inbox.get_nowait())
        for msg in msgs:
            if msg[0] == "stop" and not engine.dp_lockstep:  # lockstep: the front end's stop round ends it
                return
            if msg[0] == "add":
                _, text, ids, params, request_id = msg
                seq = engine.make_sequence(ids, params, request_id)
                seq.prompt = text
                engine.add_sequence(seq)
            elif msg[0] == "abort":
                engine.abort_request(msg[1])
                # the load goes with it: in lockstep the next report waits for a round the front end may not run
                send("aborted", msg[1], engine.scheduler_stats())
        busy = engine.has_unfinished_requests() or bool(msgs)  # msgs: an abort changes the load too
        outs = engine.step()  # lockstep: one round, a padding-only step when only other replicas have work
        if engine.lockstep.stopped:
            return
        if busy or outs:
            send("outputs", outs, engine.scheduler_stats())


def run_replica(spec: dict) -> int:
    config: EngineConfig = spec["config"]
    d = spec["rank"] // config.parallel_config.tensor_parallel_size
    config = replace(config, parallel_config=replace(config.parallel_config, data_parallel_rank=d))
    conn = Client(spec["address"], authkey=spec["authkey"])
    conn.send(d)
    lock = threading.Lock()

    def send(*msg):
        with lock:
            conn.send(msg)

    platform = spec["platform_cls"]()
    try:
        engine = LLMEngine(config, platform=platform)
    except Exception as e:
        send("error", f"{type(e).__name__}: {e}")
        raise
    inbox: queue.Queue = queue.Queue()

    def read():  # calls are answered here, also while the step loop waits in a lockstep round
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "call":
                    send("reply", getattr(engine, msg[1])())
                else:
                    inbox.put(msg)
        except (EOFError, OSError):  # the front end is gone: stop
            inbox.put(("stop",))

    threading.Thread(target=read, name="graphinfer-dp-read", daemon=True).start()
    send("ready")
    try:
        serve_replica(engine, send, inbox)
    except Exception as e:
        logger.exception("replica %d failed", d)
        send("error", f"{type(e).__name__}: {e}")
        return 1
    finally:
        engine.shutdown()
    return 0


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the front end decides
    logging.basicConfig(level=envs.GRAPHINFER_LOG_LEVEL,
                        format=f"(dp rank {spec['rank']}) %(levelname)s %(name)s: %(message)s")
    return run_replica(spec)


if __name__ == "__main__":
    sys.exit(main())
