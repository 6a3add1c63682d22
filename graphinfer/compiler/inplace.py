"""In-place tensor calls as graph nodes that fx keeps (see inplace)."""
import torch
from torch.fx.node import has_side_effect


@has_side_effect
def inplace(method: str, x: torch.Tensor, *args, **kwargs):
    """x.<method>(*args, **kwargs) for an in-place tensor method or `__setitem__`, as one call_function that fx keeps:
    its dead-code elimination treats a call_method as pure (dropping the unused result of `out.add_(bias)`, gpt-oss's
    expert biases, and with it the mutation), and symbolic tracing cannot run `x[i] = v` on a proxy (an artifact's
    graph.py is traced again). Graphs captured from transformers' code spell in-place calls this way."""
    getattr(x, method)(*args, **kwargs)
    return x
