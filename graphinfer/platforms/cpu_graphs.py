"""The cpu platform's decode graphs: the decode forward recorded once per batch-size bucket by torch.jit.trace, as a
device graph records kernels, and replayed by TorchScript's interpreter with no Python in between.

At batch 1 a SmolLM2 decode step is ~300 C++ op calls, each through its Python wrapper (shape and dtype checks),
plus the fx forward's ~35 Python statements a layer: without them the GGUF step went from 21.6 to 14.8 ms on the
2-vCPU AVX2 VM (`graphinfer bench latency --graph-modes NONE,FULL_DECODE_ONLY`, docs/benchmarks.md). The
traced graph calls the same C++ ops with the same arguments (the wrappers' choices, which depend on shapes alone, fixed
for the bucket), so results are bit for bit those of the eager forward.

- A trace keeps whatever Python decided at trace time. Shapes are fixed per bucket; values are not: a wrapper that
  reads a tensor's value on the host (a PyTorch fallback's `int(slots.min())`, LoRA's segment index) would replay that
  decision forever. So the function first runs once under a guard that refuses any host read of a tensor's value
  (item / tolist / numpy / bool / int / float / index) outside the ops themselves (an op the graph still calls through
  the dispatcher runs again, with the step's values, at every replay): such a graph is not captured
  (GraphCaptureError) and its steps run eagerly.
- The weights and KV caches are constants of the trace (the same tensors: in-place updates reach it), the step's
  inputs and output its arguments. TorchScript's optimizing executor would fold ops whose inputs are all constants
  (a dequantized weight: stale after an in-place update, and a copy's memory), so replay runs unoptimized: the
  recorded ops as they are, which is all a decode graph wants.
"""
import warnings
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from graphinfer.errors import GraphCaptureError

_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class _HostReadGuard(TorchFunctionMode):
    """Raises GraphCaptureError at a host read of a tensor's value; the ops' own insides are not seen (a mode is
    off inside its handler), so the reference impl of an op left to the dispatcher may read what it likes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise GraphCaptureError(f"the decode forward reads a tensor's value on the host ({func.__name__}); a "
                                    f"trace would replay the value it read at capture")
        return func(*args, **(kwargs or {}))


def _fold_shapes(graph: torch._C.Graph) -> None:
    """The trace's shape bookkeeping made constants: the tracer records each `x.shape[i]` a wrapper read as
    aten::size -> prim::NumToTensor -> aten::Int and each shape list as a prim::ListConstruct, all re-run at every
    replay (~350 of the 2,363 nodes of SmolLM2's batch-1 graph), though a bucket's shapes are fixed: sizes
    come from the traced types, Int(NumToTensor(v)) is v, and lists of constants are constants. Other arithmetic on
    sizes is left as it is."""
    for node in list(graph.nodes()):
        kind, ins = node.kind(), list(node.inputs())
        if kind == "aten::size" and len(ins) == 2 and isinstance(ins[0].type(), torch._C.TensorType):
            sizes, dim = ins[0].type().sizes(), ins[1].toIValue()
            if sizes is None or not isinstance(dim, int) or sizes[dim] is None:
                continue
            graph.setInsertPoint(node)
            node.output().replaceAllUsesWith(graph.insertConstant(sizes[dim]))
        elif kind == "aten::Int" and ins[0].node().kind() == "prim::NumToTensor":
            node.output().replaceAllUsesWith(ins[0].node().input())
        elif kind == "prim::ListConstruct" and ins and all(v.node().kind() == "prim::Constant" for v in ins) and \
                all(isinstance(v.toIValue(), int) for v in ins):
            graph.setInsertPoint(node)
            node.output().replaceAllUsesWith(graph.insertConstant([v.toIValue() for v in ins]))
        else:
            continue
        node.destroy()
    graph.setInsertPoint(graph.return_node())
    torch._C._jit_pass_dce(graph)


class TracedGraph:
    """fn(*args) traced (args: tensors it reads and writes, fixed as a device graph's static buffers); replay()
    runs it again on them. The trace lives in a compilation unit of its own: torch.jit.trace would add it to
    TorchScript's global one, which keeps every function (and the weights and KV cache it holds) for the process's
    life; here reset(), or dropping the graph, frees them."""

    def __init__(self, fn: Callable[..., object], args: tuple):
        with _HostReadGuard():
            fn(*args)
        try:
            with warnings.catch_warnings():  # shapes turn into traced values; they are fixed per bucket
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # (fn, inputs, the values' debug names: none, a frame lookup each otherwise; strict, force out-of-place)
                graph, _ = torch._C._create_graph_by_tracing(fn, list(args), lambda _: "", False, False)
        except RuntimeError as e:  # e.g. an op returning an int, which the tracer cannot record
            raise GraphCaptureError(f"tracing failed: {str(e).splitlines()[0]}") from e
        _fold_shapes(graph)
        self._unit = torch._C.CompilationUnit()
        self._traced = self._unit.create_function("decode_step", graph)
        self._args = args

    def replay(self) -> None:
        optimize = torch._C._get_graph_executor_optimize()
        torch._C._set_graph_executor_optimize(False)
        try:
            self._traced(*self._args)
        finally:
            torch._C._set_graph_executor_optimize(optimize)

    def reset(self) -> None:
        self._traced = self._unit = self._args = None
