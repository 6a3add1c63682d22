"""Data parallel (vLLM's data_parallel_size): dp engine-core replicas, each of tensor_parallel_size ranks with its own
scheduler and KV cache, behind one front end that sends each request to the replica with the fewest outstanding
tokens (vLLM's DP load balancing). DPEngineCore has the EngineCore interface, so the front ends (entrypoints/) drive
one replica or many alike.

Replica 0's EngineCore runs in this process. Replica d > 0 is an engine-core process (engine/core_proc.py, global
rank d * tp, which starts its TP workers as replica 0 does), fed through a CoreProcClient: requests and aborts in;
outputs and its scheduler's load out after each step. Across nodes (data_parallel_size_local < data_parallel_size)
replicas [local size, dp) run on `--headless` nodes: they register with this front end over the network
(engine/replica_listener.py) and are driven alike through a RemoteCoreClient, with a heartbeat each way.
All replicas join one torch.distributed world (tp x dp ranks):
MoE + expert parallel replicas exchange tokens in every MoE layer and step in lockstep (engine/dp_lockstep.py):
replica 0 drives the rounds while any replica has work, the others follow, idle ones with padding-only steps. Dense
replicas share nothing and step on their own.
"""
import logging
import queue
from dataclasses import replace

from graphinfer.config import EngineConfig
from graphinfer.distributed import launch
from graphinfer.errors import GraphinferError, InvalidRequestError
from graphinfer.platforms import Platform, platform_for_device
from graphinfer.runtime.engine.core import EngineCore, EngineCoreInfo
from graphinfer.runtime.engine.core_client import CoreProcClient, RemoteCoreClient
from graphinfer.runtime.engine.replica_listener import ReplicaListener
from graphinfer.runtime.engine.request import EngineCoreOutput, EngineCoreRequest
from graphinfer.runtime.executor.parallel_layout import check_parallel_config, expert_parallel_size
from graphinfer.runtime.worker.expert_load import summarize

logger = logging.getLogger(__name__)


class DPEngineCore:
    dp_lockstep = False  # it drives replica 0's lockstep rounds itself (step), only while some replica has work

    def __init__(self, config: EngineConfig, platform: Platform | None = None):
        # every replica on the same platform (class): their graph paths, and so their collectives, must pair
        platform = platform or platform_for_device(str(config.model_config.device).split(":")[0])
        check_parallel_config(config)  # before any replica starts
        pc = config.parallel_config
        pc.master_port = pc.master_port or launch.free_port()
        self.config, self.dp_size, tp = config, pc.data_parallel_size, pc.tensor_parallel_size
        self.dead: str | None = None
        self.death_listeners: list = []
        self._outputs: queue.Queue = queue.Queue()  # the remote replicas' (CoreProcClient.outputs), in arrival order
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, its cost in tokens)
        self.outstanding = [0] * self.dp_size  # tokens each replica still has to process (prompt + max new)
        self.requests_routed = [0] * self.dp_size
        self._stopped = False
        self.local: EngineCore | None = None
        here = pc.data_parallel_size_local  # replicas [here, dp) run on other nodes and register over the network
        self.listener = ReplicaListener(config) if pc.data_parallel_across_nodes else None
        self.replicas = {d: CoreProcClient(config, type(platform), f"data-parallel replica {d}",
                                           rank=d * pc.replica_size, outputs=self._outputs) for d in range(1, here)}
        self.replicas.update({d: RemoteCoreClient(self.listener, d, f"data-parallel replica {d} (another node)",
                                                  outputs=self._outputs) for d in range(here, self.dp_size)})
        try:
            for r in self.replicas.values():
                r.on_death(self._on_death)
            self.local = EngineCore(replace(config, parallel_config=replace(pc, data_parallel_rank=0)), platform)
            for r in self.replicas.values():
                r.wait_ready()
        except BaseException as e:
            self.shutdown()
            if self.listener is not None and self.listener.missing():  # the first thing to fix
                raise GraphinferError(self.listener.missing_message()) from e
            if self.dead and not isinstance(e, GraphinferError):
                raise GraphinferError(f"data-parallel replica start-up failed: {self.dead}") from e
            raise
        self.local.on_death(self._on_death)
        logger.info("data parallel: %d replicas of %d rank(s)", self.dp_size, tp)

    def info(self) -> EngineCoreInfo:
        return self.local.info()

    def _on_death(self, message: str) -> None:
        if self._stopped or self.dead:
            return
        self.dead = message
        logger.error("%s: the engine cannot run without it, stopping", message)
        for listener in self.death_listeners:
            listener(message)

    def on_death(self, callback) -> None:
        self.death_listeners.append(callback)

    def _check(self) -> None:
        if self.dead:
            raise GraphinferError(f"The data-parallel engine cannot run: {self.dead}")

    # ----- requests -----
    def add_requests(self, reqs: list[EngineCoreRequest], dp_rank: int | None = None) -> None:
        """Queue reqs together on replica dp_rank (None: the one with the fewest outstanding tokens, the lowest on a
        tie): a parallel-sampling request's children stay on one replica (they share the prompt's KV blocks there)."""
        if taken := [r.request_id for r in reqs if r.request_id in self._owner]:
            raise InvalidRequestError(f"Request id {taken[0]!r} is already in use.")
        d = min(range(self.dp_size), key=lambda i: (self.outstanding[i], i)) if dp_rank is None else dp_rank
        for i, req in enumerate(reqs):  # siblings share the prompt's KV: it is computed once
            cost = (0 if i else len(req.prompt_token_ids)) + req.max_tokens
            self._owner[req.request_id] = (d, cost)
            self.outstanding[d] += cost
        self.requests_routed[d] += 1
        if d == 0:
            self.local.add_requests(reqs)
        else:
            self._check()
            self.replicas[d].add_requests(reqs)

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request was routed to (None once it finished or was aborted)."""
        owner = self._owner.get(request_id)
        return owner[0] if owner is not None else None

    def abort_requests(self, request_ids) -> None:
        remote: dict[int, list[str]] = {}
        for request_id in request_ids:
            d, _ = self._owner.get(request_id, (None, 0))
            if d == 0:
                self._finish(request_id)
                self.local.abort_requests([request_id])
            elif d is not None:  # outstanding until the replica says it freed it
                remote.setdefault(d, []).append(request_id)
        for d, ids in remote.items():
            if not self.dead:
                self.replicas[d].abort_requests(ids)

    def _finish(self, request_id: str) -> int | None:
        d, cost = self._owner.pop(request_id, (None, 0))
        if d is not None:
            self.outstanding[d] -= cost
        return d

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or self.local.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
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
            if isinstance(item, tuple):  # ("aborted", ids): the replica freed them
                for request_id in item[1]:
                    self._finish(request_id)
            elif item is not None:  # None: a death's wake-up
                outs += item
        self._check()
        for out in outs:
            if out.finished:
                self._finish(out.request_id)
        return outs

    # ----- load and statistics -----
    def stats(self) -> dict:
        """Summed over the replicas (KV usage: their mean), with each replica's own under "engines" (label
        engine=<dp rank>)."""
        engines = [self.local.stats()] + [dict(self.replicas[d].last_stats) for d in range(1, self.dp_size)]
        for d, e in enumerate(engines):
            e["requests"] = self.requests_routed[d]
        total = {k: sum(e[k] for e in engines) for k in ("running", "waiting", "preemptions", "kv_blocks_in_use")}
        loras = {k: sorted({n for e in engines for n in e.get(k, ())})  # adapter names: over every replica
                 for k in ("running_lora_adapters", "waiting_lora_adapters") if k in engines[0]}
        return {**total, **loras, "kv_usage": sum(e["kv_usage"] for e in engines) / len(engines), "engines": engines}

    def _call_all(self, method: str, *args) -> list:
        """core.<method>(*args) on every replica (a side thread answers it there, also while it waits for a round)."""
        return [getattr(self.local, method)(*args)] + [self.replicas[d].call(method, *args)
                                                       for d in range(1, self.dp_size)]

    def add_lora(self, request) -> str | None:
        return next((e for e in self._call_all("add_lora", request) if e is not None), None)

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._call_all("remove_lora", lora_int_id))

    def list_loras(self) -> list[int]:
        return self.local.list_loras()

    def expert_load(self) -> dict[int, list[int]]:
        """Every replica's tokens per expert, summed (each replica counts the tokens it scheduled)."""
        total: dict[int, list[int]] = {}
        for load in self._call_all("expert_load"):
            for layer, counts in load.items():
                total[layer] = [a + b for a, b in zip(total.get(layer, [0] * len(counts)), counts)]
        return total

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        return summarize(self.expert_load(), ep_size or expert_parallel_size(self.config))

    def reset_expert_load(self) -> None:
        self._call_all("reset_expert_load")

    def eplb_stats(self) -> dict:
        """Replica 0's: every EP rank of every replica takes part in each rearrangement (load summed over all)."""
        return self.local.eplb_stats()

    def save_expert_map(self, path: str) -> str:
        return self.local.save_expert_map(path)

    def spec_decode_stats(self) -> dict:
        return self.local.spec_decode_stats()

    def wait_for_kv_cache_pages(self) -> None:
        self.local.wait_for_kv_cache_pages()

    def shutdown(self) -> None:
        """Stop the other replicas (each shuts its engine and TP workers down), then replica 0. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for r in self.replicas.values():
            r.request_stop()
        local = self.local
        if local is not None and local.worker is not None and not self.dead:
            local.lockstep.stop_rounds()  # lockstep replicas wait in a round: this one tells them to stop
        for r in self.replicas.values():
            r.shutdown(timeout=30 if local is not None and not self.dead else 0)
        if local is not None:
            local.shutdown()
        if self.listener is not None:
            self.listener.close()
