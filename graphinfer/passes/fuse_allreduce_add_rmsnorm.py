"""fuse_allreduce_add_rmsnorm: a tensor-parallel all-reduce feeding the residual add + RMSNorm becomes one
graphinfer::all_reduce_add_rms_norm (vLLM's AllReduceFusionPass), so a platform can run the collective and the
norm as one kernel (on npu, the HCCL all-reduce + AddRmsNorm chain). Runs after fuse_add_rmsnorm, whose
add_rms_norm it reads, and before or after fuse_moe alike (that one ends at the MoE combine, which the
all-reduce reads); at tp 1 the graph has no all-reduce and nothing matches.

Matches: graphinfer::add_rms_norm(a, b, weight, eps) where a or b is graphinfer::all_reduce(x, group) used by
nothing else: per decoder layer, o_proj's all-reduce before post_attention_layernorm and down_proj's (or the
MoE's, after moe_combine / fused_moe) before the next layer's input_layernorm or the final norm. The model
writes `residual + hidden`, so the all-reduce is usually b; where both are, b is taken first.
Produces: all_reduce_add_rms_norm(x, other, weight, eps, group) -> (normed, sum + other), whose two outputs
replace the add_rms_norm's; placed where the add_rms_norm was. Addition commutes exactly in IEEE arithmetic,
so the outputs equal the unfused ones bit for bit.
Not candidates: an all-reduce that feeds anything but an add_rms_norm, e.g. the vocab-parallel embedding's
(read by the first rms_norm, and by the first residual add) or a RowParallelLinear's with a bias added.
Declines (reason in the report): an add_rms_norm whose all-reduce inputs all have other users (or that adds one
all-reduce to itself).
"""
from torch import fx

from graphinfer.distributed.communication_op import all_reduce, all_reduce_add_rms_norm
from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, is_op, single_use
from graphinfer.passes.utils import GRAPHINFER

_ARGS = ("x", "residual", "weight", "eps")


class FuseAllReduceAddRMSNormPass(Pass):
    name = "fuse_allreduce_add_rmsnorm"
    description = "add_rms_norm(all_reduce(x), residual) -> all_reduce_add_rms_norm(x, residual) (tensor parallel)"

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        for norm in list(g.nodes):
            if not is_op(norm, GRAPHINFER.add_rms_norm):
                continue
            a, b, weight, eps = (arg(norm, i, n) for i, n in enumerate(_ARGS))
            reduces = [(r, other) for r, other in ((b, a), (a, b)) if is_op(r, all_reduce)]
            if not reduces:
                continue
            fusable = [(r, other) for r, other in reduces if single_use(r) and other is not r]
            if not fusable:
                users = sorted({u.name for r, _ in reduces for u in r.users if u is not norm}) or ["both addends"]
                self.decline(f"{norm.name}: the all-reduce it adds is also read by {users}; left unfused")
                continue
            reduce, other = fusable[0]
            x, group = arg(reduce, 0, "x"), arg(reduce, 1, "group_name")
            with g.inserting_before(norm):
                fused = g.call_function(all_reduce_add_rms_norm, (x, other, weight, eps, group))
            norm.replace_all_uses_with(fused)  # its users are getitem 0 / 1: the same two outputs
            g.erase_node(norm)
            g.erase_node(reduce)
            matches += 1
        return matches
