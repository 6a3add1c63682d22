"""QuantizedLinear: a linear layer whose weight stays packed (scheme.py), and the online quantizers that pack one.

It replaces a model's ColumnParallelLinear / RowParallelLinear (quantization/__init__.py) with the same
in / out features and the same tensor-parallel role, so models do not change. In the traced graph it is a leaf
module like nn.Linear (so fuse_qkv / fuse_gate_up concatenate quantized projections as they do float ones:
`concat`); the lower_quant_linears pass then replaces each one by its ops (dynamic_quant + scaled_mm, or
wo_linear) so later passes can fuse the activation quantization into its producer. A row-parallel one at tp > 1
(`reduce_results`, vLLM's name) is traced through: matmul, all-reduce, then the bias.
"""
import torch
from torch import Tensor, nn

from graphinfer import ops
from graphinfer.distributed import parallel_state as ps
from graphinfer.distributed.communication_op import tensor_model_parallel_all_reduce
from graphinfer.errors import InvalidConfigError, ModelNotFoundError
from graphinfer.ops.quant import FP8_MAX, INT8_MAX, dequantize_weight, pack_int4
from graphinfer.quantization.scheme import QuantScheme

TENSORS = ("weight", "weight_scale", "weight_zero", "input_scale")


def _frozen(t: Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 reduce_results: bool = False, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.reduce_results, self.out_dtype = reduce_results, dtype  # out_dtype: the model's (activations')
        self.has_collective = reduce_results and ps.tp_size() > 1
        N, K, groups = out_features, in_features, in_features // scheme.group(in_features)
        if scheme.weight_fp8:
            codes = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=device)
        else:
            codes = torch.empty(N, K // 2 if scheme.bits == 4 else K, dtype=torch.uint8 if scheme.bits == 4
                                else torch.int8, device=device)
        if scheme.block_fp8:
            bn, bk = scheme.weight_block
            scale_shape = (-(-N // bn), -(-K // bk))
        else:
            scale_shape = (N, groups) if scheme.weight_only else (N,)
        self.weight = _frozen(codes)
        scale_dtype = getattr(torch, scheme.scale_dtype) if scheme.weight_only else torch.float32
        self.weight_scale = _frozen(torch.empty(scale_shape, dtype=scale_dtype, device=device))
        self.weight_zero = _frozen(torch.empty(N, groups, dtype=scale_dtype, device=device)) \
            if scheme.has_zero else None
        self.input_scale = _frozen(torch.empty(1, dtype=torch.float32, device=device)) \
            if scheme.static_input else None
        self.bias = nn.Parameter(torch.empty(N, dtype=dtype, device=device)) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.has_collective else self.bias
        if self.scheme.block_fp8:
            y = ops.block_fp8_linear(x, self.weight, self.weight_scale, *self.scheme.weight_block, bias)
        elif self.scheme.weight_only:
            y = ops.wo_linear(x, self.weight, self.weight_scale, self.weight_zero, self.scheme.bits, bias)
        else:
            xq, x_scale = ops.dynamic_quant(x, self.scheme.act_dtype, self.input_scale)
            y = ops.scaled_mm(xq, x_scale, self.weight, self.weight_scale, bias, self.out_dtype)
        if self.has_collective:
            y = tensor_model_parallel_all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme) -> "QuantizedLinear":
        """Quantize a loaded float layer (this rank's shard) with an online scheme."""
        w = linear.weight.detach()
        N, K = w.shape
        scheme = fit_group(scheme, K)
        with torch.device("meta"):
            q = cls(K, N, scheme, linear.bias is not None, getattr(linear, "has_collective", False),
                    dtype=w.dtype)
        for name, t in quantize_weight(w, scheme).items():
            setattr(q, name, _frozen(t))
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return q

    @classmethod
    def concat(cls, layers: list["QuantizedLinear"]) -> "QuantizedLinear | None":
        """One layer whose outputs are the layers' outputs concatenated (fuse_qkv / fuse_gate_up): every scheme
        keeps its scales per output row (block FP8: per row of bn-row blocks, so every layer but the last must have
        whole blocks), so the tensors stack along N. None if the layers cannot be stacked."""
        first = layers[0]
        if first.scheme.block_fp8 and any(m.out_features % first.scheme.weight_block[0] for m in layers[:-1]):
            return None  # a ragged block inside the stack would shift every later layer's block rows
        if any(m.scheme != first.scheme or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               or m.has_collective or m.input_scale is not None for m in layers):
            return None  # static input scales differ per layer: one shared quantization of x cannot serve them all
        with torch.device("meta"):
            fused = cls(first.in_features, sum(m.out_features for m in layers), first.scheme, first.bias is not None,
                        dtype=first.out_dtype)
        with torch.no_grad():
            for name in TENSORS + ("bias",):
                if getattr(first, name) is not None:
                    setattr(fused, name, _frozen(torch.cat([getattr(m, name) for m in layers])))
        return fused

    def weight_loader(self, name: str, param: Tensor, src, label: str) -> None:
        """A pre-quantized checkpoint's tensor (our names, quantization/scheme.py) -> this rank's slice: output
        rows for a column-parallel layer, input columns (whole groups) for a row-parallel one."""
        from graphinfer.models.parallel_layers import _load_slice

        tp = ps.tp_size()
        if self.scheme.block_fp8 and tp > 1 and name in ("weight", "weight_scale"):
            return self._load_block_slice(name, param, src, label, tp)
        if tp == 1 or name in ("input_scale",) or (name == "bias" and self.reduce_results):
            return _load_slice(label, param, src, None)
        if not self.reduce_results:  # column parallel: this rank's output rows
            return _load_slice(label, param, src, 0, ps.tp_rank(), tp)
        if name == "weight_scale" and not self.scheme.weight_only:
            return _load_slice(label, param, src, None)  # per output channel: whole on every rank
        K = self.in_features * tp
        if (K // tp) % self.scheme.group(K):
            raise InvalidConfigError(f"{label}: tensor_parallel_size={tp} splits {K} input features into parts of "
                                     f"{K // tp}, not a multiple of the quantization group {self.scheme.group(K)}.")
        _load_slice(label, param, src, 1, ps.tp_rank(), tp)


    def _load_block_slice(self, name: str, param: Tensor, src, label: str, tp: int) -> None:
        """Block FP8 at tp > 1: this rank's rows (column parallel) or columns (row parallel) of the codes, and the
        whole blocks of weight_scale under them; a part that does not start and end on a block is refused."""
        from graphinfer.models.parallel_layers import _load_slice

        dim = 1 if self.reduce_results else 0
        part = self.in_features if dim else self.out_features
        block = self.scheme.weight_block[dim]
        if part % block:
            raise InvalidConfigError(f"{label}: tensor_parallel_size={tp} splits dim {dim} ({part * tp}) into parts of "
                                     f"{part}, which cut a block of weight_block_size {list(self.scheme.weight_block)};"
                                     f" use a tensor_parallel_size whose parts of this layer are multiples of {block}.")
        _load_slice(label, param, src, dim, ps.tp_rank(), tp)


def fit_group(scheme: QuantScheme, in_features: int) -> QuantScheme:
    """The scheme with a group size that divides in_features (128 where it does, else 64 or 32)."""
    if scheme.group_size is None or in_features % scheme.group_size == 0:
        return scheme
    for g in (64, 32):
        if g < scheme.group_size and in_features % g == 0:
            return QuantScheme(**{**scheme.to_dict(), "group_size": g})
    raise ModelNotFoundError(f"in_features={in_features} is not a multiple of 32: group-wise int4 cannot pack it.")


@torch.no_grad()
def quantize_weight(w: Tensor, scheme: QuantScheme) -> dict[str, Tensor]:
    """A float weight [N, K] -> our packed tensors (round to nearest): symmetric per-channel int8 / fp8, or
    asymmetric group-wise int4 (min / max per group: w = q * scale + zero)."""
    w = w.float()
    N, K = w.shape
    if scheme.bits == 8:
        qmax = FP8_MAX if scheme.weight_fp8 else INT8_MAX
        g = scheme.group(K)
        scale = (w.view(N, K // g, g).abs().amax(-1) / qmax).clamp(min=1e-10)  # [N, groups]
        q = (w.view(N, K // g, g) / scale.unsqueeze(-1)).clamp(-qmax, qmax).view(N, K)
        q = q.to(torch.float8_e4m3fn) if scheme.weight_fp8 else q.round().to(torch.int8)
        return {"weight": q, "weight_scale": scale if scheme.weight_only else scale.view(N)}
    g = scheme.group(K)
    groups = w.view(N, K // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((groups - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).view(N, K)
    return {"weight": pack_int4(codes), "weight_scale": scale, "weight_zero": lo}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (each tensor once: a tied head is the embedding)."""
    seen = {}
    for p in model.parameters():
        seen[(p.data_ptr(), p.shape)] = p.numel() * p.element_size()
    return sum(seen.values()) if seen else 0



class QuantizedEmbedding(nn.Module):
    """An embedding table kept packed (GGUF's token_embd, e.g. Q8_0): the looked-up rows are dequantized, so the
    table costs its packed size. A tied LM head computes with the same tensors (tie_quantized_head). tp 1 only
    (the loader keeps a vocab-parallel embedding in float)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: QuantScheme, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme, self.out_dtype = num_embeddings, embedding_dim, scheme, dtype
        shapes = QuantizedLinear(embedding_dim, num_embeddings, scheme, device="meta")
        for name in TENSORS:
            t = getattr(shapes, name)
            setattr(self, name, None if t is None else _frozen(torch.empty(t.shape, dtype=t.dtype, device=device)))

    def forward(self, input_ids: Tensor) -> Tensor:
        zero = self.weight_zero[input_ids] if self.weight_zero is not None else None
        rows = dequantize_weight(self.weight[input_ids], self.weight_scale[input_ids], zero, self.scheme.bits)
        return rows.to(self.out_dtype)


def tie_quantized_head(model: nn.Module) -> None:
    """A tied LM head over a QuantizedEmbedding: a QuantizedLinear sharing the embedding's packed tensors."""
    embed = model.model.embed_tokens
    head = getattr(model, "lm_head", None)
    if not isinstance(head, QuantizedLinear) or head.scheme != embed.scheme:
        with torch.device("meta"):
            head = QuantizedLinear(embed.embedding_dim, embed.num_embeddings, embed.scheme, dtype=embed.out_dtype)
        model.lm_head = head
    for name in TENSORS:
        setattr(head, name, getattr(embed, name))
