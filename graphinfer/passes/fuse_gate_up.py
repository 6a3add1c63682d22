"""fuse_gate_up: act(gate_proj(x)) * up_proj(x) becomes act_and_mul(gate_up_proj(x)).

Matches: a multiply of act(Linear_a(x)) and Linear_b(x) (either operand order) where both Linears read the same x
and their outputs and the activation's are used nowhere else; act is F.silu (SwiGLU: Llama, Qwen, ...) or F.gelu
with approximate "none" or "tanh" (GeGLU: Gemma, Gemma 2 / 3, whose gelu_pytorch_tanh TorchDynamo captures as a call
of F.gelu(x, approximate="tanh")).
Produces: `<parent>.gate_up_proj` = Linear(cat(W_gate, W_up)) (bias concatenated if both have one),
built once here, and graphinfer::silu_and_mul / graphinfer::gelu_and_mul(approximate) on its output (vLLM's
[gate | up] layout).
Declines: when the projections have other users, differ in bias or dtype (reason in the report).
"""
import operator

import torch.nn.functional as F
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, is_op, single_use
from graphinfer.passes.utils import GRAPHINFER, fuse_linears, is_linear, sibling_submodule


def _gated_activation(act) -> tuple | None:
    """(fused op, its arguments after gate_up) for an activation node this pass fuses, else None."""
    if is_op(act, F.silu):
        return GRAPHINFER.silu_and_mul.default, ()
    # approximate is a constant string in the captures; one computed in the graph (a Node) is no match
    if is_op(act, F.gelu) and (approximate := arg(act, 1, "approximate", "none")) in ("none", "tanh"):
        return GRAPHINFER.gelu_and_mul.default, (approximate,)
    return None


class FuseGateUpPass(Pass):
    name = "fuse_gate_up"
    description = "act(gate(x)) * up(x) -> silu_and_mul / gelu_and_mul(gate_up(x)) with one fused projection"

    def _match(self, gm: fx.GraphModule, mul: fx.Node):
        if not is_op(mul, operator.mul) or len(mul.args) != 2:
            return None
        for act, up in (mul.args, reversed(mul.args)):
            if (fused_op := _gated_activation(act)) is not None and is_linear(gm, up):
                gate = act.args[0]
                if is_linear(gm, gate) and gate.args == up.args and gate is not up:
                    if single_use(act) and single_use(gate) and single_use(up):
                        return gate, up, act, fused_op
                    self.decline(f"{gate.target}: gate/up outputs are used elsewhere too")
        return None

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for mul in list(gm.graph.nodes):
            if (found := self._match(gm, mul)) is None:
                continue
            gate, up, act, (op, extra_args) = found
            fused = fuse_linears(gm, [gate, up], sibling_submodule(gate.target, "gate_up_proj"))
            if fused is None:
                self.decline(f"{gate.target}: gate/up differ in bias or dtype")
                continue
            with gm.graph.inserting_after(fused):
                out = gm.graph.call_function(op, (fused, *extra_args))
            mul.replace_all_uses_with(out)
            for old in (mul, act, gate, up):
                gm.graph.erase_node(old)
            matches += 1
        return matches
