"""canon_rms_norm: an RMSNorm spelled in torch ops (transformers' modeling code, model_impl="transformers") becomes
graphinfer::rms_norm, after which fuse_add_rmsnorm and fuse_qknorm_rope see it as they see a native model's.

Matches, around each rsqrt:
    h = x.to(float32) | x.float() | x          (the upcast, if any)
    n = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = w * n.to(x.dtype)                    (Llama, Qwen, Mistral, ...: either operand order)
    out = (w * n).to(x.dtype)                  (OLMo 2, gpt-oss: scaled in fp32, then cast)
    out = (n * (1.0 + w.float())).type_as(x)   (Gemma's (1 + w) form)
where w is a parameter and every intermediate has no other user.
Produces: graphinfer::rms_norm(x, w, eps), whose reference is Llama's form exactly; Gemma's norms get a parameter
`weight_plus_one` = 1 + w beside their weight (the op scales by it in the model's dtype, where Gemma, OLMo 2 and
gpt-oss scale in fp32: within a rounding in bf16, equal in fp32).
Declines: a normalised value used elsewhere, an epsilon or scale that is not a constant.
"""
import operator

import torch
from torch import fx, nn

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, get_param, is_method, is_op, single_use
from graphinfer.passes.utils import GRAPHINFER


def _upcast_source(h: fx.Node) -> fx.Node:
    """x if h is x.to(torch.float32) / x.float(), else h."""
    if is_method(h, "float") or (is_method(h, "to") and arg(h, 1, "dtype") is torch.float32):
        return h.args[0]
    return h


def _other(node: fx.Node, one) -> object | None:
    """The other operand of a binary node when one of them is `one` (a node, or a constant compared by value)."""
    def same(x) -> bool:
        return x is one or (not isinstance(x, fx.Node) and not isinstance(one, fx.Node) and x == one)

    a, b = node.args[:2]
    return b if same(a) else a if same(b) else None


class CanonRMSNormPass(Pass):
    name = "canon_rms_norm"
    description = "RMSNorm spelled in torch ops (transformers' code) -> graphinfer::rms_norm"

    def _denominator(self, rsqrt: fx.Node):
        """(h, eps) if rsqrt is rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)."""
        add = rsqrt.args[0]
        if not is_op(add, operator.add) or not single_use(add):
            return None
        for mean, eps in (add.args[:2], reversed(add.args[:2])):
            if is_method(mean, "mean") and isinstance(eps, float) and single_use(mean) \
                    and arg(mean, 1, "dim") in (-1, (-1,), [-1]) and arg(mean, 2, "keepdim") is True:
                pow_ = mean.args[0]
                if is_method(pow_, "pow") and arg(pow_, 1, "exponent") == 2 and single_use(pow_):
                    return pow_.args[0], eps
        return None

    def _scale(self, gm: fx.GraphModule, n: fx.Node, x: fx.Node):
        """(out, weight get_attr node, gemma) for the scale after the normalised value n."""
        if not single_use(n):
            return None
        user = next(iter(n.users))
        if is_method(user, "to") and single_use(user):  # Llama: w * n.to(x.dtype)
            mul = next(iter(user.users))
            w = _other(mul, user) if is_op(mul, operator.mul) else None
            if isinstance(w, fx.Node) and w.op == "get_attr":
                return mul, w, False
            return None
        if is_op(user, operator.mul) and single_use(user):
            cast = next(iter(user.users))
            w = _other(user, n)
            if isinstance(w, fx.Node) and w.op == "get_attr" and (is_method(cast, "to") or (
                    is_method(cast, "type_as") and cast.args[1] is x)):  # OLMo 2, gpt-oss: (w * n).to(x.dtype)
                return cast, w, False
            one_plus = w  # Gemma: (n * (1.0 + w.float())).type_as(x)
            if is_op(one_plus, operator.add) and 1.0 in one_plus.args[:2] and is_method(cast, "type_as") \
                    and cast.args[1] is x:
                w = _other(one_plus, 1.0)
                w = w.args[0] if is_method(w, "float") else w
                if isinstance(w, fx.Node) and w.op == "get_attr":
                    return cast, w, True
        return None

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for rsqrt in list(gm.graph.nodes):
            if not is_op(rsqrt, torch.rsqrt) or (den := self._denominator(rsqrt)) is None:
                continue
            h, eps = den
            n = next((u for u in rsqrt.users if is_op(u, operator.mul) and _other(u, rsqrt) is h), None)
            x = _upcast_source(h)
            if n is None or (found := self._scale(gm, n, x)) is None:
                self.decline(f"rsqrt at {rsqrt.name}: the normalised value is not only scaled by a weight")
                continue
            out, w, gemma = found
            if gemma:
                owner, _, _ = w.target.rpartition(".")
                module = gm.get_submodule(owner)
                module.weight_plus_one = nn.Parameter(1.0 + get_param(gm, w), requires_grad=False)
                with gm.graph.inserting_before(out):
                    w = gm.graph.get_attr(f"{owner}.weight_plus_one")
            with gm.graph.inserting_before(out):
                norm = gm.graph.call_function(GRAPHINFER.rms_norm.default, (x, w, eps))
            if "example_value" in out.meta:  # its shape, for later passes that read shapes (canon_rotary)
                norm.meta["example_value"] = out.meta["example_value"]
            out.replace_all_uses_with(norm)
            matches += 1
        gm.graph.eliminate_dead_code()
        return matches
