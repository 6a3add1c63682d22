"""fuse_silu_mul_quant: SwiGLU's output quantized for the down projection becomes one op (vLLM's
ActivationQuantFusionPass).

Matches: graphinfer::dynamic_quant(silu_and_mul(x), dtype, input_scale) where the activation has no other user
(after fuse_gate_up and lower_quant_linears on a w8a8 / fp8 model).
Produces: graphinfer::silu_and_mul_quant(x, dtype, input_scale) -> (codes, scale).
Declines: an activation that something else reads too.
"""
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.fuse_rmsnorm_quant import only_quantized, quant_args
from graphinfer.passes.match import is_op
from graphinfer.passes.utils import GRAPHINFER


class FuseSiluMulQuantPass(Pass):
    name = "fuse_silu_mul_quant"
    description = "dynamic_quant(silu_and_mul(x)) -> silu_and_mul_quant(x)"

    def apply(self, gm: fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        for dq in list(graph.nodes):
            if not is_op(dq, GRAPHINFER.dynamic_quant) or not is_op(act := dq.args[0], GRAPHINFER.silu_and_mul):
                continue
            if not only_quantized(act, dq):
                self.decline(f"{act.name}: the activation has other users")
                continue
            with graph.inserting_before(dq):
                fused = graph.call_function(GRAPHINFER.silu_and_mul_quant.default, (act.args[0], *quant_args(dq)))
            dq.replace_all_uses_with(fused)
            graph.erase_node(dq)
            graph.erase_node(act)
            matches += 1
        return matches
