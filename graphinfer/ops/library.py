"""Registration of the graphinfer:: op namespace.

Like vLLM's direct_register_custom_op: define + impl on a torch.library.Library (schema inferred from the
type hints), not torch.library.custom_op, whose per-call wrappers cost ~35 us against ~3 us here: that
is milliseconds per decode step for the ~150 op calls of a 30-layer model. The reference impl is
registered as CompositeExplicitAutograd (every device); a platform overrides it per dispatch key
(e.g. "CUDA") with `lib.impl(name, kernel, key)`. Fake (meta) impls use torch.library.register_fake.
"""
import torch

lib = torch.library.Library("graphinfer", "FRAGMENT")  # registrations live as long as this handle


def graphinfer_op(mutates_args: tuple[str, ...] = (), row_wise: bool = False):
    """Decorator: register fn as graphinfer::<fn name> and return the op (an OpOverload). row_wise: each row of its
    outputs depends only on the same row of its token-row inputs (its other tensor arguments are weights, not rows),
    so a graph may run it on a subset of the rows (compiler/sampled_rows.py)."""
    def register(fn):
        name = fn.__name__
        lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        lib.impl(name, fn, "CompositeExplicitAutograd")
        op = getattr(torch.ops.graphinfer, name).default
        op.__doc__ = fn.__doc__
        op.reference = fn  # the plain Python reference: a compiler may trace through it (compiler/inductor.py)
        op.row_wise = row_wise
        return op
    return register


register_fake = torch.library.register_fake
