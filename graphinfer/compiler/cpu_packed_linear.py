"""CPU linears on oneDNN with prepacked weights (vLLM-CPU's choice: its dispatch_cpu_unquantized_gemm).

ATen's F.linear on CPU calls MKL on the plain [N, K] weight each step; here oneDNN's matmul runs on a weight
reordered once into its blocked layout, as vLLM-CPU does (bf16 on AVX512-BF16 / AMX; on AVX2 alone bf16 weights
are packed as fp32). Up to four rows (batch-1 decode) go to csrc/cpu/gemv.cpp on the weight as held instead
(ops/cpu/gemv.py): at one row oneDNN's call costs ~30 us whatever the shape, 121 calls a SmolLM2 token, and
neither it nor MKL's GEMV streams the weights as fast on the AVX2 AMD dev VM (docs/benchmarks.md, CPU peers). The
runner gets a copy of the fused graph whose leaf Linear modules are PackedLinear, and a packed LM head for its logits
(models' compute_logits is their lm_head); the engine's own graph and model keep their nn.Linear (artifacts save
them), so these weights are held twice (three times over for bf16 packed as fp32).
"""
import torch
from torch import fx, nn

from graphinfer.compiler.skinny_gemm import SkinnyLinear
from graphinfer.compiler.trace import is_leaf_layer, with_modules
from graphinfer.ops.cpu import gemv as cpu_gemv

PACK_BATCH = 32  # oneDNN's batch hint for the layout (vLLM's); any row count runs on it


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's prepacked layout (an opaque mkldnn tensor of the same [N, K] shape)."""

    row_wise = True  # compiler/sampled_rows.py: each output row from the same input row

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the engine's graph holds weight anyway
        # bf16 where oneDNN has no bf16 GEMM (AVX2 alone, where oneDNN's bf16 reorder raises): the weight packed as
        # fp32 and the rows widened, so the products are exact and the sums fp32, as in a bf16 GEMM; the output is
        # rounded back to bf16 (batch 64 at fp32's speed: 98.4 vs 99.5 tok/s, docs/bench/..._ef6f033_avx2.json)
        self.upcast = linear.weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        # a few rows (batch-1 decode): csrc/cpu/gemv.cpp on the weight as held, where the library is built
        self.gemv = cpu_gemv.available() and linear.weight.is_contiguous()
        self.register_buffer("packed_weight", None, persistent=False)
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach().float() if self.upcast else self.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH)
        self.packed_bias = None if self.bias is None else self.bias.detach().to(weight.dtype)
        self.packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and x.numel() <= cpu_gemv.MAX_ROWS * self.in_features:
            return cpu_gemv.gemv(x, self.weight, self.bias)
        if self.weight._version != self.packed_version:  # the weight was updated in place (a reload): repack
            self._pack()
        if self.upcast:
            return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_weight, self.packed_bias, "none", [],
                                                      "").to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.packed_bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable(mod: nn.Module) -> bool:
    """A leaf Linear (forward = F.linear, no collective; not one the skinny GEMM took) with an fp32 or bf16 weight."""
    return (isinstance(mod, nn.Linear) and not isinstance(mod, SkinnyLinear) and is_leaf_layer(mod)
            and mod.weight.dtype in (torch.float32, torch.bfloat16) and mod.weight.device.type == "cpu")


def pack_linears(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm (its own module tree; gm untouched) whose packable Linear modules are PackedLinear."""
    targets = dict.fromkeys(n.target for n in gm.graph.nodes
                            if n.op == "call_module" and packable(gm.get_submodule(n.target)))
    return with_modules(gm, {t: PackedLinear(gm.get_submodule(t)) for t in targets}) if targets else gm


def packed_lm_head(model: nn.Module) -> PackedLinear | None:
    """model.compute_logits (its lm_head, a tied one included) on prepacked weights; None where the head is not a
    packable Linear (tensor parallel: it all-gathers; quantized)."""
    head = getattr(model, "lm_head", None)
    return PackedLinear(head) if head is not None and packable(head) else None
