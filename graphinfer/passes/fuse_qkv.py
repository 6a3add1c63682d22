"""fuse_qkv: the q, k and v projections of one input become one projection and a split.

Matches: three Linear nodes reading the same input where, following each one's users through views,
reshapes and RMSNorms (Qwen3's q/k norm), one reaches graphinfer::rotary_embedding as the query, one as
the key, and one reaches graphinfer::reshape_and_cache as the value. Any GQA sizes; biases (Qwen2) are
concatenated too.
Produces: `<parent>.qkv_proj` = Linear(cat(Wq, Wk, Wv), cat(bq, bk, bv)) and `.split([q, kv, kv], dim=-1)`,
whose pieces replace the three projections' outputs. The fused weights are built once, here.
Declines: three projections of one input whose roles are not query/key/value as above, or whose biases
or dtypes differ (reason in the report).
"""
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.utils import GRAPHINFER, fuse_linears, is_linear, is_op, sibling_submodule, split_outputs

_TRANSPARENT = ("view", "reshape", "contiguous")


def _role(node: fx.Node, depth: int = 6) -> str | None:
    """'q' / 'k' / 'v' if node's value reaches rotary_embedding's query / key or the KV write's value."""
    for user in node.users:
        if is_op(user, GRAPHINFER.rotary_embedding.default):
            if user.args[1] is node:
                return "q"
            if user.args[2] is node:
                return "k"
        if is_op(user, GRAPHINFER.reshape_and_cache.default) and user.args[1] is node:
            return "v"
        passes_through = (user.op == "call_method" and user.target in _TRANSPARENT) or \
            (is_op(user, GRAPHINFER.rms_norm.default) and user.args[0] is node)
        if depth and passes_through and (role := _role(user, depth - 1)):
            return role
    return None


class FuseQKVPass(Pass):
    name = "fuse_qkv"
    description = "q/k/v projections of one input -> one fused projection + split"

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for x in list(gm.graph.nodes):
            linears = [u for u in x.users if is_linear(gm, u) and u.args == (x,)]
            if len(linears) != 3:
                continue
            roles = {_role(n): n for n in linears}
            if set(roles) != {"q", "k", "v"}:
                self.decline(f"{[n.target for n in linears]}: not a query/key/value triple (roles {list(roles)})")
                continue
            q, k, v = roles["q"], roles["k"], roles["v"]
            fused = fuse_linears(gm, [q, k, v], sibling_submodule(q.target, "qkv_proj"))
            if fused is None:
                self.decline(f"{q.target}: q/k/v differ in bias or dtype")
                continue
            sizes = [gm.get_submodule(n.target).out_features for n in (q, k, v)]
            for old, piece in zip((q, k, v), split_outputs(gm.graph, fused, sizes)):
                old.replace_all_uses_with(piece)
                gm.graph.erase_node(old)
            matches += 1
        return matches
