"""The cpu platform's decode graphs (platforms/cpu_graphs.py): the trace refuses forwards that read values on the host,
replays see the step's inputs and the weights as they are now, and FULL_DECODE_ONLY (the default with the eager
kernels) gives NONE's tokens on the bundled SmolLM2, GGUF kept quantized and fp32, at padded batch sizes."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from graphinfer.errors import GraphCaptureError
from graphinfer.platforms.cpu_graphs import TracedGraph


@pytest.mark.parametrize("read", [lambda t: bool(t.sum() > 0), lambda t: int(t.max()), lambda t: t.sum().item(),
                                  lambda t: t.tolist()[0], lambda t: t.numpy()[0]])
def test_traced_graph_refuses_host_reads(read):
    x = torch.ones(4)
    with pytest.raises(GraphCaptureError, match="reads a tensor's value on the host"):
        TracedGraph(lambda x: x * 2 if read(x) else x, (x,))


def test_traced_graph_replays_new_inputs_and_updated_weights():
    """Inputs are the trace's arguments; the weight is a constant of it, updated in place between replays: an
    optimizing executor would fold w.t().contiguous() (constants only) once and replay the stale product."""
    torch.manual_seed(0)
    w, x, out = torch.randn(8, 8), torch.randn(2, 8), torch.empty(2, 8)
    graph = TracedGraph(lambda out, x: out.copy_(F.linear(x * 2, w.t().contiguous())), (out, x))
    for _ in range(4):
        x.copy_(torch.randn(2, 8))
        w.add_(1.0)
        graph.replay()
        assert torch.equal(out, F.linear(x * 2, w.t().contiguous()))


def test_shape_reads_replay_as_constants():
    """The tracer records a wrapper's x.shape[i] as aten::size -> NumToTensor -> aten::Int and its shape lists as
    ListConstruct, re-run at each replay; a bucket's shapes are fixed, so the graph holds them as constants and
    replays the same values as the eager function."""
    def fn(out, x):
        n, k = x.shape  # as the ops' wrappers read shapes (arithmetic on them stays in the graph)
        return out.copy_((x.view(n, 2, 4) * 3).reshape(n, k).flip(0))

    x, out = torch.randn(3, 8), torch.empty(3, 8)
    graph = TracedGraph(fn, (out, x))
    kinds = [node.kind() for node in graph._traced.graph.nodes()]
    assert "aten::size" not in kinds and "aten::Int" not in kinds and "prim::ListConstruct" not in kinds, kinds
    x.copy_(torch.randn(3, 8))
    graph.replay()
    assert torch.equal(out, fn(torch.empty(3, 8), x))


def test_reset_frees_what_the_trace_holds():
    """The weights and KV cache are constants of a trace: an engine's shutdown must free them (torch.jit.trace's
    global compilation unit would keep them for the process's life)."""
    w = torch.randn(8, 8)
    ref = weakref.ref(w)
    graph = TracedGraph(lambda out, x: out.copy_(x @ w), (torch.empty(2, 8), torch.randn(2, 8)))
    graph.replay()
    del w
    gc.collect()
    assert ref() is not None  # the trace holds it
    graph.reset()
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("engine_kernels", ["cpu-default"], indirect=True)
@pytest.mark.parametrize("kwargs,sizes", [({"quantization": "gguf"}, [1, 2, 4, 8]),
                                          # 8 rows go to oneDNN's prepacked weights, which a trace cannot hold
                                          ({"dtype": "float32"}, [1, 2, 4])], ids=["gguf", "fp32"])
def test_decode_graphs_match_eager(smollm2_path, engine_kernels, kwargs, sizes):
    from graphinfer import LLM, SamplingParams
    from test_smollm2 import PROMPTS

    from conftest import need_cpu_kernels
    from graphinfer.ops.cpu import ext

    need_cpu_kernels(ext.available())
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(smollm2_path, max_model_len=512, enable_prefix_caching=False, **kwargs)
    dispatcher = llm.llm_engine.worker.dispatcher
    assert dispatcher.mode == "FULL_DECODE_ONLY" and dispatcher.decode_graphs.sizes == sizes  # the default here
    outs = {}
    for mode in ("FULL_DECODE_ONLY", "NONE"):  # NONE: the same engine with its graphs set aside
        graphs = dispatcher.decode_graphs
        if mode == "NONE":
            dispatcher.decode_graphs = None
        outs[mode] = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], sp, use_tqdm=False)]
                      for n in (1, 3, 5)]  # batches of 3 and 5 replay padded graphs of 4 and 8 rows (fp32: 5 eager)
        dispatcher.decode_graphs = graphs
    llm.shutdown()
    assert outs["FULL_DECODE_ONLY"] == outs["NONE"]
