"""Data-parallel replicas of other nodes register with the front end over the network (vLLM's
--data-parallel-address / --data-parallel-rpc-port): both sides of the registration.

Node 0's front end (engine/dp_core.py) listens at address:rpc_port (ReplicaListener). A `--headless` node's replica
process (engine/core_proc.py) connects (register), says which replica it is, and gets the front end's EngineConfig
back, so every replica builds the same engine whatever else its node's command line says. From then on the
connection carries CoreProcClient's messages (engine/core_client.py), as a local replica's does, plus a heartbeat
each way every second (launch.HEARTBEAT_S): a side silent for SILENCE_S (its node powered off, the network cut) is
dead even where no socket closes (a killed process's socket closes: that is seen at once).

  replica -> front end   ("hello", dp_rank, data_parallel_size, hostname)
  front end -> replica   ("config", EngineConfig) or ("refused", message)
"""
import logging
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from graphinfer import envs
from graphinfer.config import EngineConfig, ParallelConfig
from graphinfer.errors import GraphinferError

logger = logging.getLogger(__name__)

# A node whose heartbeats stop for this long is dead. Generous: a loaded host (page reclaim, a CPU shared by many
# processes) can stall a process for seconds, and a false death ends the whole server.
SILENCE_S = 30.0


def _authkey() -> bytes:
    return envs.GRAPHINFER_DP_AUTHKEY.encode()


def headless_command(pc: ParallelConfig, ranks: list[int]) -> str:
    """The flags that start replicas `ranks` (consecutive) on a node of their own."""
    return (f"graphinfer serve MODEL --headless --data-parallel-size {pc.data_parallel_size} "
            f"--data-parallel-size-local {len(ranks)} --data-parallel-start-rank {ranks[0]} "
            f"--data-parallel-address {pc.data_parallel_address} --data-parallel-rpc-port {pc.data_parallel_rpc_port}")


class ReplicaListener:
    """The front end's side: accepts the replicas of other nodes (those of [local size, data_parallel_size)), each
    once, and hands each its connection (wait_for)."""

    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.config, self.pc = config, pc
        self.expected = set(range(pc.data_parallel_size_local, pc.data_parallel_size))
        self.address = (pc.data_parallel_address, pc.data_parallel_rpc_port)
        try:  # a socket of its own (not a Listener): close() ends the accept loop, and the handshake of each
            # connection runs on a thread of its own, so a peer that says nothing holds up no other
            self._socket = socket.create_server(self.address)
            self._socket.settimeout(0.5)
        except OSError as e:
            raise GraphinferError(
                f"data parallel: cannot listen for the other nodes' replicas at {self.address[0]}:{self.address[1]} "
                f"({e}); give --data-parallel-address this node's address and a free --data-parallel-rpc-port."
            ) from None
        self._conns: dict[int, Connection] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept, name="graphinfer-dp-listener", daemon=True).start()
        logger.info("data parallel: waiting for replicas %s of other nodes at %s:%d", sorted(self.expected),
                    *self.address)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            sock.settimeout(None)
            threading.Thread(target=self._hello, args=(Connection(sock.detach()),), daemon=True).start()

    def _hello(self, conn: Connection) -> None:
        try:  # multiprocessing.connection.Listener.accept's handshake: both sides prove the authkey
            deliver_challenge(conn, _authkey())
            answer_challenge(conn, _authkey())
            if not conn.poll(SILENCE_S):
                raise EOFError("no hello")
            kind, d, dp, host = conn.recv()
            with self._cond:
                refusal = (f"data_parallel_size={dp} here, {self.pc.data_parallel_size} at the front end: give every "
                           f"node the same --data-parallel-size" if dp != self.pc.data_parallel_size else
                           f"replica {d} is already registered (two nodes with overlapping "
                           f"--data-parallel-start-rank / --data-parallel-size-local?)" if d in self._conns else
                           f"replica {d} is not one the front end waits for (replicas of other nodes: "
                           f"{sorted(self.expected)})" if d not in self.expected else None)
                if refusal is None:
                    conn.send(("config", self.config))
                    self._conns[d] = conn
                    self._cond.notify_all()
                    logger.info("data parallel: replica %d registered from %s", d, host)
                    return
            logger.error("data parallel: refused replica %s from %s: %s", d, host, refusal)
            conn.send(("refused", refusal))
        except (EOFError, OSError, ValueError, TypeError, AuthenticationError) as e:
            logger.warning("data parallel: refused a connection at %s:%d (%s: %s)", *self.address, type(e).__name__, e)
        conn.close()

    def wait_for(self, d: int, timeout: float) -> Connection | None:
        """Replica d's connection once it registered; None after `timeout` s or once closed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while d not in self._conns and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._conns.get(d)

    def missing(self) -> list[int]:
        with self._cond:
            return sorted(self.expected - set(self._conns))

    def missing_message(self) -> str:
        """Which replicas have not registered, and the command that starts them."""
        missing = self.missing()
        if not missing:
            return ""
        return (f"data-parallel replicas {missing} did not register at {self.address[0]}:{self.address[1]} within "
                f"{self.pc.distributed_timeout:g} s (--distributed-timeout); start them on their node(s), e.g. "
                f"`{headless_command(self.pc, missing)}`")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._socket.close()


def register(pc: ParallelConfig, d: int) -> tuple[Connection, EngineConfig]:
    """The replica's side: connect to the front end (retrying while node 0 starts, up to distributed_timeout), say
    which replica this is, and take the front end's engine config, made this replica's."""
    address = (pc.data_parallel_address, pc.data_parallel_rpc_port)
    deadline = time.monotonic() + pc.distributed_timeout
    while True:
        try:
            conn = Client(address, authkey=_authkey())
            break
        except (ConnectionError, EOFError) as e:  # refused: node 0 not listening yet; reset: it was closing
            if time.monotonic() > deadline:
                raise GraphinferError(
                    f"replica {d}: node 0's front end at {address[0]}:{address[1]} did not answer within "
                    f"{pc.distributed_timeout:g} s (--distributed-timeout) ({e}); start node 0 "
                    f"(`graphinfer serve MODEL --data-parallel-size {pc.data_parallel_size} "
                    f"--data-parallel-size-local L --data-parallel-address A --data-parallel-rpc-port {address[1]}`) "
                    f"and check the address and port.") from None
            time.sleep(0.5)
        except AuthenticationError as e:
            raise GraphinferError(f"replica {d}: the front end at {address[0]}:{address[1]} refused the connection "
                                  f"({e}): set the same GRAPHINFER_DP_AUTHKEY on every node.") from None
    conn.send(("hello", d, pc.data_parallel_size, socket.gethostname()))
    if not conn.poll(pc.distributed_timeout):
        raise GraphinferError(f"replica {d}: the front end at {address[0]}:{address[1]} did not answer its hello "
                              f"within {pc.distributed_timeout:g} s")
    kind, body = conn.recv()
    if kind == "refused":
        raise GraphinferError(f"replica {d}: the front end refused it: {body}")
    config: EngineConfig = body
    # the front end's settings, this node's place: replica d of the replicas this node runs
    fe = config.parallel_config
    config.parallel_config = ParallelConfig(**{
        **{f: getattr(fe, f) for f in fe.__dataclass_fields__},
        "data_parallel_rank": d, "data_parallel_start_rank": pc.data_parallel_start_rank,
        "data_parallel_size_local": pc.data_parallel_size_local, "headless": True})
    return conn, config
