"""A CPU stand-in for device graphs (test scaffolding, not a graphinfer platform): `OpTapeGraph` records every
aten / graphinfer op issued while capturing and replays the tape on the same tensors, which is what a CUDA
graph does with kernels. Its own module so tensor-parallel worker processes can import OpTapePlatform (rank 0
hands its platform class to them)."""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphinfer.platforms.cpu import CpuPlatform
from graphinfer.platforms.interface import Platform


class OpTapeGraph:
    """Records ops during capture; replay re-runs them writing into the tensors they produced then."""

    def __init__(self):
        self.tape = []

    def replay(self):
        for func, args, kwargs, out in self.tape:
            result = func(*args, **kwargs)
            if out is None:
                continue
            for dst, src in zip(out if isinstance(out, (tuple, list)) else [out], result if isinstance(result, (tuple, list)) else [result]):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: OpTapeGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        fresh = not _aliases_an_input(out, args, kwargs)  # views see what replay refreshes in place
        if mutates or fresh:  # an op that writes an input and returns a new tensor (qk_norm_rope_cache) needs both
            self.graph.tape.append((func, args, kwargs, out if fresh else None))
        return out


def _storages(x) -> set[int]:
    items = x if isinstance(x, (tuple, list)) else [x]
    return {t.untyped_storage().data_ptr() for t in items if isinstance(t, torch.Tensor)}


def _aliases_an_input(out, args, kwargs) -> bool:
    """By storage, not schema: to / reshape / contiguous declare "may alias" but often copy."""
    inputs = set().union(*(_storages(a) for a in [*args, *kwargs.values()]))
    outs = _storages(out)
    return bool(outs) and outs <= inputs


class OpTapePlatform(CpuPlatform):
    """The cpu platform plus the OpTapeGraph stand-in for device graphs (tests only)."""
    supports_graph_capture = True
    # a device platform's graph modes, sizes and capture, not the cpu platform's traced decode graphs
    graph_modes, default_graph_mode = Platform.graph_modes, Platform.default_graph_mode
    default_capture_sizes, capture_graph = Platform.default_capture_sizes, Platform.capture_graph

    def graph_class(self):
        return OpTapeGraph

    def graph_pool_handle(self):
        return None

    def new_stream(self):
        return None

    @contextlib.contextmanager
    def graph_capture(self, graph, pool, stream):
        with _Recorder(graph):
            yield
