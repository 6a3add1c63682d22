"""Trace a model and run the configured passes over it, each checked numerically on a real mini-batch."""
import torch
from torch import fx, nn

from graphinfer.compiler.pipeline_stages import cut_stage
from graphinfer.compiler.trace import trace_model
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.layers import AttentionMetadata, PagedAttention, activation_dtype, allocate_kv_cache
from graphinfer.models.transformers import TransformersForCausalLM
from graphinfer.passes import Pass, PassManager, PassReports
from graphinfer.passes.check import compare

_CHECK_BLOCKS, _CHECK_BLOCK_SIZE = 6, 16  # what check_inputs needs


def check_inputs(model: nn.Module, seed: int = 0) -> list[tuple]:
    """Two forward steps over the first KV blocks: a prefill of three sequences (5, 17 and 9 tokens), then
    a mixed step (a decode token for the first and third, a 6-token chunk continuing the second), so the
    check covers the cache write, prefill attention, decode attention and attention over a cached prefix.
    Needs a KV cache of 6 blocks of 16 tokens (compile_model allocates one)."""
    attn = next(m for m in model.modules() if isinstance(m, PagedAttention))
    device, bs = attn.k_cache.device, attn.k_cache.shape[1]
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 9]
    per_seq = -(-max(lens + [17 + 6]) // bs)
    tables = torch.arange(len(lens) * per_seq, dtype=torch.int32).view(len(lens), per_seq)

    def step(starts: list[int], counts: list[int]) -> tuple:
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        slots = tables[rows, positions // bs].long() * bs + positions % bs
        qsl = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32)
        ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=g)
        md = AttentionMetadata(slots.to(device), tables.to(device), qsl.to(device), seq_lens.to(device))
        return ids.to(device), positions.to(device), md

    return [step([0, 0, 0], lens), step(lens, [1, 6, 1])]


def compile_model(model: nn.Module, passes: list[Pass], check: bool = True, *, atol: float | None = None,
                  rtol: float | None = None, dump_dir: str | None = None) -> tuple[fx.GraphModule, PassReports]:
    """The traced, optimised graph of model.forward and one report per pass (plus `reports.end_to_end`, the
    final graph against the traced one), each checked on check_inputs(model) unless check=False. A failed
    check is reported, not raised (see PassReports.passed / failures()). atol / rtol: the check's tolerances
    (None: the dtype's defaults); dump_dir: see PassManager.

    Traces over a small scratch KV cache (the numeric checks write into it); whoever runs the graph then
    allocates the real cache and calls compiler.trace.rebind_buffers(model, gm)."""
    allocate_kv_cache(model, _CHECK_BLOCKS, _CHECK_BLOCK_SIZE)
    gm = trace_model(model)
    transformers = isinstance(model, TransformersForCausalLM)
    if ps.pp_size() > 1:  # pipeline parallel: this rank's stage of the graph, before any pass
        if transformers:
            raise UnsupportedArchitectureError("pipeline_parallel_size > 1 runs graphinfer's own model families; "
                                               "use model_impl='auto' (or 'graphinfer').")
        gm = cut_stage(gm, model.config.num_hidden_layers, model.config.hidden_size, activation_dtype(model))
    inputs = check_inputs(model) if check or transformers else None
    if transformers:  # always: a captured graph is only right if it does what the code does
        check_capture(model, gm, inputs)
    manager = PassManager(passes, inputs if check else None, atol=atol, rtol=rtol, dump_dir=dump_dir)
    with ps.pipeline_local():  # a stage's checks run its graph alone
        return gm, manager.run(gm)


def check_capture(model: nn.Module, gm: fx.GraphModule, inputs: list[tuple]) -> None:
    """The graph TorchDynamo captured from transformers' code gives what that code gives on other inputs than the
    capture's example (other token counts, ids and batch shapes); else the model is refused, not run wrong."""
    with torch.no_grad():
        ref = [model(*step) for step in inputs]  # each step writes the cache; the graph's rerun writes the same
        got = [gm(*step) for step in inputs]
    result = compare(ref, got)
    if not result.passed:
        raise UnsupportedArchitectureError(
            f"{model.config.architectures}: the graph captured from transformers' code does not reproduce it on other "
            f"inputs ({result.why()}): its forward branches on the data (e.g. a loop over the MoE experts a batch "
            f"hits), which a captured graph fixes at the capture's example. This model cannot run through "
            f"model_impl='transformers' yet.")
