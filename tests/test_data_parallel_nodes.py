"""Data parallel across nodes with vLLM's flags (issue 53 items 3, 4), on CPU: two "nodes" are two process trees on
127.0.0.1. Node 0 runs `graphinfer serve M -dp 2 --data-parallel-size-local 1 --data-parallel-address A
--data-parallel-rpc-port P` (API server, front end, replica 0); node 1 runs the same with `--headless
--data-parallel-start-rank 1` (replica 1, registered over the network). The official openai client gets a single
engine's greedy tokens from both replicas; killing one node's process tree ends the other (non-zero), no hang.
The flag checks are unit tests.
"""
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from server_utils import GRAPHINFER, Server, free_port, metric, metric_samples

from graphinfer import LLM, SamplingParams
from graphinfer.config import EngineConfig, ParallelConfig
from graphinfer.errors import GraphinferError, InvalidConfigError
from graphinfer.runtime.engine.core_client import RemoteCoreClient
from graphinfer.runtime.engine.replica_listener import ReplicaListener, register

ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "256"]
PROMPTS = [[5, 9, 2, 7, 7], [11, 3, 3, 8], [100, 101, 102, 103, 104, 105], [42] * 9]
MAX_TOKENS = 12


@pytest.mark.parametrize("kwargs, match", [
    (dict(data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1, headless=True),
     "past the last replica"),
    (dict(data_parallel_size=2, data_parallel_size_local=1, headless=True), "replica 0 runs in node 0's front end"),
    (dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1), "add --headless"),
    (dict(data_parallel_size=2, data_parallel_size_local=0), "at least one replica"),
    (dict(data_parallel_size=2, data_parallel_size_local=3), r"must be in \[1, data_parallel_size=2\]"),
    (dict(data_parallel_size=2, data_parallel_size_local=1, nnodes=2, tensor_parallel_size=2), "do not combine"),
    (dict(distributed_timeout=0), "distributed_timeout=0"),
])
def test_inconsistent_data_parallel_flags_are_refused(kwargs, match):
    with pytest.raises(InvalidConfigError, match=match):
        ParallelConfig(**kwargs)


def test_data_parallel_node_layout():
    node0 = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, data_parallel_size_local=1,
                           data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345)
    # the rendezvous is at node 0's address, next to the replicas' port; this node has replica 0's two ranks
    assert (node0.master_addr, node0.master_port, node0.ranks_per_node, node0.node_first_rank) == \
        ("10.0.0.1", 13346, 2, 0)
    node1 = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, data_parallel_size_local=3,
                           data_parallel_start_rank=1, headless=True, data_parallel_address="10.0.0.1")
    assert (node1.master_port, node1.ranks_per_node, node1.node_first_rank) == (29551, 6, 2)
    assert list(node1.local_data_parallel_ranks()) == [1, 2, 3]
    assert ParallelConfig(data_parallel_size=2).master_port is None  # one node: a free port, as before
    with pytest.raises(InvalidConfigError, match="--headless"):
        LLM("tiny-qwen3", device="cpu", data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1,
            headless=True)


def test_start_up_waits_for_the_other_nodes_a_bounded_time_and_names_the_missing_replicas():
    rpc = free_port()
    with pytest.raises(GraphinferError, match=rf"data-parallel replicas \[1, 2\] did not register at 127.0.0.1:{rpc} "
                                              rf"within 2 s \(--distributed-timeout\).*--headless "
                                              rf"--data-parallel-size 3 --data-parallel-size-local 2 "
                                              rf"--data-parallel-start-rank 1"):
        LLM("tiny-qwen3", device="cpu", dtype="float32", max_model_len=128, data_parallel_size=3,
            data_parallel_size_local=1, data_parallel_rpc_port=rpc, distributed_timeout=2)
    # and a headless node's replica without node 0: its wait is bounded too
    pc = ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=1, headless=True,
                        data_parallel_rpc_port=rpc, distributed_timeout=1)
    with pytest.raises(GraphinferError, match=rf"replica 1: node 0's front end at 127.0.0.1:{rpc} did not answer "
                                              rf"within 1 s"):
        register(pc, 1)


def test_registration_heartbeats_and_refusals():
    """The front end's side (ReplicaListener + RemoteCoreClient) against register(), without engines: the replica
    gets node 0's settings as its own, heartbeats flow, a second node claiming the same replica or another
    data_parallel_size is refused, and a replica's closed connection is its death."""
    rpc = free_port()
    config = EngineConfig.from_kwargs(model="tiny-qwen3", device="cpu", data_parallel_size=3,
                                      data_parallel_size_local=1, data_parallel_rpc_port=rpc, max_num_seqs=7)
    listener = ReplicaListener(config)
    client = RemoteCoreClient(listener, 1, "data-parallel replica 1 (another node)")
    deaths = []
    client.on_death(deaths.append)
    node1 = ParallelConfig(data_parallel_size=3, data_parallel_size_local=2, data_parallel_start_rank=1, headless=True,
                           data_parallel_rpc_port=rpc)
    try:
        conn, got = register(node1, 1)
        pc = got.parallel_config
        assert got.scheduler_config.max_num_seqs == 7 and (pc.data_parallel_rank, pc.node_first_rank) == (1, 1)
        assert conn.poll(10) and conn.recv() == ("alive",)  # the front end's heartbeat
        with pytest.raises(GraphinferError, match="replica 1 is already registered"):
            register(node1, 1)
        with pytest.raises(GraphinferError, match="give every node the same --data-parallel-size"):
            register(ParallelConfig(data_parallel_size=4, data_parallel_size_local=1, data_parallel_start_rank=2,
                                    headless=True, data_parallel_rpc_port=rpc), 2)
        assert listener.missing() == [2]
        conn.close()  # replica 1's node dies
        deadline = time.monotonic() + 30
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert deaths == ["data-parallel replica 1 (another node) went away"]
    finally:
        client.shutdown(0)
        listener.close()


def _reference(model: str) -> list[list[int]]:
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(pid: int) -> None:
    for p in _tree(pid):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


class TwoNodes:
    """Node 0 (`serve`, the Server helper) and node 1 (`serve --headless`) of `model`, -dp 2, one replica each."""

    def __init__(self, model: str, extra: list[str], log_dir):
        rpc = free_port()
        dp = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc), "--distributed-timeout", "120", *extra]
        self.node0 = Server([model, *ENGINE, *dp], log_dir / "node0.log")
        self.node1_log = open(log_dir / "node1.log", "w+")
        self.node1_cmd = [GRAPHINFER, "serve", model, *ENGINE, *dp, "--headless", "--data-parallel-start-rank", "1"]
        self.node1: subprocess.Popen | None = None

    def __enter__(self) -> "TwoNodes":
        self.node1 = subprocess.Popen(self.node1_cmd, stdout=self.node1_log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)  # first: it waits for node 0 to listen
        self.node0.launch()  # wait_ready() once the test computed its reference meanwhile
        return self

    def node1_text(self) -> str:
        self.node1_log.seek(0)
        return self.node1_log.read()

    def __exit__(self, *exc) -> None:
        self.node0.stop()
        _kill_tree(self.node1.pid)
        self.node1.wait(10)
        self.node1_log.close()


def _serve_and_compare(nodes: TwoNodes, model: str, reference: list[list[int]]) -> None:
    """Every prompt at once through the openai client: a single engine's tokens, requests on both replicas."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{nodes.node0.url}/v1", api_key="none", max_retries=0)
    got: list = [None] * len(PROMPTS)

    def ask(i):
        out = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        got[i] = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == reference
    samples = metric_samples(httpx.get(f"{nodes.node0.url}/metrics").text)
    routed = [metric(samples, "graphinfer:engine_requests_routed", engine=str(d)) for d in range(2)]
    assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed  # both replicas took requests


def _ends_within(proc, seconds: float) -> int:
    """proc's exit status; fails (instead of hanging) if it runs on after `seconds`."""
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds} s after the other node died: a hang")


def test_dense_two_nodes_serve_and_end_when_the_headless_node_dies(tmp_path):
    with TwoNodes("tiny-qwen3", [], tmp_path) as nodes:
        reference = _reference("tiny-qwen3")  # while the nodes start
        nodes.node0.wait_ready(240)
        _serve_and_compare(nodes, "tiny-qwen3", reference)
        assert "replica 1 registered" in nodes.node0.log()
        _kill_tree(nodes.node1.pid)  # the whole node: its main process and its replica's engine core
        try:  # a request meanwhile: 503 while the server goes (or refused once it is gone), never a hang
            status = httpx.post(f"{nodes.node0.url}/v1/completions", timeout=60,
                                json={"model": "tiny-qwen3", "prompt": [1, 2], "max_tokens": 4}).status_code
            assert status in (200, 503)  # 200: answered by replica 0 before the death was seen
        except httpx.TransportError:
            pass
        assert _ends_within(nodes.node0.proc, 60) != 0
        assert "data-parallel replica 1 (another node)" in nodes.node0.log()


@pytest.mark.slow
@pytest.mark.parametrize("end", ["kill node 0", "stop node 0"])
def test_moe_expert_parallel_over_two_nodes_and_the_headless_node_ends_with_node_0(end, tmp_path):
    with TwoNodes("tiny-qwen3-moe", ["--enable-expert-parallel"], tmp_path) as nodes:
        reference = _reference("tiny-qwen3-moe")  # while the nodes start
        nodes.node0.wait_ready(240)
        _serve_and_compare(nodes, "tiny-qwen3-moe", reference)  # EP 2: every MoE layer exchanges tokens over both
        assert "rank 1 of 2 joined" in nodes.node1_text()
        node1_tree = _tree(nodes.node1.pid)
        if end == "kill node 0":  # front end, replica 0 and the rendezvous store go at once
            _kill_tree(nodes.node0.proc.pid)
            assert _ends_within(nodes.node1, 60) != 0
        else:  # SIGTERM: node 0 drains, ends the lockstep rounds, stops replica 1; both exit 0
            assert nodes.node0.stop(60) == 0
            assert _ends_within(nodes.node1, 60) == 0, nodes.node1_text()[-3000:]
        deadline = time.monotonic() + 10
        while (left := [p for p in node1_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, left  # no orphans on node 1
