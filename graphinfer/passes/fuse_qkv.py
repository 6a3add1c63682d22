"""fuse_qkv: the q, k and v projections of one input become one projection and a split.

Matches: Linear nodes reading the same input where, following each one's users through views, reshapes
transposes and RMSNorms (Qwen3's q/k norm), one reaches graphinfer::rotary_embedding as the query, one as the key, and
one reaches graphinfer::reshape_and_cache as the value. Any GQA sizes; biases (Qwen2) are concatenated too.
Other Linears of the same input (a fourth projection) stay as they are, with a note in the report.
Produces: `<parent>.qkv_proj` = Linear(cat(Wq, Wk, Wv), cat(bq, bk, bv)) and `.split([q, kv, kv], dim=-1)`,
whose pieces replace the three projections' outputs. The fused weights are built once, here.
Declines: three or more projections of one input without exactly one query, one key and one value as above,
or whose biases or dtypes differ (reason in the report).
"""
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, is_method, is_op, is_view, walk_users
from graphinfer.passes.utils import GRAPHINFER, fuse_linears, is_linear, sibling_submodule, split_outputs


def _view_or_norm(node: fx.Node) -> bool:  # transposes: transformers' [1, heads, T, d] layout (Gemma 3's q/k norms)
    return is_view(node) or is_method(node, "transpose") or is_op(node, GRAPHINFER.rms_norm)


def _role(node: fx.Node) -> str | None:
    """'q' / 'k' / 'v' if node's value reaches rotary_embedding's query / key or the KV write's value."""
    for user, value in walk_users(node, through=_view_or_norm, depth=8):
        if is_op(user, GRAPHINFER.rotary_embedding):
            if arg(user, 1, "query") is value:
                return "q"
            if arg(user, 2, "key") is value:
                return "k"
        if is_op(user, GRAPHINFER.reshape_and_cache) and arg(user, 1, "value") is value:
            return "v"
    return None


class FuseQKVPass(Pass):
    name = "fuse_qkv"
    description = "q/k/v projections of one input -> one fused projection + split"

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for x in list(gm.graph.nodes):
            linears = [u for u in x.users if is_linear(gm, u) and u.args == (x,)]
            if len(linears) < 3:
                continue
            roles: dict[str | None, list[fx.Node]] = {}
            for n in linears:
                roles.setdefault(_role(n), []).append(n)
            if any(len(roles.get(r, ())) != 1 for r in "qkv"):
                found = {r: [n.target for n in ns] for r, ns in roles.items()}
                self.decline(f"{[n.target for n in linears]}: not a query/key/value triple (roles {found})")
                continue
            q, k, v = roles["q"][0], roles["k"][0], roles["v"][0]
            fused = fuse_linears(gm, [q, k, v], sibling_submodule(q.target, "qkv_proj"))
            if fused is None:
                self.decline(f"{q.target}: q/k/v differ in bias or dtype")
                continue
            if others := [n.target for n in linears if n not in (q, k, v)]:
                self.decline(f"{q.target}: the input also feeds {others}, left unfused (only q/k/v are)")
            sizes = [gm.get_submodule(n.target).out_features for n in (q, k, v)]
            for old, piece in zip((q, k, v), split_outputs(gm.graph, fused, sizes)):
                old.replace_all_uses_with(piece)
                gm.graph.erase_node(old)
            matches += 1
        return matches
