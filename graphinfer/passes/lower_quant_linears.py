"""lower_quant_linears: each quantized Linear module becomes the ops it runs.

Matches: a call of a QuantizedLinear module (quantization/linear.py); it runs after fuse_qkv / fuse_gate_up,
which fuse quantized projections as module calls.
Produces: block FP8 (DeepSeek's checkpoints kept in fp8): graphinfer::block_fp8_linear(x, weight, weight_scale,
bn, bk, bias), the activation quantization inside it (per token-group scales); weight-only schemes:
graphinfer::wo_linear(x, weight, weight_scale, weight_zero, bits, bias);
activation-quantized ones (w8a8, fp8): graphinfer::dynamic_quant(x, act_dtype, input_scale) and
graphinfer::scaled_mm(codes, scale, weight, weight_scale, bias, dtype), the tensors read with get_attr. With the
quantization of x a node of its own, fuse_rmsnorm_quant / fuse_silu_mul_quant can fuse it into x's producer.
Declines: nothing; a graph without quantized layers is left as it is.
"""
import operator

from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.utils import GRAPHINFER
from graphinfer.quantization.linear import QuantizedLinear


def _read(graph: fx.Graph, target: str, module, name: str):
    return graph.get_attr(f"{target}.{name}") if getattr(module, name) is not None else None


class LowerQuantLinearsPass(Pass):
    name = "lower_quant_linears"
    description = "QuantizedLinear modules -> dynamic_quant + scaled_mm, wo_linear, or block_fp8_linear"

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_module" or not isinstance(m := gm.get_submodule(node.target), QuantizedLinear):
                continue
            x, s = node.args[0], m.scheme
            with graph.inserting_before(node):
                w, w_scale, bias = (_read(graph, node.target, m, n) for n in ("weight", "weight_scale", "bias"))
                if s.block_fp8:
                    out = graph.call_function(GRAPHINFER.block_fp8_linear.default,
                                              (x, w, w_scale, *s.weight_block, bias))
                elif s.weight_only:
                    zero = _read(graph, node.target, m, "weight_zero")
                    out = graph.call_function(GRAPHINFER.wo_linear.default, (x, w, w_scale, zero, s.bits, bias))
                else:
                    quant = graph.call_function(GRAPHINFER.dynamic_quant.default,
                                                (x, s.act_dtype, _read(graph, node.target, m, "input_scale")))
                    codes = graph.call_function(operator.getitem, (quant, 0))
                    scale = graph.call_function(operator.getitem, (quant, 1))
                    out = graph.call_function(GRAPHINFER.scaled_mm.default,
                                              (codes, scale, w, w_scale, bias, m.out_dtype))
            node.replace_all_uses_with(out)
            graph.erase_node(node)
            matches += 1
        return matches
