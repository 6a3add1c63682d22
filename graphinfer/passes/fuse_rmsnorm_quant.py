"""fuse_rmsnorm_quant: an RMSNorm whose output is only quantized becomes one op that also quantizes (vLLM's
RMSNormQuantFusionPass, vLLM-Ascend's AddRMSNormQuant).

Matches: graphinfer::dynamic_quant(rms_norm(x, w, eps), dtype, input_scale), and dynamic_quant of add_rms_norm's
normalised output (its residual output may have any users), where the normalised value has no other user but
reads of its shape, which move to the norm's input (lower_quant_linears makes these from a w8a8 / fp8 model's
linears).
Produces: graphinfer::rms_norm_quant(x, w, eps, dtype, input_scale) -> (codes, scale), or
graphinfer::add_rms_norm_quant(x, residual, w, eps, dtype, input_scale) -> (codes, scale, residual').
Declines: a normalised value that something else reads too (the float output would still be needed).
"""
import operator

from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, getitem_of, is_op
from graphinfer.passes.utils import GRAPHINFER


def quant_args(dq: fx.Node) -> tuple:
    return arg(dq, 1, "quant_dtype"), arg(dq, 2, "input_scale")


def only_quantized(value: fx.Node, dq: fx.Node, same_shape: fx.Node | None = None) -> bool:
    """dq is value's only user, once reads of value's shape (the model's `x.shape[0]`) are moved onto
    same_shape, a node of the same shape, where one is given."""
    shape_reads = [u for u in value.users if u is not dq and u.op == "call_function" and u.target is getattr
                   and u.args[1] == "shape"]
    if len(value.users) != 1 + len(shape_reads) or (shape_reads and same_shape is None):
        return False
    for u in shape_reads:
        u.replace_input_with(value, same_shape)
    return True


class FuseRMSNormQuantPass(Pass):
    name = "fuse_rmsnorm_quant"
    description = "dynamic_quant(rms_norm / add_rms_norm) -> rms_norm_quant / add_rms_norm_quant"

    def apply(self, gm: fx.GraphModule) -> int:
        graph, matches = gm.graph, 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        for dq in list(graph.nodes):
            if not is_op(dq, GRAPHINFER.dynamic_quant):
                continue
            src = dq.args[0]
            if is_op(src, GRAPHINFER.rms_norm):
                if not only_quantized(src, dq, src.args[0]):
                    self.decline(f"{src.name}: the normalised output has other users")
                    continue
                with graph.inserting_before(dq):
                    fused = graph.call_function(GRAPHINFER.rms_norm_quant.default, (*src.args[:3], *quant_args(dq)))
                dq.replace_all_uses_with(fused)
                graph.erase_node(dq)
                graph.erase_node(src)
            elif (norm := getitem_of(src, 0)) is not None and is_op(norm, GRAPHINFER.add_rms_norm):
                if not only_quantized(src, dq, norm.args[0]):
                    self.decline(f"{norm.name}: the normalised output has other users")
                    continue
                residual = [u for u in norm.users if getitem_of(u, 1) is norm]
                if any(order[u] < order[dq] for r in residual for u in r.users):
                    self.decline(f"{norm.name}: the residual is read before the quantization")
                    continue
                with graph.inserting_before(dq):
                    fused = graph.call_function(GRAPHINFER.add_rms_norm_quant.default,
                                                (*norm.args[:4], *quant_args(dq)))
                    new_residual = graph.call_function(operator.getitem, (fused, 2))
                for r in residual:
                    r.replace_all_uses_with(new_residual)
                    graph.erase_node(r)
                dq.replace_all_uses_with(fused)
                graph.erase_node(dq)
                graph.erase_node(src)
                graph.erase_node(norm)
            else:
                continue
            matches += 1
        return matches
