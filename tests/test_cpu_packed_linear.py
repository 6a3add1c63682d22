"""compiler/cpu_packed_linear.py: the cpu default's float linears on oneDNN prepacked weights, against F.linear."""
import pytest
import torch
from torch import fx, nn

from graphinfer.compiler.cpu_packed_linear import PackedLinear, pack_linears, packed_lm_head
from graphinfer.compiler.trace import GraphinferTracer

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.up = nn.Linear(64, 96, bias=True, dtype=dtype)
        self.down = nn.Linear(96, 64, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_packed_graph_matches_the_plain_one(dtype, rows):
    torch.manual_seed(rows)
    model = Block(dtype)
    gm = fx.GraphModule(model, GraphinferTracer().trace(model))
    packed = pack_linears(gm)
    assert isinstance(packed.up, PackedLinear) and isinstance(packed.down, PackedLinear)
    assert type(gm.up) is nn.Linear and gm.up.weight.dtype == dtype  # the engine's graph (artifacts) untouched
    x = torch.randn(rows, 64, dtype=dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(packed(x), gm(x), **tol)


def test_bf16_without_onednn_bf16_runs_on_fp32_packed_weights():
    """AVX2 alone (no oneDNN bf16): the bf16 weight is packed as fp32; the output is the bf16 GEMM's, rounded once."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    packed.upcast = True  # what __init__ chooses where oneDNN has no bf16 GEMM
    packed._pack()
    assert packed.packed_weight.dtype == torch.float32
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    y = packed(x)
    assert y.dtype == torch.bfloat16
    exact = (x.double() @ linear.weight.double().T + linear.bias.double()).to(torch.bfloat16)
    torch.testing.assert_close(y, exact, rtol=8e-3, atol=1e-6)  # fp32 sums: within a bf16 rounding of exact


def test_fp16_linears_are_left_alone():
    model = Block(torch.float16)  # fp16: not a dtype the path packs
    gm = fx.GraphModule(model, GraphinferTracer().trace(model))
    assert pack_linears(gm) is gm


def test_an_in_place_weight_update_is_repacked():
    torch.manual_seed(0)
    model = Block(torch.float32)
    gm = fx.GraphModule(model, GraphinferTracer().trace(model))
    packed = pack_linears(gm)
    x = torch.randn(3, 64)
    with torch.no_grad():
        gm.up.weight.mul_(-2)  # e.g. weights reloaded into the engine's parameters
    torch.testing.assert_close(packed(x), gm(x), rtol=1e-5, atol=1e-5)


def test_lm_head_is_packed_where_it_is_a_plain_linear():
    class Model(nn.Module):
        def __init__(self, head):
            super().__init__()
            self.lm_head = head

    head = nn.Linear(64, 300, bias=False)
    packed = packed_lm_head(Model(head))
    x = torch.randn(6, 64)
    assert isinstance(packed, PackedLinear) and packed.weight is head.weight  # a tied head stays tied
    torch.testing.assert_close(packed(x), head(x), rtol=1e-5, atol=1e-5)
    assert packed_lm_head(Model(nn.Linear(64, 300, dtype=torch.float16))) is None
    head.has_collective = True  # tensor parallel: the head all-gathers its logits
    assert packed_lm_head(Model(head)) is None
