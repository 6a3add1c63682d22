"""fuse_qknorm_rope: Qwen3's attention prologue (split of the fused qkv output, per-head RMSNorm of q and of k,
rotary embedding) becomes one graphinfer::qk_norm_rope: one kernel launch per layer instead of three
(vLLM's fused_qk_norm_rope, vLLM-Ascend's QKNormRopeFusionPass). Runs after fuse_qkv, whose split it reads.

Matches, walking back from each graphinfer::rotary_embedding(positions, q, k, head_size, cache, is_neox):
q (and k) = [view] <- rms_norm(view(split[0] (k: split[1]), ..., head_size), weight, eps), where split is
`qkv.split([H * head_size, Hkv * head_size, Hkv * head_size], dim=-1)`; neox or GPT-J rotary, full or partial.
Produces: qk_norm_rope(qkv, H, Hkv, head_size, q_weight, k_weight, eps, positions, cache, is_neox) -> (q, k, v):
the rotary's outputs become its q and k, split[2] (v, read by the KV-cache write) its v; the chain is erased.
Then the KV-cache write: where the op's k and v feed one reshape_and_cache (as key and value, through views)
and nothing else, and nothing between the op and the write touches the caches, the pair becomes
qk_norm_rope_cache(<the same args>, key_cache, value_cache, slot_mapping) -> q, placed at the op (the write
moves up): one launch per layer for split + norms + rope + cache write. Attention reads k and v from the
cache only, so nothing else needs them in a model; otherwise qk_norm_rope stays, with the reason reported.
Rotaries with neither input RMSNormed (Llama, Qwen2) are no candidate: nothing to report. Declines (reason in
the report): only one of q and k normed; different eps for q and k; a norm not over the head dim; q/k not two
pieces of one three-way split of the last dim sized by the heads; chain values used elsewhere.
"""
import operator

from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import (arg, get_param, getitem_of, hoist_inputs, is_call, is_op, is_view, target_name,
                                     used_only_by, walk_users)
from graphinfer.passes.utils import GRAPHINFER

_ROTARY_ARGS = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox")


def _normed(value) -> fx.Node | None:
    """The rms_norm that a rotary input is (or is a view of), else None."""
    norm = value.args[0] if is_view(value) else value
    return norm if is_op(norm, GRAPHINFER.rms_norm) else None


def _shape(view: fx.Node) -> tuple:
    """The sizes a view asks for: x.view(a, b, d) or x.view((a, b, d)) (transformers' spelling)."""
    return tuple(view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else view.args[1:])


def _last_dim(view: fx.Node):
    shape = _shape(view)
    return shape[-1] if shape else None


def _index(node: fx.Node):
    """i if node is x[i], else None."""
    return node.args[1] if is_op(node, operator.getitem) else None


class FuseQKNormRopePass(Pass):
    name = "fuse_qknorm_rope"
    description = ("qkv split + per-head q/k rms_norm + rotary_embedding -> qk_norm_rope; with the KV-cache write "
                   "that follows -> qk_norm_rope_cache")

    def _side(self, gm, rot: fx.Node, index: int, head_size: int):
        """For q (index 0) or k (1): (chain from the split piece to the rotary input, split, weight, eps), or
        None after declining."""
        where, name, value = rot.name, "qk"[index], arg(rot, 1 + index, _ROTARY_ARGS[1 + index])
        norm = _normed(value)
        heads = arg(norm, 0, "x")
        if not (is_view(heads) and _last_dim(heads) == head_size):
            return self.decline(f"{where}: {name} is not normalised per head of {head_size}: its rms_norm reads "
                                f"{heads.name}, not a [..., heads, {head_size}] view")
        weight = arg(norm, 1, "weight")
        w = get_param(gm, weight)
        if w is not None and tuple(w.shape) != (head_size,):
            return self.decline(f"{where}: {name}'s norm weight has shape {tuple(w.shape)}, not ({head_size},)")
        piece = heads.args[0]
        split = getitem_of(piece, index)
        if not is_call(split, "split"):
            return self.decline(f"{where}: {name} is not piece {index} of a split of a fused qkv output "
                                f"(run fuse_qkv first)")
        chain = [piece, heads, norm] + ([value] if value is not norm else [])
        for node, user in zip(chain, chain[1:] + [rot]):
            if not used_only_by(node, [user]):
                return self.decline(f"{where}: {node.name} ({name}) is also used outside the norm + rotary chain")
        return chain, split, weight, arg(norm, 2, "eps")

    def _match(self, gm: fx.GraphModule, rot: fx.Node):
        """(qk_norm_rope args, split, q chain, k chain), or None (no candidate, or declined)."""
        positions, q, k, head_size, cache, is_neox = (arg(rot, i, n) for i, n in enumerate(_ROTARY_ARGS))
        q_norm, k_norm = _normed(q), _normed(k)
        if q_norm is None and k_norm is None:
            return None  # no q/k norm (Llama, Qwen2): not a candidate
        where = rot.name
        if q_norm is None or k_norm is None:
            return self.decline(f"{where}: only the {'key' if q_norm is None else 'query'} is RMSNormed before "
                                f"rotary")
        if not isinstance(head_size, int):
            return self.decline(f"{where}: rotary's head_size is not a constant")
        q_side = self._side(gm, rot, 0, head_size)
        k_side = q_side and self._side(gm, rot, 1, head_size)
        if not k_side:
            return None
        (q_chain, split, q_weight, q_eps), (k_chain, k_split, k_weight, k_eps) = q_side, k_side
        if q_eps != k_eps:
            return self.decline(f"{where}: q and k norms use different eps ({q_eps} vs {k_eps})")
        sizes = arg(split, 1, "split_size")
        whole_heads = isinstance(sizes, (list, tuple)) and len(sizes) == 3 and sizes[1] == sizes[2] \
            and all(isinstance(s, int) and s % head_size == 0 for s in sizes)
        if k_split is not split or arg(split, 2, "dim", 0) != -1 or not whole_heads:
            return self.decline(f"{where}: q and k are not pieces of one split of the last dim into "
                                f"[q, kv, kv] whole heads of {head_size}")
        if any(_index(u) not in (0, 1) for u in rot.users) or any(_index(u) not in (0, 1, 2) for u in split.users):
            return self.decline(f"{where}: the rotary's or the split's outputs are used other than by index")
        args = (split.args[0], sizes[0] // head_size, sizes[1] // head_size, head_size, q_weight, k_weight, q_eps,
                positions, cache, is_neox)
        batched = _shape(q_chain[1])[0] == 1 and len(_shape(q_chain[1])) == 4  # transformers' [1, T, heads, D]
        return args, split, q_chain, k_chain, sum(sizes) if batched else None

    def apply(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        matches = 0
        for rot in list(g.nodes):
            if not is_op(rot, GRAPHINFER.rotary_embedding) or (found := self._match(gm, rot)) is None:
                continue
            args, split, q_chain, k_chain, flatten_to = found
            with g.inserting_before(rot):
                if flatten_to is not None:  # a leading batch dim of 1 (transformers' layout): the op takes [T, qkv]
                    args = (g.call_method("reshape", (args[0], -1, flatten_to)), *args[1:])
                fused = g.call_function(GRAPHINFER.qk_norm_rope.default, args)
                outs = [g.call_function(operator.getitem, (fused, i)) for i in range(3)]
                for i, chain in enumerate((q_chain, k_chain)):
                    shaped = chain[-1] if is_view(chain[-1]) else chain[1]  # what gives rotary's input its shape
                    if len(shaped.args) != 3:  # not [T, H * D] like the op's outputs: view them the same way
                        outs[i] = g.create_node(shaped.op, shaped.target, (outs[i], *shaped.args[1:]), shaped.kwargs)
            for user in list(rot.users):  # rot[0] -> q, rot[1] -> k
                user.replace_all_uses_with(outs[user.args[1]])
                g.erase_node(user)
            g.erase_node(rot)
            for node in reversed(q_chain + k_chain):
                g.erase_node(node)
            for piece in list(split.users):  # only v is left: the KV-cache write reads the op's copy
                piece.replace_all_uses_with(outs[2])
                g.erase_node(piece)
            g.erase_node(split)
            hoist_inputs(g)  # a user of v that came before the rotary pulls the op up
            self._fold_cache_write(g, fused)
            matches += 1
        return matches

    def _fold_cache_write(self, g: fx.Graph, fused: fx.Node) -> None:
        """qk_norm_rope + the reshape_and_cache of its k and v -> qk_norm_rope_cache, or decline with the reason."""
        outs = {u.args[1]: u for u in fused.users}  # fused[i]: q, k, v
        reads = [[(user, value) for user, value in walk_users(outs[i])  # what reads k / v, past their views
                  if not (is_view(user) and user.args[0] is value)] if i in outs else [] for i in (1, 2)]
        write = reads[0][0][0] if reads[0] else None
        if not (is_op(write, GRAPHINFER.reshape_and_cache) and [len(r) for r in reads] == [1, 1]
                and reads[1][0][0] is write and arg(write, 0, "key") is reads[0][0][1]
                and arg(write, 1, "value") is reads[1][0][1]):
            used = ", ".join(sorted({u.name for r in reads for u, _ in r})) or "nothing"
            return self.decline(f"{fused.name}: its k and v are not just the key and value of one reshape_and_cache "
                                f"(used by: {used}); the KV-cache write stays a launch of its own")
        caches = (arg(write, 2, "key_cache"), arg(write, 3, "value_cache"))
        if write.users:
            return self.decline(f"{fused.name}: the result of the KV-cache write {write.name} is used")
        if (other := _cache_access_between(fused, write, caches)) is not None:
            return self.decline(f"{fused.name}: the KV-cache write {write.name} cannot move up into it: {other.name} "
                                f"({target_name(other)}) may touch the caches between them")
        with g.inserting_before(fused):
            q = g.call_function(GRAPHINFER.qk_norm_rope_cache.default,
                                (*fused.args, *caches, arg(write, 4, "slot_mapping")))
        if 0 in outs:
            outs[0].replace_all_uses_with(q)
        g.erase_node(write)
        dead = {fused, *outs.values(), *(u for v in outs.values() for u, _ in walk_users(v))}  # k, v and views
        for node in reversed(list(g.nodes)):  # users before what they read
            if node in dead:
                g.erase_node(node)
        hoist_inputs(g)  # the caches and the slot mapping were read after the op


def _cache_access_between(start: fx.Node, end: fx.Node, caches) -> fx.Node | None:
    """The first node strictly between start and end with side effects or reading one of the caches (by node, or
    by the buffer a get_attr names), else None: moving the write from end to start must not reorder it with them."""
    targets = {c.target for c in caches if isinstance(c, fx.Node) and c.op == "get_attr"}
    node = start.next
    while node is not end:
        if node.is_impure() or any(i in caches or (i.op == "get_attr" and i.target in targets)
                                   for i in node.all_input_nodes):
            return node
        node = node.next
    return None
