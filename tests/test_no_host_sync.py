"""No host syncs inside a step's forward (issue 19): every op of a model forward stays asynchronous.

A forward that reads a device tensor on the host (.item(), .tolist(), bool(t), a boolean-mask index, ...)
makes the host wait for the device: a CUDA/ACL graph cannot capture it, and async scheduling cannot run
ahead of it. Two guards, around the model forward only (not the scheduler, the input staging or the
sampler):

- CPU (the rehearsal here): `no_host_sync()` raises HostSyncError on the Python methods that read a
  tensor on the host (Tensor.item / tolist / cpu / numpy / __bool__ / __int__ / __float__ / __index__ /
  __complex__) and, through a TorchDispatchMode, on the aten ops that sync on a device (nonzero,
  masked_select, unique, bool-mask indexing, repeat_interleave without output_size, equal / is_nonzero,
  copies to the host), also inside the graphinfer:: ops' own Python (a dispatch mode does not see inside
  a custom op by itself, so the guard re-enters itself around each graphinfer kernel). It is suspended
  while Triton's interpreter runs a kernel: the interpreter copies tensors to numpy and back to simulate
  the device; the guard is about our Python around the launches. The Triton kernels run under
  TRITON_INTERPRET=1 in a subprocess (as tests/test_triton_model.py; op registration is process-wide).
- GPU (marker gpu): the same forward under torch.cuda.set_sync_debug_mode("error").

Each model runs prompts that make every batch mix, and the test checks that each occurred: prefill only,
mixed prefill chunks + decodes, prefill over a cached prefix (the later chunks of a long prompt; a prompt
whose prefix an earlier request left in the prefix cache), decode only (T == B: the split-K decode
kernel; mixed steps run the flash kernel).
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when @triton.jit decorates: set before import

from cpu_env import cpu_subprocess_env  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    pass


_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__")
_ALWAYS_SYNC = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                aten.equal.default, aten.is_nonzero.default, aten._unique.default, aten._unique2.default,
                aten.unique_dim.default, aten.unique_consecutive.default, aten.allclose.default}


def _aten_sync(func, args, kwargs) -> str | None:
    """Why this aten op would make the host wait for the device, or None."""
    if func in _ALWAYS_SYNC:
        return str(func)
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
        return "repeat_interleave without output_size (the host needs the sum of repeats)"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            return f"{func} with a boolean mask (nonzero inside)"
    if func is aten._to_copy.default and kwargs.get("device") is not None:
        if torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
            return "copy to the host"
    if func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return "copy to the host"
    return None


class _Guard(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        if func.namespace == "graphinfer":
            # Run the op's kernel for the tensors' device with the guard pushed again, so the aten ops and the
            # Tensor methods inside the op's Python (a Triton wrapper, a reference impl) are checked too.
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            key = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}[device.type]
            with self:
                return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
        reason = _aten_sync(func, args, kwargs)
        if reason:
            raise HostSyncError(f"host sync in the model forward: {reason}")
        return func(*args, **kwargs)


_guard: _Guard | None = None  # the active guard (no_host_sync is not re-entrant)


def _method_guard(name, original):
    def guarded(self, *args, **kwargs):
        if _guard is not None and not _guard.suspended:
            raise HostSyncError(f"host sync in the model forward: Tensor.{name}()")
        return original(self, *args, **kwargs)

    guarded.__name__ = name
    return guarded


@contextlib.contextmanager
def suspended():
    """Let the host read tensors (Triton's interpreter simulating a launch)."""
    if _guard is None:
        yield
        return
    _guard.suspended += 1
    try:
        yield
    finally:
        _guard.suspended -= 1


def _interpreter_executors() -> list:
    """Triton's interpreter launch entry (GridExecutor.__call__), where loaded; the guard pauses inside it."""
    mod = sys.modules.get("triton.runtime.interpreter")
    return [mod.GridExecutor] if mod is not None and hasattr(mod, "GridExecutor") else []


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSyncError on anything in the block that reads a tensor on the host (see the module doc)."""
    global _guard
    assert _guard is None, "no_host_sync is not re-entrant"
    saved = [(torch.Tensor, name, torch.Tensor.__dict__.get(name)) for name in _METHODS]
    for name in _METHODS:
        setattr(torch.Tensor, name, _method_guard(name, getattr(torch.Tensor, name)))
    for executor in _interpreter_executors():
        call = executor.__call__

        def launch(self, *args, _call=call, **kwargs):
            with suspended():
                return _call(self, *args, **kwargs)

        saved.append((executor, "__call__", call))
        executor.__call__ = launch
    _guard = _Guard()
    try:
        with _guard:
            yield
    finally:
        _guard = None
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# ---- the guard itself ---------------------------------------------------------------------------------------------

def _paged_args():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 2, 4, 2, 16, generator=g)
    q = torch.randn(3, 4, 16, generator=g)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    return q, kc, vc, tables, torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([2, 4], dtype=torch.int32)


@pytest.mark.parametrize("read", [
    lambda t: t[0].item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy(), lambda t: bool(t.sum() > 0),
    lambda t: int(t[0]), lambda t: float(t[0]), lambda t: [0, 1, 2][t[0]], lambda t: t[t > 0],
    lambda t: torch.nonzero(t), lambda t: torch.repeat_interleave(t.long().abs()), lambda t: t.unique(),
    lambda t: torch.equal(t, t),
], ids=["item", "tolist", "cpu", "numpy", "bool", "int", "float", "index", "bool-mask", "nonzero",
        "repeat_interleave", "unique", "equal"])
def test_guard_catches_host_reads(read):
    t = torch.tensor([1, -2, 3])
    with pytest.raises(HostSyncError), no_host_sync():
        read(t)
    read(t)  # restored afterwards


def test_guard_lets_async_ops_through():
    t = torch.arange(6.0)
    with no_host_sync():
        out = torch.repeat_interleave(t.long(), t.long(), output_size=15)
        idx = torch.searchsorted(t, t.flip(0))
        x = torch.where(t > 2, t, 0.0)[idx] + t.shape[0]
        with suspended():
            assert t.tolist()[1] == 1.0
    assert out.shape == (15,) and x.shape == (6,)


def test_guard_sees_inside_graphinfer_ops():
    """The reference paged_attention reads query_start_loc / seq_lens with .tolist() (as the Triton prefill
    wrapper used to): the guard catches it through the custom op's dispatch."""
    import graphinfer.ops  # noqa: F401

    args = _paged_args()
    torch.ops.graphinfer.paged_attention.default(*args, 0.25)  # fine without the guard
    with pytest.raises(HostSyncError, match="tolist"), no_host_sync():
        torch.ops.graphinfer.paged_attention.default(*args, 0.25)


def test_triton_attention_under_the_guard():
    """The Triton paged_attention (flash kernel for this mixed batch, decode kernel for T == B) reads nothing
    on the host, with or without a sliding window, softcap and (bf16) sinks; the guard pauses while the interpreter
    simulates the launch."""
    from graphinfer.ops.triton.attention import paged_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, kc, vc, tables, qsl, lens = (a.to(device) for a in _paged_args())
    decode_qsl = torch.arange(3, dtype=torch.int32, device=device)
    features = dict(sliding_window=3, softcap=2.0, sinks=torch.randn(4, device=device, dtype=torch.bfloat16))
    with no_host_sync():
        for extra in ({}, features):
            mixed = paged_attention(q, kc, vc, tables, qsl, lens, 0.25, **extra)
            decode = paged_attention(q[:2], kc, vc, tables, decode_qsl, lens, 0.25, **extra)
    assert mixed.shape == q.shape and decode.shape == (2, 4, 16)



def test_triton_mla_attention_under_the_guard():
    """The Triton mla_latent_attention (a mixed batch: rows find their requests on the device; a pure decode batch,
    split and not) reads nothing on the host."""
    from graphinfer.ops.triton.mla_attention import mla_latent_attention_impl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 16, 1, 48, generator=g).to(device)
    q_latent, q_pe = torch.randn(3, 16, 32, generator=g).to(device), torch.randn(3, 16, 16, generator=g).to(device)
    tables = torch.tensor([[0, 2], [1, 0]], dtype=torch.int32, device=device)
    qsl, lens = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([0, 2, 3], [20, 4]))
    with no_host_sync():
        mixed = mla_latent_attention_impl(q_latent, q_pe, cache, tables, qsl, lens, 0.2)
        for splits in (1, 2):
            decode = mla_latent_attention_impl(q_latent[:2], q_pe[:2], cache, tables, qsl[:3] * 0 + torch.arange(
                3, dtype=torch.int32, device=device), lens, 0.2, num_splits=splits)
    assert mixed.shape == q_latent.shape and decode.shape == (2, 16, 32)

# ---- whole models ---------------------------------------------------------------------------------------------------

SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
import torch
from graphinfer import LLM, SamplingParams
from test_no_host_sync import cuda_sync_error, no_host_sync  # noqa: F401

def kinds_of(md):
    q_lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).tolist()
    ctx = [L - n for L, n in zip(md.seq_lens.tolist(), q_lens)]
    kinds = set()
    if all(n == 1 for n in q_lens):
        kinds.add("decode")
    elif all(n > 1 and c == 0 for n, c in zip(q_lens, ctx)):
        kinds.add("prefill")
    if any(n == 1 for n in q_lens) and any(n > 1 for n in q_lens):
        kinds.add("mixed")
    if any(n > 1 and c > 0 for n, c in zip(q_lens, ctx)):
        kinds.add("chunked")
    return kinds

prefix = list(range(20, 40))  # five blocks of 4, cached by the first request that uses it
prompts = [[1, 5, 9, 3], [4, 4, 8], list(range(2, 30)), prefix + [3, 4, 5], prefix + [9, 9]]
params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(len(prompts))]
for model in {models!r}:
    llm = LLM(model, block_size=4, num_gpu_blocks_override=96, max_num_seqs=8, max_num_batched_tokens=16,
              graph_mode="NONE", **{llm_kw})
    if {activate!r}:  # the same fx graph, its ops bound to these kernels (skips interpreted pass self-checks)
        llm.llm_engine.local_core.platform.activate({activate!r})
    runner = llm.llm_engine.worker.model_runner
    seen = set()

    def guard_calls(forward):
        def guarded(input_ids, positions, md, *rows):
            with {guard}:
                out = forward(input_ids, positions, md, *rows)
            seen.update(kinds_of(md))  # outside the guard: the test reads the metadata
            return out
        return guarded

    # prefills run the sampled-rows forward (compiler/sampled_rows.py) where the model has one, the rest the graph
    runner.graph, runner.graph_rows = guard_calls(runner.graph), runner.graph_rows and guard_calls(runner.graph_rows)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # one prefill-only step, then decodes (T == B)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # chunks over their own cached blocks, mixed steps
    llm.generate(prompts[4:], params[4:], use_tqdm=False)  # a prompt over a prefix another request cached
    print(model, "OK", *sorted(seen))
"""


def _run_models(guard: str, env: dict, activate: str | None = None, **llm_kw) -> list[str]:
    models = ["tiny-qwen3", "tiny-qwen3-moe"]
    script = SCRIPT.format(models=models, tests_dir=os.path.dirname(__file__), guard=guard, llm_kw=llm_kw,
                           activate=activate)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split() for line in lines] == [[m, "OK", "chunked", "decode", "mixed", "prefill"] for m in models], \
        out.stdout
    return lines


def test_guard_catches_the_reference_ops_in_a_model():
    """Control: the same wiring around a model forward with the reference ops (which read the host) raises."""
    from graphinfer import LLM, SamplingParams

    llm = LLM("tiny-qwen3", block_size=4, num_gpu_blocks_override=32, max_num_seqs=2, graph_mode="NONE",
              dtype="float32", device="cpu", kernels="reference")
    runner = llm.llm_engine.worker.model_runner
    forward = runner.graph

    def guarded(*args):
        with no_host_sync():
            return forward(*args)

    runner.graph, runner.graph_rows = guarded, None
    with pytest.raises(HostSyncError, match="boolean mask"):  # reshape_and_cache's slots[slots >= 0], first
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_model_forward_never_syncs_the_host():
    """tiny-qwen3 and tiny-qwen3-moe with the Triton kernels (interpreted), fp32, every batch mix. The engine is
    built with the reference ops and then bound to the Triton kernels: LLM(kernels="triton") would run the
    passes' numeric self-checks through the interpreter too (~25 s a model) for the same graph."""
    _run_models("no_host_sync()", cpu_subprocess_env(), activate="triton", dtype="float32", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_forward_never_syncs_the_gpu():
    """The same forward compiled on the GPU, bf16, under CUDA's sync debug mode (raises on a sync)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run_models("cuda_sync_error()", env, dtype="bfloat16", device="cuda")


@contextlib.contextmanager
def cuda_sync_error():
    """torch.cuda.set_sync_debug_mode("error") for the block (used by the GPU test's subprocess)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
