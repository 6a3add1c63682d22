"""canon_rotary: rotary embedding spelled in torch ops (transformers' apply_rotary_pos_emb, model_impl="transformers")
becomes graphinfer::rotary_embedding over a cos/sin cache, after which fuse_qkv and fuse_qknorm_rope see q, k and v
as they see a native model's.

Matches, per layer, the two rotations that share one cos and one sin (neox style, transformers' rotate_half):
    x_embed = x * cos + cat((-x[..., d/2:], x[..., :d/2]), -1) * sin      (either operand order)
with x [1, heads, T, d] (transformers' layout), cos / sin computed from the step's positions alone (what the model's
rotary module does each step). The one that reaches the KV-cache write is the key, the other the query.
Produces: a cos/sin cache [max_position_embeddings, d] = cat(cos, sin) over the first d / 2 columns, computed once
here by running the graph's own cos / sin nodes on every position (so any RoPE scaling the model's code applies is
reproduced exactly), held as `<rotary module>.cos_sin_cache`; and rotary_embedding(positions, q, k, d, cache, True)
on q and k flattened to [T, heads * d], whose outputs take the rotations' place in transformers' layout.
Declines: partial or interleaved rotary, a cos / sin that depends on more than the positions (left as torch ops).
"""
import operator

import torch
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import is_method, is_op, walk_users
from graphinfer.passes.utils import GRAPHINFER


def _half_slice(node, x: fx.Node, first: bool) -> int | None:
    """d/2 if node is x[..., :d/2] (first) or x[..., d/2:] (not first)."""
    if not (is_op(node, operator.getitem) and node.args[0] is x and isinstance(node.args[1], tuple)):
        return None
    index = node.args[1]
    if len(index) != 2 or index[0] is not Ellipsis or not isinstance(index[1], slice) or index[1].step is not None:
        return None
    s = index[1]
    return s.stop if first and s.start is None else s.start if not first and s.stop is None else None


def _rotate_half_of(node) -> fx.Node | None:
    """x if node is cat((-x[..., h:], x[..., :h]), -1)."""
    if not (is_op(node, torch.cat) and len(node.args) >= 1 and len(node.args[0]) == 2):
        return None
    if node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) != -1:
        return None
    neg, lo = node.args[0]
    if not (is_op(neg, operator.neg) and isinstance(lo, fx.Node)):
        return None
    x = lo.args[0] if lo.args else None
    h1, h2 = _half_slice(lo, x, first=True), _half_slice(neg.args[0], x, first=False)
    return x if h1 is not None and h1 == h2 else None


def _rotation(add: fx.Node):
    """(x, cos, sin) if add is x * cos + rotate_half(x) * sin."""
    if not is_op(add, operator.add):
        return None
    for m1, m2 in (add.args[:2], reversed(add.args[:2])):
        if not (is_op(m1, operator.mul) and is_op(m2, operator.mul)):
            continue
        for rot, sin in (m2.args[:2], reversed(m2.args[:2])):
            x = _rotate_half_of(rot)
            if x is not None and x in m1.args[:2]:
                cos = m1.args[1] if m1.args[0] is x else m1.args[0]
                return x, cos, sin
    return None


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen, order, stack = set(), [], [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack += [a for a in n.all_input_nodes]
    return order


def _reaches_cache_write(node: fx.Node) -> bool:
    through = lambda n: is_method(n, "transpose", "view", "reshape", "contiguous", "flatten") or \
        is_op(n, operator.getitem)  # noqa: E731
    return any(is_op(u, GRAPHINFER.reshape_and_cache) for u, _ in walk_users(node, through=through, depth=8))


class CanonRotaryPass(Pass):
    name = "canon_rotary"
    description = "rotary embedding spelled in torch ops (transformers' code) -> graphinfer::rotary_embedding"

    def _cache(self, gm: fx.GraphModule, positions: fx.Node, cos: fx.Node, sin: fx.Node, d: int) -> torch.Tensor | None:
        """cat(cos, sin)[:, first d/2 columns each] for every position, from the graph's own cos / sin nodes."""
        nodes = set(_ancestors(cos)) | set(_ancestors(sin))
        if {n for n in nodes if n.op == "placeholder"} != {positions}:
            return None
        sub = fx.Graph()
        env = {positions: sub.placeholder("positions")}
        for n in gm.graph.nodes:
            if n in nodes and n is not positions:
                env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output((env[cos], env[sin]))
        fn = fx.GraphModule(gm, sub)
        max_pos = gm.meta.get("max_position_embeddings")  # set by the capture (compiler/transformers_capture.py)
        if max_pos is None:
            return None
        device = next(gm.parameters()).device
        with torch.no_grad():
            c, s = fn(torch.arange(max_pos, device=device))
        c, s = c.reshape(max_pos, -1)[:, :d // 2], s.reshape(max_pos, -1)[:, :d // 2]
        return torch.cat((c, s), dim=-1).float()

    def apply(self, gm: fx.GraphModule) -> int:
        positions = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "positions"), None)
        if positions is None:
            return 0
        groups: dict[tuple, list] = {}
        for node in gm.graph.nodes:
            if (found := _rotation(node)) is not None:
                x, cos, sin = found
                groups.setdefault((cos, sin), []).append((node, x))
        matches = 0
        caches: dict[int, str] = {}
        for (cos, sin), rots in groups.items():
            if len(rots) != 2:
                self.decline(f"{cos.name}: {len(rots)} rotations share one cos/sin (a query and a key expected)")
                continue
            keys = [r for r in rots if _reaches_cache_write(r[0])]
            if len(keys) != 1:
                self.decline(f"{cos.name}: cannot tell the query's rotation from the key's")
                continue
            (k_embed, k), (q_embed, q) = keys[0], next(r for r in rots if r is not keys[0])
            shapes = [x.meta.get("example_value") for x in (q, k)]
            if any(s is None or s.dim() != 4 or s.shape[0] != 1 for s in shapes):
                self.decline(f"{q.name}: not transformers' [1, heads, T, head_dim] layout")
                continue
            (_, hq, _, d), (_, hk, _, _) = (s.shape for s in shapes)
            if id(cos) not in caches:
                cache = self._cache(gm, positions, cos, sin, d)
                if cache is None:
                    self.decline(f"{cos.name}: cos / sin depend on more than the positions")
                    continue
                name = f"rotary_cos_sin_cache_{len(caches)}"
                gm.register_buffer(name, cache.to(next(gm.parameters()).device))
                caches[id(cos)] = name
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            with gm.graph.inserting_before(min(q_embed, k_embed, key=order.get)):
                flat = [gm.graph.call_method("reshape", (gm.graph.call_method("transpose", (x, 1, 2)), -1, int(h * d)))
                        for x, h in ((q, hq), (k, hk))]
                cache_node = gm.graph.get_attr(caches[id(cos)])
                rot = gm.graph.call_function(GRAPHINFER.rotary_embedding.default,
                                             (positions, flat[0], flat[1], int(d), cache_node, True))
                for i, (embed, heads) in enumerate(((q_embed, hq), (k_embed, hk))):
                    out = gm.graph.call_function(operator.getitem, (rot, i))
                    view = gm.graph.call_method("view", (out, 1, -1, int(heads), int(d)))
                    embed.replace_all_uses_with(gm.graph.call_method("transpose", (view, 1, 2)))
            matches += 1
        gm.graph.eliminate_dead_code()
        return matches
