"""What each step replays (worker/graph_dispatcher.py), decided from the step's shape alone: full decode / verify
graphs, the pieces, or eager."""
import numpy as np
import pytest

from graphinfer.config import EngineConfig, ModelConfig, SchedulerConfig
from graphinfer.errors import InvalidConfigError
from graphinfer.platforms import KernelBackend
from graphinfer.platforms.cpu import CpuPlatform
from graphinfer.runtime.worker.graph_dispatcher import EAGER, FULL, PIECEWISE, GraphDispatcher, resolve_graph_mode
from graphinfer.runtime.worker.inputs import HostInputs


class _Graphs:  # what dispatch reads of the captured DecodeGraphs / PiecewiseGraphs
    def __init__(self, sizes, query_len=1):
        self.sizes, self.query_len = sizes, query_len

    @property
    def max_size(self):
        return self.sizes[-1]

    def bucket(self, n):
        return next((s for s in self.sizes if s >= n), None)


def _step(query_lens, decode_graphs=True) -> HostInputs:
    t = sum(query_lens)
    z = np.zeros(t, dtype=np.int64)
    return HostInputs(z, z, z, np.zeros((len(query_lens), 1), dtype=np.int32),
                      np.cumsum([0, *query_lens]).astype(np.int32), np.ones(len(query_lens), dtype=np.int32),
                      z[:len(query_lens)], [], [], [], decode_graphs=decode_graphs)


@pytest.fixture
def dispatcher():
    config = EngineConfig(ModelConfig("tiny-llama"), scheduler_config=SchedulerConfig(max_num_seqs=8))
    d = GraphDispatcher(config, CpuPlatform(), "FULL_AND_PIECEWISE", [1, 2, 4, 8, 16], num_speculative_tokens=2)
    d.decode_graphs, d.verify_graphs = _Graphs([1, 2, 4, 8]), _Graphs([1, 2, 4, 8], query_len=3)
    d.piecewise_graphs = _Graphs([1, 2, 4, 8, 16])
    return d


def test_dispatch_per_batch_shape(dispatcher):
    d = dispatcher
    assert d.decode_sizes == [1, 2, 4, 8] and d.max_graph_tokens == 16  # decode sizes: at most max_num_seqs rows
    full = d.dispatch(_step([1] * 5))
    assert full.kind == FULL and full.graphs is d.decode_graphs  # a uniform decode batch: the decode graph of 8
    assert d.dispatch(_step([3, 3])).graphs is d.verify_graphs  # uniform 1 + k tokens: a verify graph
    assert d.dispatch(_step([3, 2, 1])).kind == PIECEWISE  # verify rows of unequal length: not uniform
    assert d.dispatch(_step([5, 1])).kind == PIECEWISE  # a prefill chunk with a decode
    assert d.dispatch(_step([1] * 12)).kind == PIECEWISE  # more rows than the largest decode graph
    assert d.dispatch(_step([1] * 2, decode_graphs=False)).kind == PIECEWISE  # data-parallel replicas agreed so
    assert d.dispatch(_step([20])).kind == EAGER  # past the largest piece size
    d.piecewise_graphs = None
    assert d.dispatch(_step([5, 1])).kind == EAGER


def test_graph_mode_resolution():
    config = EngineConfig(ModelConfig("tiny-llama"))
    cpu = CpuPlatform()
    assert cpu.graph_modes("eager") == ("NONE", "FULL_DECODE_ONLY")  # the C++ library is built under make test
    assert cpu.graph_modes("reference") == cpu.graph_modes("inductor") == ("NONE",)
    assert cpu.default_capture_sizes(512) == [1, 2, 4, 8] and cpu.default_capture_sizes(2) == [1, 2]
    eager = KernelBackend("eager", default_graph_mode=cpu.default_graph_mode("eager"),
                          graph_modes=cpu.graph_modes("eager"))
    assert resolve_graph_mode(config, cpu, eager) == "FULL_DECODE_ONLY"  # the backend's default
    config.compile_config.graph_mode = "PIECEWISE"
    with pytest.raises(InvalidConfigError, match="runs NONE / FULL_DECODE_ONLY"):  # cpu traces decode graphs only
        resolve_graph_mode(config, cpu, eager)
