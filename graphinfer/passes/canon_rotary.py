"""canon_rotary: rotary embedding spelled in torch ops (transformers' apply_rotary_pos_emb, model_impl="transformers")
becomes graphinfer::rotary_embedding over a cos/sin cache, after which fuse_qkv and fuse_qknorm_rope see q, k and v
as they see a native model's.

Matches, per layer, the two rotations that share one cos and one sin:
    x_embed = x * cos + rotate(x) * sin                                   (either operand order)
    rotate(x) = cat((-x[..., d/2:], x[..., :d/2]), -1)                     neox (Llama's rotate_half), or
                stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)        interleaved pairs (GPT-J: GLM, Ernie, Cohere)
    x_embed = cat((a * cos - b * sin, b * cos + a * sin), -1), a, b = x.chunk(2, -1)   neox, cos of d / 2 (gpt-oss)
with x [1, heads, T, d] (transformers' layout), casts to fp32 around x or rotate(x) looked through (Ernie, Cohere
rotate in fp32), cos / sin computed from the step's positions alone (what the model's rotary module does each step).
Partial rotary: x = q[..., :r] and x_embed = cat((x_embed, q[..., r:]), -1) (GLM, Phi-3, StableLM): the whole
cat is replaced. The one that reaches the KV-cache write is the key, the other the query.
Produces: a cos/sin cache [max_position_embeddings, r] = cat(cos, sin) over the r / 2 frequencies, computed once here
by running the graph's own cos / sin nodes on every position (so any RoPE scaling the model's code applies is
reproduced exactly) and checked to repeat in the layout the rotation implies (halves for neox, pairs for
interleaved), held as a buffer of the graph; and rotary_embedding(positions, q, k, d, cache, is_neox) on q and k
flattened to [T, heads * d], whose outputs take the rotations' place in transformers' layout.
Declines: a cos / sin that depends on more than the positions, or on the step's other positions, or does not repeat
as the rotation implies, a query and key rotated differently (left as torch ops).
"""
import operator

import torch
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, is_method, is_op, walk_users
from graphinfer.passes.utils import GRAPHINFER


def _slice_of(node) -> tuple[fx.Node, slice] | None:
    """(x, s) if node is x[..., s]."""
    if not (is_op(node, operator.getitem) and isinstance(node.args[1], tuple) and len(node.args[1]) == 2):
        return None
    ellipsis, s = node.args[1]
    return (node.args[0], s) if ellipsis is Ellipsis and isinstance(s, slice) else None


def _uncast(node):
    """The value before fp32 casts (`x.float()`, `x.to(torch.float32)`)."""
    while is_method(node, "float") or (is_method(node, "to") and torch.float32 in (*node.args[1:],
                                                                                  node.kwargs.get("dtype"))):
        node = node.args[0]
    return node


def _last_dim(node) -> bool:
    """A cat / stack over the last dim."""
    return arg(node, 1, "dim", 0) == -1


def _negated_halves(pair) -> tuple[fx.Node, slice, slice] | None:
    """(x, s, t) if pair is (-x[..., s], x[..., t])."""
    neg, other = pair
    if not is_op(neg, operator.neg):
        return None
    a, b = _slice_of(neg.args[0]), _slice_of(other)
    return (a[0], a[1], b[1]) if a is not None and b is not None and a[0] is b[0] else None


def _neox_rotate_of(node) -> fx.Node | None:
    """x if node is cat((-x[..., h:], x[..., :h]), -1)."""
    if not (is_op(node, torch.cat) and len(node.args[0]) == 2 and _last_dim(node)):
        return None
    if (found := _negated_halves(node.args[0])) is None:
        return None
    x, hi, lo = found
    half = lo.stop
    return x if (lo.start in (None, 0) and lo.step is None and hi.start == half and hi.stop is None
                 and hi.step is None and half is not None) else None


def _interleaved_rotate_of(node) -> fx.Node | None:
    """x if node is stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)."""
    if not ((is_method(node, "flatten") or is_op(node, torch.flatten)) and tuple(node.args[1:]) == (-2,)):
        return None
    stack = node.args[0]
    if not (is_op(stack, torch.stack) and len(stack.args[0]) == 2 and _last_dim(stack)):
        return None
    if (found := _negated_halves(stack.args[0])) is None:
        return None
    x, odd, even = found
    return x if (odd.start, odd.stop, odd.step) == (1, None, 2) and even.start in (None, 0) and \
        (even.stop, even.step) == (None, 2) else None


def _rotation(add: fx.Node):
    """(x, cos, sin, is_neox) if add is x * cos + rotate(x) * sin."""
    if not is_op(add, operator.add):
        return None
    for m1, m2 in (add.args[:2], reversed(add.args[:2])):
        if not (is_op(m1, operator.mul) and is_op(m2, operator.mul)):
            continue
        for rot, sin in (m2.args[:2], reversed(m2.args[:2])):
            rot = _uncast(rot)
            for is_neox, rotate_of in ((True, _neox_rotate_of), (False, _interleaved_rotate_of)):
                x = rotate_of(rot)
                if x is None:
                    continue
                for a, cos in (m1.args[:2], reversed(m1.args[:2])):
                    if isinstance(a, fx.Node) and _uncast(a) is _uncast(x):
                        return _uncast(x), cos, sin, is_neox
    return None


def _chunk_rotation(cat: fx.Node):
    """(x, cos, sin) if cat is cat((a * cos - b * sin, b * cos + a * sin), -1) with a, b = x.chunk(2, -1): neox with a
    cos / sin of d / 2 columns (gpt-oss)."""
    if not (is_op(cat, torch.cat) and len(cat.args[0]) == 2 and _last_dim(cat)):
        return None
    first, second = cat.args[0]
    if not (is_op(first, operator.sub) and is_op(second, operator.add)):
        return None
    halves = {}  # (chunk, index) -> getitem node, via the four products
    products = [first.args[0], first.args[1], second.args[0], second.args[1]]
    if not all(is_op(p, operator.mul) for p in products):
        return None
    for p in products:
        for t in p.args[:2]:
            if is_op(t, operator.getitem) and is_op(t.args[0], torch.chunk) and t.args[1] in (0, 1):
                halves[t.args[1]] = t
    if set(halves) != {0, 1} or halves[0].args[0] is not halves[1].args[0]:
        return None
    chunk = halves[0].args[0]
    if arg(chunk, 1, "chunks") != 2 or arg(chunk, 2, "dim", 0) != -1:
        return None
    other = lambda m, t: m.args[1] if m.args[0] is t else m.args[0] if m.args[1] is t else None  # noqa: E731
    a, b = halves[0], halves[1]
    cos, sin = other(products[0], a), other(products[1], b)
    if cos is None or sin is None or other(products[2], b) is not cos or other(products[3], a) is not sin:
        return None
    return chunk.args[0], cos, sin


def _partial(x: fx.Node, embed: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(q, cat) if x is q[..., :r] and embed's one user is cat((embed, q[..., r:]), -1): a partial rotary."""
    found = _slice_of(x)
    if found is None or len(embed.users) != 1:
        return None
    q, s = found
    (cat,) = embed.users
    if not (s.start in (None, 0) and s.step is None and isinstance(s.stop, int) and is_op(cat, torch.cat)
            and len(cat.args[0]) == 2 and cat.args[0][0] is embed and _last_dim(cat)):
        return None
    rest = _slice_of(cat.args[0][1])
    return (q, cat) if rest is not None and rest[0] is q and (rest[1].start, rest[1].stop, rest[1].step) == \
        (s.stop, None, None) else None


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
    through = lambda n: is_method(n, "transpose", "view", "reshape", "contiguous", "flatten", "to", "float") or \
        is_op(n, operator.getitem)  # noqa: E731
    return any(is_op(u, GRAPHINFER.reshape_and_cache) for u, _ in walk_users(node, through=through, depth=8))


class CanonRotaryPass(Pass):
    name = "canon_rotary"
    description = "rotary embedding spelled in torch ops (transformers' code) -> graphinfer::rotary_embedding"

    def _cache(self, gm: fx.GraphModule, positions: fx.Node, cos: fx.Node, sin: fx.Node,
               layout: str) -> torch.Tensor | str:
        """cat(cos, sin) over the r / 2 frequencies for every position, from the graph's own cos / sin nodes; or why
        not."""
        nodes = set(_ancestors(cos)) | set(_ancestors(sin))
        if {n for n in nodes if n.op == "placeholder"} != {positions}:
            return "cos / sin depend on more than the positions"
        max_pos = gm.meta.get("max_position_embeddings")  # set by the capture (compiler/transformers_capture.py)
        if max_pos is None:
            return "the graph does not say its max_position_embeddings"
        sub = fx.Graph()
        env = {positions: sub.placeholder("positions")}
        for n in gm.graph.nodes:
            if n in nodes and n is not positions:
                env[n] = sub.node_copy(n, lambda a: env[a])
        sub.output((env[cos], env[sin]))
        device, fn = next(gm.parameters()).device, fx.GraphModule(gm, sub)
        with torch.no_grad():
            c, s = fn(torch.arange(max_pos, device=device))
            few = torch.tensor([0, 1, max_pos // 2], device=device)
            c_few = fn(few)[0].reshape(len(few), -1)
        c, s = c.reshape(max_pos, -1), s.reshape(max_pos, -1)
        if not torch.equal(c_few, c[few]):  # e.g. longrope's switch on the batch's largest position
            return "cos / sin of a position depend on the other positions of the step"
        if layout == "neox_half":  # cos = f already
            return torch.cat((c, s), dim=-1).float()
        if layout == "neox":  # cos = cat(f, f)
            half = c.shape[1] // 2
            parts = (c[:, :half], c[:, half:], s[:, :half], s[:, half:])
        else:  # cos = f.repeat_interleave(2)
            parts = (c[:, ::2], c[:, 1::2], s[:, ::2], s[:, 1::2])
        if not (torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])):
            return f"cos / sin do not repeat as a{' neox' if layout == 'neox' else 'n interleaved'} rotation's do"
        return torch.cat((parts[0], parts[2]), dim=-1).float()

    def apply(self, gm: fx.GraphModule) -> int:
        positions = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "positions"), None)
        if positions is None:
            return 0
        groups: dict[tuple, list] = {}
        for node in gm.graph.nodes:
            if (found := _rotation(node)) is not None:
                x, cos, sin, is_neox = found
                q, out = _partial(x, node) or (x, node)  # the whole head, and the node its rotation replaces
                groups.setdefault((cos, sin), []).append((out, q, "neox" if is_neox else "interleaved", q is not x))
            elif (found := _chunk_rotation(node)) is not None:
                x, cos, sin = found
                groups.setdefault((cos, sin), []).append((node, x, "neox_half", False))
        matches = 0
        caches: dict[int, str] = {}
        for (cos, sin), rots in groups.items():
            if len(rots) != 2:
                self.decline(f"{cos.name}: {len(rots)} rotations share one cos/sin (a query and a key expected)")
                continue
            if rots[0][2:] != rots[1][2:]:
                self.decline(f"{cos.name}: the query and the key are rotated differently")
                continue
            keys = [r for r in rots if _reaches_cache_write(r[0])]
            if len(keys) != 1:
                self.decline(f"{cos.name}: cannot tell the query's rotation from the key's")
                continue
            (k_out, k, layout, _), (q_out, q, _, _) = keys[0], next(r for r in rots if r is not keys[0])
            shapes = [x.meta.get("example_value") for x in (q, k)]
            if any(s is None or s.dim() != 4 or s.shape[0] != 1 for s in shapes):
                self.decline(f"{q.name}: not transformers' [1, heads, T, head_dim] layout")
                continue
            (_, hq, _, d), (_, hk, _, _) = (s.shape for s in shapes)
            if id(cos) not in caches:
                cache = self._cache(gm, positions, cos, sin, layout)
                if isinstance(cache, str):
                    self.decline(f"{cos.name}: {cache}")
                    continue
                name = f"rotary_cos_sin_cache_{len(caches)}"
                gm.register_buffer(name, cache.to(next(gm.parameters()).device))
                caches[id(cos)] = name
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            with gm.graph.inserting_before(min(q_out, k_out, key=order.get)):
                flat = [gm.graph.call_method("reshape", (gm.graph.call_method("transpose", (x, 1, 2)), -1, int(h * d)))
                        for x, h in ((q, hq), (k, hk))]
                cache_node = gm.graph.get_attr(caches[id(cos)])
                rot = gm.graph.call_function(GRAPHINFER.rotary_embedding.default,
                                             (positions, flat[0], flat[1], int(d), cache_node, layout != "interleaved"))
                for i, (out, heads) in enumerate(((q_out, hq), (k_out, hk))):
                    got = gm.graph.call_function(operator.getitem, (rot, i))
                    view = gm.graph.call_method("view", (got, 1, -1, int(heads), int(d)))
                    out.replace_all_uses_with(gm.graph.call_method("transpose", (view, 1, 2)))
            matches += 1
        gm.graph.eliminate_dead_code()
        return matches
