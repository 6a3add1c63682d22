"""fuse_add_rmsnorm: a residual add feeding rms_norm becomes one add_rms_norm with two outputs.

Matches: rms_norm(a + b, weight, eps) where a, b and weight are tensors (graph nodes). The sum's other users
(the next residual) read the op's second output, the norm's users its first.
Produces: graphinfer::add_rms_norm(a, b, weight, eps) -> (normed, a + b), placed where the add was (a weight
read that came later moves up; see match.replace_pattern).
"""
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import replace_pattern
from graphinfer.passes.utils import GRAPHINFER


def _pattern(x, residual, weight, eps):
    total = x + residual
    return GRAPHINFER.rms_norm.default(total, weight, eps), total


def _replacement(x, residual, weight, eps):
    out = GRAPHINFER.add_rms_norm.default(x, residual, weight, eps)
    return out[0], out[1]


def _tensors(match, original, pattern) -> bool:
    """The pattern's placeholders also match constants (x + 1.0); add_rms_norm takes tensors only."""
    x, residual, weight, _ = match.placeholder_nodes
    return all(isinstance(n, fx.Node) for n in (x, residual, weight))


class FuseAddRMSNormPass(Pass):
    name = "fuse_add_rmsnorm"
    description = "rms_norm(x + residual) -> add_rms_norm(x, residual) returning (normed, new residual)"

    def apply(self, gm: fx.GraphModule) -> int:
        return replace_pattern(gm, _pattern, _replacement, match_filters=[_tensors])
