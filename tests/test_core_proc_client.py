"""The engine core in a process of its own (`graphinfer serve`): a core that has not built its engine within
GRAPHINFER_ENGINE_READY_TIMEOUT_S ends the front end's wait with an error naming the variable, and its process goes."""
import pytest

from graphinfer.engine_args import create_engine_config
from graphinfer.errors import GraphinferError
from graphinfer.platforms.cpu import CpuPlatform
from graphinfer.runtime.engine.core_client import CoreProcClient


def test_a_core_slower_than_the_ready_timeout_ends_the_wait(monkeypatch):
    monkeypatch.setenv("GRAPHINFER_ENGINE_READY_TIMEOUT_S", "0.05")  # the child's start alone (torch import) is longer
    client = CoreProcClient(create_engine_config({"model": "tiny-llama", "device": "cpu"}), CpuPlatform,
                            "the engine core")
    try:
        with pytest.raises(GraphinferError, match="GRAPHINFER_ENGINE_READY_TIMEOUT_S"):
            client.wait_ready()
        with pytest.raises(GraphinferError, match="did not build its engine"):
            client.check()
    finally:
        client.shutdown(timeout=0)
    assert client.proc.process.poll() is not None
