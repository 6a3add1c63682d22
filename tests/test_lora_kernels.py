"""The LoRA ops (graphinfer/ops/lora.py): the references against an fp64 oracle written out per token here, and the
cpu platform's forms (graphinfer/ops/cpu/lora.py) and the Triton kernels (graphinfer/ops/triton/lora.py) against the
references.

Cases: T 1, 7, 33 tokens; one slice and three unequal ones (q 64, k 16, v 16: a GQA qkv); mixed slots in one batch
with -1 rows; rank-8 adapters zero-padded in R = 16 slots beside a full-rank one; fp32 and bf16; x a column slice of a
wider tensor (strided rows); an index buffer longer than T whose tail is garbage (10**9: an op that read it would
index far out of bounds). Rows with index -1: shrink writes exact zeros, expand returns y bit for bit.

Without a CUDA GPU the Triton kernels run under TRITON_INTERPRET=1 (upstream Triton in the default suite,
Triton-Ascend's interpreter in `make test-triton-ascend`); with one, compiled on "cuda" tensors; without triton their
tests skip.
Imports only torch, pytest and graphinfer.ops (the Ascend venv has no more). Shapes stay small: interpreters are slow.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates: set before the import

import graphinfer.ops  # noqa: E402  (registers the graphinfer:: ops)
from graphinfer.ops.cpu import lora as cpu_lora  # noqa: E402

try:
    from graphinfer.ops.triton import TRITON_OPS  # noqa: E402
    from graphinfer.ops.triton import lora as triton_lora  # noqa: E402
except ImportError:  # no triton installed
    TRITON_OPS = triton_lora = None

ops = torch.ops.graphinfer
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN = 40
GARBAGE = 10**9
SLICES = {"n1": (48,), "qkv": (64, 16, 16)}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}  # bf16: one rounding

IMPLS = {
    "cpu": (cpu_lora.shrink_segments, cpu_lora.expand_segments),
    "cpu_capture_safe": (cpu_lora.lora_shrink_capture_safe, cpu_lora.lora_expand_capture_safe),
    "cpu_gather": (cpu_lora.shrink_gather, cpu_lora.expand_gather),
    "cpu_all_slots": (cpu_lora.shrink_all_slots, cpu_lora.expand_one_hot),
    "triton": None,
}


def _impl(name):
    if name != "triton":
        return IMPLS[name], "cpu"
    if triton_lora is None:
        pytest.skip("triton is not installed")
    return (triton_lora.lora_shrink, triton_lora.lora_expand), DEVICE


def make_case(T, slices, dtype, S=4, R=16, seed=0, strided=True):
    """x [T, IN] (a column slice of a wider tensor when strided), lora_a [S, n, R, IN], lora_b [S, out, R] with slot 0
    of rank 16 and the others of rank 8 (zeros beyond), y [T, out], and an index buffer of T + 5 entries: mixed slots
    and -1 in its first T, garbage after."""
    g = torch.Generator().manual_seed(seed)
    n, out = len(slices), sum(slices)
    if strided:
        x = torch.randn(T, IN + 9, generator=g)[:, 5:5 + IN].to(dtype)
    else:
        x = torch.randn(T, IN, generator=g).to(dtype)
    a = torch.randn(S, n, R, IN, generator=g) * 0.2
    b = torch.randn(S, out, R, generator=g) * 0.2
    a[1:, :, 8:] = 0  # rank-8 adapters padded into R = 16
    b[1:, :, 8:] = 0
    y = torch.randn(T, out, generator=g).to(dtype)
    idx = torch.full((T + 5,), GARBAGE, dtype=torch.int64)
    idx[:T] = torch.tensor([(t * 3 + 1) % (S + 1) - 1 for t in range(T)])  # 0, 3, -1, 2, ... (T = 1: slot 0)
    return x, a.to(dtype), b.to(dtype), y, idx


def oracle_shrink(x, a, idx):
    T = x.shape[0]
    out = torch.zeros(T, a.shape[1], a.shape[2], dtype=torch.float64)
    for t in range(T):
        slot = int(idx[t])
        if slot >= 0:
            out[t] = a[slot].double() @ x[t].double()  # [n, R, IN] @ [IN]
    return out


def oracle_expand(y, buf, b, idx, slices):
    out = y.double().clone()
    for t in range(y.shape[0]):
        slot = int(idx[t])
        if slot < 0:
            continue
        start = 0
        for s, size in enumerate(slices):
            out[t, start:start + size] += b[slot, start:start + size].double() @ buf[t, s].double()
            start += size
    return out


CASES = [(T, name, dtype) for T in (1, 7, 33) for name in SLICES for dtype in (torch.float32, torch.bfloat16)]
IDS = [f"T{T}-{name}-{str(dtype).removeprefix('torch.')}" for T, name, dtype in CASES]


@pytest.mark.parametrize("T,name,dtype", CASES, ids=IDS)
def test_reference_matches_fp64_oracle(T, name, dtype):
    slices = SLICES[name]
    x, a, b, y, idx = make_case(T, slices, dtype)
    y0 = y.clone()
    buf = ops.lora_shrink(x, a, idx)
    assert buf.dtype == torch.float32 and buf.shape == (T, len(slices), 16)
    torch.testing.assert_close(buf.double(), oracle_shrink(x, a, idx), atol=1e-5, rtol=1e-5)
    none = idx[:T] < 0
    assert none.any() == (T > 1) and torch.equal(buf[none], torch.zeros_like(buf[none]))
    z = ops.lora_expand(y, buf, b, idx, list(slices))
    assert z.dtype == dtype and z.shape == y.shape and z.data_ptr() != y.data_ptr()
    assert torch.equal(y, y0)  # functional
    want = oracle_expand(y, buf, b, idx, slices)
    torch.testing.assert_close(z.double(), want.to(dtype).double(), **TOL[dtype])
    assert torch.equal(z[none], y[none])


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("T,name,dtype", CASES, ids=IDS)
def test_impl_matches_reference(impl, T, name, dtype):
    (shrink, expand), dev = _impl(impl)
    slices = SLICES[name]
    x, a, b, y, idx = make_case(T, slices, dtype, seed=T)
    want_buf = ops.lora_shrink(x, a, idx)
    xd, ad, bd, yd, idxd = (t.to(dev) for t in (x, a, b, y, idx))
    buf = shrink(xd, ad, idxd)
    assert buf.dtype == torch.float32 and buf.shape == want_buf.shape
    torch.testing.assert_close(buf.cpu(), want_buf, atol=1e-5, rtol=1e-5)
    none = idx[:T] < 0
    assert torch.equal(buf.cpu()[none], torch.zeros_like(want_buf[none]))
    want = ops.lora_expand(y, want_buf, b, idx, list(slices))
    y0 = yd.clone()
    z = expand(yd, want_buf.to(dev), bd, idxd, list(slices))
    assert z.dtype == dtype and z.shape == y.shape
    assert torch.equal(yd, y0)  # y is not modified
    torch.testing.assert_close(z.cpu().double(), want.double(), **TOL[dtype])
    assert torch.equal(z.cpu()[none], y[none])  # -1 rows: y exactly


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
def test_reads_only_the_first_T_indices_and_minus_one_rows_are_y(impl):
    """Every token -1 and the buffer's tail garbage: shrink gives exact zeros, expand y bit for bit (negative zeros
    too); with every token on slot 3 and the same garbage tail, the result is slot 3's for every row."""
    if impl == "reference":
        (shrink, expand), dev = (ops.lora_shrink, ops.lora_expand), "cpu"
    else:
        (shrink, expand), dev = _impl(impl)
    slices = SLICES["qkv"]
    x, a, b, y, idx = make_case(5, slices, torch.bfloat16, strided=False)
    y[0, :8] = -0.0
    idx[:5] = -1
    buf = shrink(x.to(dev), a.to(dev), idx.to(dev)).cpu()
    assert torch.equal(buf, torch.zeros(5, 3, 16)) and not torch.signbit(buf).any()
    z = expand(y.to(dev), torch.randn(5, 3, 16).to(dev), b.to(dev), idx.to(dev), list(slices)).cpu()
    assert torch.equal(z.view(torch.int16), y.view(torch.int16))  # the bits of y
    idx[:5] = 3
    buf = shrink(x.to(dev), a.to(dev), idx.to(dev)).cpu()
    torch.testing.assert_close(buf.double(), oracle_shrink(x, a, idx), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(triton_lora is None, reason="triton is not installed")
def test_triton_packs_tokens_when_the_grid_would_pass_the_limit(monkeypatch):
    """Long prefills: more than _MAX_GRID programs pack TOKENS tokens per program (a static loop, the ragged last group
    masked). The limit is lowered so that 33 tokens take that path."""
    monkeypatch.setattr(triton_lora, "_MAX_GRID", 8)
    assert triton_lora._tokens_per_program(33, 3) == 16
    slices = SLICES["qkv"]
    x, a, b, y, idx = make_case(33, slices, torch.float32)
    buf = triton_lora.lora_shrink(*(t.to(DEVICE) for t in (x, a, idx)))
    want = ops.lora_shrink(x, a, idx)
    torch.testing.assert_close(buf.cpu(), want, atol=1e-5, rtol=1e-5)
    z = triton_lora.lora_expand(*(t.to(DEVICE) for t in (y, want, b, idx)), list(slices))
    torch.testing.assert_close(z.cpu(), ops.lora_expand(y, want, b, idx, list(slices)), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(triton_lora is None, reason="triton is not installed")
def test_triton_registry():
    assert TRITON_OPS["lora_shrink"] is triton_lora.lora_shrink
    assert TRITON_OPS["lora_expand"] is triton_lora.lora_expand


def test_schemas_and_fake_impls():
    assert str(ops.lora_shrink.default._schema) == (
        "graphinfer::lora_shrink(Tensor x, Tensor lora_a, Tensor token_lora_indices) -> Tensor")
    assert str(ops.lora_expand.default._schema) == (
        "graphinfer::lora_expand(Tensor y, Tensor buf, Tensor lora_b, Tensor token_lora_indices, SymInt[] slice_sizes)"
        " -> Tensor")
    assert not ops.lora_shrink.default._schema.is_mutable and not ops.lora_expand.default._schema.is_mutable
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 40, dtype=torch.bfloat16)
        buf = ops.lora_shrink(x, torch.empty(4, 3, 16, 40, dtype=torch.bfloat16), torch.empty(64, dtype=torch.int64))
        assert buf.shape == (5, 3, 16) and buf.dtype == torch.float32
        z = ops.lora_expand(torch.empty(5, 96, dtype=torch.bfloat16), buf, torch.empty(4, 96, 16, dtype=torch.bfloat16),
                            torch.empty(64, dtype=torch.int64), [64, 16, 16])
        assert z.shape == (5, 96) and z.dtype == torch.bfloat16
    x, a, b, y, idx = make_case(3, SLICES["qkv"], torch.float32, strided=False)
    torch.library.opcheck(ops.lora_shrink.default, (x, a, idx),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    buf = ops.lora_shrink(x, a, idx)
    torch.library.opcheck(ops.lora_expand.default, (y, buf, b, idx, [64, 16, 16]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


class _LoraQKV(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(IN, 96, bias=False)
        self.register_buffer("lora_a", torch.zeros(4, 3, 16, IN))
        self.register_buffer("lora_b", torch.zeros(4, 96, 16))

    def forward(self, x, token_lora_indices):
        buf = graphinfer.ops.lora_shrink(x, self.lora_a, token_lora_indices)  # the OpOverloads models call
        return graphinfer.ops.lora_expand(self.base(x), buf, self.lora_b, token_lora_indices, [64, 16, 16])


def test_fx_trace_gives_one_node_per_op():
    m = _LoraQKV()
    gm = torch.fx.symbolic_trace(m)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.lora_shrink.default) == 1 and targets.count(ops.lora_expand.default) == 1
    assert len(targets) == 2  # nothing else (the base linear is a call_module): each op is a single node
    expand_node, = [n for n in gm.graph.nodes if n.target is ops.lora_expand.default]
    assert expand_node.args[4] == [64, 16, 16]
    x = torch.randn(3, IN)
    idx = torch.tensor([0, -1, 2, GARBAGE])
    torch.testing.assert_close(gm(x, idx), m(x, idx))


def test_cpu_platform_registers_the_cpu_forms():
    """The cpu platform (no device graphs; its traced decode graphs refuse the segment forms' host reads, so LoRA's
    decode steps run eagerly there) takes the segment forms (host reads of the index); a cpu platform that captures
    device graphs (the tests' stand-in) the capture-safe ones."""
    cpu_platform = pytest.importorskip("graphinfer.platforms.cpu")  # (the Ascend venv may lack its imports)

    class Capturing(cpu_platform.CpuPlatform):
        supports_graph_capture = True

    for kernels in ("eager", "inductor"):
        impls = cpu_platform.CpuPlatform().op_impls(kernels)
        assert impls["lora_shrink"] is cpu_lora.shrink_segments and impls["lora_expand"] is cpu_lora.expand_segments
        impls = Capturing().op_impls(kernels)
        assert impls["lora_shrink"] is cpu_lora.lora_shrink_capture_safe
        assert impls["lora_expand"] is cpu_lora.lora_expand_capture_safe


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton_lora is None, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("T", [1, 64, 256, 2048])
@pytest.mark.parametrize("K,slices", [(4096, (4096, 1024, 1024)), (4096, (14336, 14336)), (14336, (4096,))],
                         ids=["qkv", "gate_up", "down"])
def test_compiled_kernels_on_llama3_8b_shapes(T, K, slices):
    """The compiled kernels at Llama-3-8B's projection shapes (bf16, 8 slots of rank 16, every token on an adapter but
    one in eight), against the reference on the CPU; prints their time beside the base projection's GEMM."""
    from triton.testing import do_bench

    g = torch.Generator().manual_seed(0)
    S, R, n, out = 8, 16, len(slices), sum(slices)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    a = (torch.randn(S, n, R, K, generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(S, out, R, generator=g) * 0.02).to(torch.bfloat16)
    y = torch.randn(T, out, generator=g).to(torch.bfloat16)
    idx = torch.tensor([t % (S + 1) - 1 for t in range(T)], dtype=torch.int64)
    want_buf = ops.lora_shrink(x, a, idx)
    want = ops.lora_expand(y, want_buf, b, idx, list(slices))
    xc, ac, bc, yc, ic = (t.cuda() for t in (x, a, b, y, idx))
    buf = triton_lora.lora_shrink(xc, ac, ic)
    got = triton_lora.lora_expand(yc, buf, bc, ic, list(slices))
    torch.testing.assert_close(buf.cpu(), want_buf, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[torch.bfloat16])
    w = torch.randn(out, K, dtype=torch.bfloat16, device="cuda")
    us_shrink = do_bench(lambda: triton_lora.lora_shrink(xc, ac, ic)) * 1e3
    us_expand = do_bench(lambda: triton_lora.lora_expand(yc, buf, bc, ic, list(slices))) * 1e3
    us_base = do_bench(lambda: xc @ w.T) * 1e3
    print(f"lora T={T} K={K} slices={slices}: shrink {us_shrink:.1f} us, expand {us_expand:.1f} us, "
          f"base GEMM {us_base:.1f} us")
