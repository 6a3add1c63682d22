"""Tensor-parallel process groups over torch.distributed (vLLM's parallel_state, reduced to one TP group).

Rank r of N holds 1/N of every sharded layer. Each rank has two groups:
- the device group "tp" on the platform's backend (gloo on cpu, nccl on cuda, hccl on npu): the
  graphinfer:: collectives (communication_op.py) run on it, looked up by name, so a traced graph and an
  artifact's graph.py name their group as a plain string;
- a gloo group for the host-side messages rank 0 sends each step (runtime/step_channel.py), with a
  timeout long enough for an idle server: a dead peer still ends a wait at once (its sockets close).

The layout (rank, size) is what the parallel layers shard by. `layout(rank, size)` sets one without any
process group, to build and look at one rank's model or graph (`graphinfer passes show --tp 2`).

Expert parallel (enable_expert_parallel): the MoE layers partition whole experts over the EP group instead of
splitting each expert's intermediate dimension; the EP group is every rank of every replica (ep_size() = tp x dp).

Data parallel (data_parallel_size dp): dp replicas of tp ranks each, global rank = dp_rank * tp + tp_rank, one
torch.distributed world. Each replica has its own "tp" device group and gloo step-channel group; the replicas'
TP rank 0s (leaders) share a gloo "dp" group, where the lockstep of MoE + EP replicas is agreed each step
(runtime/dp_lockstep.py). At dp 1 the TP group is the world, as before.
Pipeline parallel (pipeline_parallel_size pp): a replica is pp stages of tp ranks, global rank = dp_rank * pp * tp +
pp_rank * tp + tp_rank (vLLM's layout). Each stage has its own "tp" device group; the ranks of one TP rank across the
stages share a "pp" device group, where graphinfer::send / recv (communication_op.py) move the hidden state from a
stage to the next, and the last stage's final hidden rows back to the first (worker/model_runner.py). The gloo
step-channel group spans the whole replica.
On Ascend a second device group of the EP ranks, MC2_GROUP, is kept for the MC2 dispatch / combine ops alone
(vllm-ascend's get_mc2_group): their HCCL communicator may carry no other op.
"""
import contextlib
import datetime
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from graphinfer.errors import GraphinferError

logger = logging.getLogger(__name__)

TP_GROUP = "tp"
PP_GROUP = "pp"  # one TP rank's ranks across the pipeline stages (point to point)
EP_GROUP = "ep"  # every rank of every replica (the world)
MC2_GROUP = "mc2"  # the EP ranks again, for Ascend's MC2 ops only (init_distributed(mc2_group=True))
_IDLE_TIMEOUT = datetime.timedelta(days=30)  # the step channel waits as long as a server may stay idle


class DistributedError(GraphinferError, RuntimeError):
    """The rendezvous or a collective failed or timed out: a peer rank died, stalled, or never started."""


@dataclass
class _State:
    rank: int = 0  # global: dp_rank * pp * tp + pp_rank * tp + tp_rank
    world_size: int = 1  # tp x pp x dp
    tp: int = 1
    pp: int = 1
    pp_layer_partition: str | None = None  # layers per stage ("a,b,..."), None: an even split
    ranks_per_node: int = 1
    node_first_rank: int = 0  # the global rank of this node's first rank
    groups: dict = field(default_factory=dict)  # name -> device ProcessGroup
    cpu_group: object = None  # this replica's gloo group (step channel)
    dp_group: object = None  # the replicas' leaders, gloo (lockstep); None at dp 1
    timeout_s: float = 0.0
    phase: str = "start-up"  # what this rank is doing, for error messages
    comm_seconds: float = 0.0  # host time inside collective calls (bench: the time spent in collectives)
    comm_calls: int = 0
    pipeline_wait_s: float = 0.0  # host time waiting in pipeline receives (a stage idle for the previous one)
    expert_parallel: bool = False  # enable_expert_parallel: MoE experts partitioned over the EP group


_state = _State()
_pending_sends: list = []  # pipeline parallel: (work, tensor, what, stage) of isends in flight (see isend)


def tp_rank() -> int:
    return _state.rank % _state.tp


def tp_size() -> int:
    return _state.tp


def pp_size() -> int:
    return _state.pp


def pp_rank() -> int:
    """This rank's pipeline stage."""
    return _state.rank // _state.tp % _state.pp


def pp_layer_partition() -> str | None:
    return _state.pp_layer_partition


def replica_size() -> int:
    return _state.tp * _state.pp


def replica_rank() -> int:
    """This rank within its replica: pp_rank * tp + tp_rank (an artifact's weight file index)."""
    return _state.rank % replica_size()


def dp_size() -> int:
    return _state.world_size // replica_size()


def dp_rank() -> int:
    return _state.rank // replica_size()


def leader_rank() -> int:
    """The global rank of this replica's first rank (first stage, TP rank 0), which sends the steps."""
    return dp_rank() * replica_size()


def stage_rank(stage: int) -> int:
    """The global rank of this rank's TP rank in pipeline stage `stage` (its partner there)."""
    return _state.rank + (stage - pp_rank()) * _state.tp


def describe_rank() -> str:
    """"rank r of N" (and its pipeline stage), for error messages."""
    stage = f" (pipeline stage {pp_rank()} of {_state.pp})" if _state.pp > 1 else ""
    return f"rank {_state.rank} of {_state.world_size}{stage}"


def ep_size() -> int:
    """Ranks the MoE experts are partitioned over: tp x dp with expert parallel on, else 1 (experts TP-split)."""
    return _state.world_size if _state.expert_parallel else 1


def ep_rank() -> int:
    return _state.rank if _state.expert_parallel else 0


def local_rank() -> int:
    """This rank's index on its node (its device's)."""
    return _state.rank - _state.node_first_rank


def ranks_per_node() -> int:
    return _state.ranks_per_node


def is_initialized() -> bool:
    """Whether this process is a rank of a running TP group (not just a layout)."""
    return bool(_state.groups)


@contextlib.contextmanager
def layout(rank: int, size: int, expert_parallel: bool = False, pp: int = 1, pp_layer_partition: str | None = None):
    """Shard as rank `rank` of `size` (tp = size / pp ranks per stage) while building a model, without process groups
    (nothing can run)."""
    global _state
    saved, _state = _state, _State(rank=rank, world_size=size, tp=size // pp, pp=pp,
                                   pp_layer_partition=pp_layer_partition, expert_parallel=expert_parallel)
    try:
        yield
    finally:
        _state = saved


def init_distributed(rank: int, world_size: int, ranks_per_node: int, backend: str, master_addr: str,
                     master_port: int, timeout_s: float, publish: dict[str, bytes] | None = None,
                     expert_parallel: bool = False, tp: int | None = None, mc2_group: bool = False, pp: int = 1,
                     pp_layer_partition: str | None = None, node_first_rank: int | None = None) -> None:
    """Join the world as global rank `rank` (replicas of pp stages of `tp` ranks; tp None: one replica, one stage):
    rendezvous at master_addr:master_port (rank 0 hosts the store, torchrun-style, and first puts `publish` in it:
    what the other nodes wait for), then the device groups on `backend` and the gloo step-channel (and lockstep)
    groups; with expert_parallel and mc2_group, also the MC2 group. node_first_rank: the global rank of this node's
    first rank (None: nodes of ranks_per_node ranks each)."""
    tp = tp or world_size // pp
    replica = tp * pp
    timeout = datetime.timedelta(seconds=timeout_s)
    _state.phase = "rendezvous"
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
        for key, value in (publish or {}).items():
            store.set(key, value)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        groups, cpu_group, dp_group = {TP_GROUP: dist.group.WORLD, EP_GROUP: dist.group.WORLD}, None, None
        if replica == world_size:
            cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        # every rank creates every group, in the same order (torch.distributed's rule); keeps its own
        if tp < world_size:
            for first in range(0, world_size, tp):  # one per (replica, stage)
                ranks = list(range(first, first + tp))
                device_group = dist.new_group(ranks)
                if rank in ranks:
                    groups[TP_GROUP] = device_group
        if pp > 1:
            for chain in (list(range(first + t, first + replica, tp)) for first in range(0, world_size, replica)
                          for t in range(tp)):
                device_group = dist.new_group(chain)
                if rank in chain:
                    groups[PP_GROUP] = device_group
        if replica < world_size:
            for first in range(0, world_size, replica):
                ranks = list(range(first, first + replica))
                gloo = dist.new_group(ranks, backend="gloo", timeout=_IDLE_TIMEOUT)
                if rank in ranks:
                    cpu_group = gloo
            dp_group = dist.new_group(list(range(0, world_size, replica)), backend="gloo", timeout=_IDLE_TIMEOUT)
            if rank % replica == 0:
                groups["dp"] = dp_group
        if expert_parallel and mc2_group:
            groups[MC2_GROUP] = dist.new_group(backend=backend, timeout=timeout)
    except (RuntimeError, DistributedError) as e:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        if not dist.is_initialized():
            # torch names the default group after a counter that a failed init_process_group leaves advanced: this
            # process's next rendezvous (LLM() again) would wait under another name than its fresh peers', forever
            dist.distributed_c10d._world.group_count = 0
        raise DistributedError(
            f"rank {rank} of {world_size} (node {socket.gethostname()}): the rendezvous at {master_addr}:{master_port} "
            f"failed within {timeout_s:g} s (--distributed-timeout) ({e}). Check that every node runs (tensor "
            f"parallel: the same command with its own --node-rank; data parallel: `--headless "
            f"--data-parallel-start-rank R` on the other nodes), that --master-addr / --master-port (data parallel: "
            f"--data-parallel-address, the RPC port + 1) name node 0 and are reachable from here, and that no other "
            f"job uses the port.") from None
    _state.rank, _state.world_size, _state.tp, _state.ranks_per_node = rank, world_size, tp, ranks_per_node
    _state.pp, _state.pp_layer_partition = pp, pp_layer_partition
    _state.node_first_rank = rank - rank % ranks_per_node if node_first_rank is None else node_first_rank
    _state.groups = groups
    _state.cpu_group, _state.dp_group, _state.timeout_s = cpu_group, dp_group, timeout_s
    _state.expert_parallel = expert_parallel
    _state.phase = "start-up"
    logger.info("rank %d of %d joined (tp %d, pp %d, %s, rendezvous %s:%d)", rank, world_size, tp, pp, backend,
                master_addr, master_port)


def fetch(master_addr: str, master_port: int, key: str, timeout_s: float) -> bytes:
    """What rank 0 published under `key` (blocks until it has, up to timeout_s)."""
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store.get(key)
    except RuntimeError as e:
        raise DistributedError(f"could not reach node 0 at {master_addr}:{master_port} within {timeout_s:g} s ({e}); "
                               f"start node 0 (--node-rank 0) and check --master-addr / --master-port.") from None


def destroy() -> None:
    """Leave the TP group (engine shutdown); a no-op when not in one."""
    global _state
    _pending_sends.clear()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer may be gone already
            dist.destroy_process_group()
    _state = _State()


def abort() -> None:
    """Unblock collectives that wait for a dead peer (best effort, from another thread)."""
    abort_pg = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort_pg is not None and dist.is_initialized():
        with contextlib.suppress(Exception):
            abort_pg()


def get_group(name: str):
    group = _state.groups.get(name)
    if group is None:
        raise DistributedError(f"graphinfer collective on group {name!r}, but this process is not a rank of a "
                               f"tensor-parallel group (tensor_parallel_size={_state.world_size}).")
    return group


def group_rank(name: str) -> int:
    """This process's rank in the group `name`."""
    return dist.get_rank(get_group(name))


def cpu_group():
    return _state.cpu_group


@contextlib.contextmanager
def phase(name: str):
    """Label what this rank is doing (a start-up phase, a step), for the message of a collective that fails."""
    saved, _state.phase = _state.phase, name
    try:
        yield
    finally:
        _state.phase = saved


def set_phase(name: str) -> None:
    _state.phase = name


def collective(what: str, group_name: str, run: Callable[[object], None]) -> None:
    """run(group) timed into the communication counters; a failure becomes a DistributedError naming this rank,
    the collective and the phase it waited in."""
    group = get_group(group_name)
    start = time.perf_counter()
    try:
        run(group)
    except RuntimeError as e:
        raise DistributedError(
            f"{describe_rank()}: {what} on group {group_name!r} failed during {_state.phase} on node "
            f"{socket.gethostname()}: {e}. Another rank died or stalled (timeout {_state.timeout_s:g} s); its log "
            f"says why.") from None
    finally:
        _state.comm_seconds += time.perf_counter() - start
        _state.comm_calls += 1


def comm_counters() -> tuple[float, int]:
    """(seconds, calls) spent in collective calls by this process so far (host time: on GPUs the launch)."""
    return _state.comm_seconds, _state.comm_calls


def min_across_ranks(value: int) -> int:
    """The smallest of every rank's value over the replica, every pipeline stage included (e.g. KV blocks, so every
    rank's cache has the same block count)."""
    if not is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    collective("all_reduce(min)", TP_GROUP, lambda _: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.cpu_group))
    return int(t.item())


def all_gather_object(obj) -> list:
    """Every rank's obj (picklable), in rank order (of the replica: every stage's ranks), on every rank of this replica (host side, the gloo group);
    [obj] outside a group."""
    if not is_initialized():
        return [obj]
    out = [None] * replica_size()
    collective("all_gather_object", TP_GROUP, lambda _: dist.all_gather_object(out, obj, group=_state.cpu_group))
    return out


def broadcast_from_rank0(t: torch.Tensor) -> None:
    """t <- TP rank 0's t, on this replica's device group (in place)."""
    collective("broadcast", TP_GROUP, lambda group: dist.broadcast(t, src=leader_rank(), group=group))


def dp_all_reduce_max(values: list[int], bounded: bool = False) -> list[int]:
    """The element-wise max of every replica leader's values (the "dp" gloo group; leaders only). bounded: fail after
    the distributed timeout (the group itself waits as long as a server may stay idle: the replica that drives the
    rounds bounds its own wait, the others wait for its next round)."""
    t = torch.tensor(values, dtype=torch.int64)

    def run(_):
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_state.dp_group, async_op=True)
        work.wait(datetime.timedelta(seconds=_state.timeout_s)) if bounded else work.wait()

    collective("all_reduce(max) across data-parallel ranks", "dp", run)
    return t.tolist()


# ----- pipeline parallel: point to point between stages -----
_p2p_local = False  # pipeline_local(): sends go nowhere, receives are made up (a stage's graph run on its own)


@contextlib.contextmanager
def pipeline_local():
    """Run a stage's graph on its own (the passes' numeric checks, warm-up, profiling): graphinfer::send sends
    nothing and graphinfer::recv returns seeded random values, the same for every call of one shape."""
    global _p2p_local
    saved, _p2p_local = _p2p_local, True
    try:
        yield
    finally:
        _p2p_local = saved


def p2p_local() -> bool:
    return _p2p_local or not is_initialized()


def isend(t: torch.Tensor, dst_stage: int, what: str, group_name: str = PP_GROUP) -> None:
    """Send t to this rank's partner in stage dst_stage without waiting (gloo's send waits for the matching receive,
    which would stall a stage behind the next one's work): the send completes in the background from a copy of t
    (a replayed graph rewrites its buffers in place meanwhile), kept alive until it has; a failed one is raised by a
    later isend."""
    _reap_sends()
    t = t.clone(memory_format=torch.contiguous_format)
    work = None

    def run(group):
        nonlocal work
        work = dist.isend(t, stage_rank(dst_stage), group=group)

    collective(f"send of {what} to pipeline stage {dst_stage}", group_name, run)
    _pending_sends.append((work, t, what, dst_stage))


def recv(shape: tuple, dtype: torch.dtype, device, src_stage: int, what: str,
         group_name: str = PP_GROUP) -> torch.Tensor:
    """Receive a tensor of shape / dtype from this rank's partner in stage src_stage, waiting at most the distributed
    timeout (a DistributedError names this rank, its stage and the step it waited in)."""
    out = torch.empty(shape, dtype=dtype, device=device)

    def run(group):
        start = time.perf_counter()
        try:
            work = dist.irecv(out, stage_rank(src_stage), group=group)
            _wait(work, f"{what} from pipeline stage {src_stage}")
        finally:
            _state.pipeline_wait_s += time.perf_counter() - start

    collective(f"receive of {what} from pipeline stage {src_stage}", group_name, run)
    return out


def pipeline_wait_seconds() -> float:
    return _state.pipeline_wait_s


def _wait(work, what: str) -> None:
    if not work.wait(datetime.timedelta(seconds=_state.timeout_s)):
        raise RuntimeError(f"no {what} within the distributed timeout ({_state.timeout_s:g} s)")


def _reap_sends() -> None:
    while _pending_sends and _pending_sends[0][0].is_completed():
        work, _, what, stage = _pending_sends.pop(0)
        collective(f"send of {what} to pipeline stage {stage}", PP_GROUP, lambda _: work.wait())
