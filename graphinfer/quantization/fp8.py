"""Block-wise FP8 checkpoints as DeepSeek-V3 / R1 ship them (vLLM's Fp8Config with weight_block_size): config.json's
quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [bn, bk]} ([128, 128] in DeepSeek's releases; any block size reads).

A quantized linear `P` holds `P.weight` float8_e4m3fn [N, K] and `P.weight_scale_inv` fp32 [ceil(N / bn),
ceil(K / bk)]: W[i, j] = weight[i, j] * weight_scale_inv[i // bn, j // bk] (DeepSeek's inference/kernel.py
weight_dequant: the code in fp32 times its block's scale; the edge blocks may be ragged). Norms, embeddings, the MoE
router (`mlp.gate`) and lm_head are stored unquantized, without a weight_scale_inv.

Where the platform has an fp8 GEMM (Platform.block_fp8_plan: cuda with compute capability 8.9+, or forced with
GRAPHINFER_BLOCK_FP8=fp8), the linears a QuantizedLinear replaces keep their codes and block scales (scheme
weight_block; graphinfer::block_fp8_linear, vLLM's w8a8_block_fp8_matmul: activations quantized per token per bk
columns). Everything else, and every weight where the platform has no fp8 GEMM (cpu, npu, older GPUs), is dequantized
at load: MoE experts (no block-FP8 fused_moe yet) and layers an op reads itself (MLA's kv_b_proj) or that are plain
nn.Linear (DeepSeek's q_a_proj / kv_a_proj_with_mqa, replicated). A rank reads only its slice of weight and the
blocks of weight_scale_inv under it; a dequantized product is fp32, cast to the engine's dtype as it is copied into
the parameter (weight_dequant likewise stores its fp32 product in the default dtype). Refused, naming the field or the
tensor: other FP8 layouts (per-tensor weight_scale / input_scale, static activations, e5m2), a weight without its
scale or the reverse, a scale of the wrong shape, a tensor-parallel slice that cuts a block.
"""
import torch
from torch import Tensor

from graphinfer.errors import InvalidConfigError, UnsupportedQuantizationError
from graphinfer.models.checkpoint_tensor import CheckpointTensor, as_checkpoint_tensor
from graphinfer.ops.quant import dequantize_blocks
from graphinfer.quantization.compressed_tensors import _Passthrough, _read

SUPPORTED = ("block-wise FP8 (DeepSeek-V3's): quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', "
             "weight_block_size [bn, bk], float8_e4m3fn weights with weight_scale_inv [ceil(N / bn), ceil(K / bk)]")
_FP8_STORED = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # safetensors' dtype names
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _as_dict(quant_config) -> dict:
    return dict(quant_config) if isinstance(quant_config, dict) else quant_config.to_dict()


def is_fp8_config(quant_config) -> bool:
    """Whether config.json's quantization_config is vLLM's / DeepSeek's "fp8" method."""
    return _as_dict(quant_config).get("quant_method") == "fp8"


def _unsupported(field: str, value, expected: str):
    raise UnsupportedQuantizationError(f"fp8 quantization_config: {field}={value!r} is not supported ({expected}). "
                                       f"graphinfer reads {SUPPORTED}.")


def weight_block_size(quant_config) -> tuple[int, int]:
    """(bn, bk) of a block-FP8 quantization_config, refusing every other "fp8" layout."""
    d = _as_dict(quant_config)
    if d.get("fmt", "e4m3") != "e4m3":
        _unsupported("fmt", d["fmt"], "'e4m3'")
    if d.get("activation_scheme", "dynamic") != "dynamic":
        _unsupported("activation_scheme", d["activation_scheme"], "'dynamic' (activations are not quantized here)")
    block = d.get("weight_block_size")
    if block is None:
        _unsupported("weight_block_size", None, "per-tensor FP8 (weight_scale, input_scale) is not read; block-wise "
                     "scales are")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        _unsupported("weight_block_size", block, "two positive integers [bn, bk]")
    return int(block[0]), int(block[1])


def _stored_dtype(t) -> torch.dtype | str | None:
    """The dtype a checkpoint tensor is stored in, known without reading it (a safetensors slice's name)."""
    if isinstance(t, Tensor):
        return t.dtype
    src = getattr(t, "src", t)  # a passed-through tensor's source
    get = getattr(getattr(src, "slice", None), "get_dtype", None)
    return None if get is None else _FP8_STORED.get(get(), get())


def dequantize_block_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """fp32 weight[i, j] * scale_inv[i // bn, j // bk] of a float8 [N, K] weight whose first row and column start a
    block; the last block of each dim may be ragged."""
    return dequantize_blocks(weight, scale_inv, block)


class BlockFP8Tensor(CheckpointTensor):
    """A block-FP8 weight read dequantized (fp32): whole, or a tensor-parallel slice that starts on a block and ends
    on one or at the tensor's end; its weight_scale_inv blocks are read with it."""

    def __init__(self, name: str, weight, scale_inv, block: tuple[int, int]):
        self.name, self.block = name, block
        self.weight, self.scale_inv = as_checkpoint_tensor(weight), as_checkpoint_tensor(scale_inv)
        self.shape = tuple(weight.shape)

    def read(self, dim=None, start=0, length=None) -> Tensor:
        if dim is None:
            q, s = _read(self.weight), _read(self.scale_inv)
        else:
            b, end = self.block[dim], start + length
            if start % b or (end % b and end != self.shape[dim]):
                raise InvalidConfigError(
                    f"{self.name}: this tensor-parallel rank's part, {start}:{end} of dim {dim} (of "
                    f"{self.shape[dim]}), cuts a block of weight_block_size {list(self.block)}; use a "
                    f"tensor_parallel_size whose parts of this layer are multiples of {b}.")
            q = self.weight.read(dim, start, length)
            s = self.scale_inv.read(dim, start // b, -(-end // b) - start // b)
        if q.dtype != torch.float8_e4m3fn:
            raise UnsupportedQuantizationError(f"{self.name} is {q.dtype}, expected torch.float8_e4m3fn beside its "
                                               f"weight_scale_inv.")
        return dequantize_block_fp8(q, s, self.block)


def _check(prefix: str, parts: dict, block: tuple[int, int]) -> None:
    """One module's checkpoint tensors (suffix -> tensor) against the block-FP8 layout."""
    for other in ("weight_scale", "input_scale"):
        if other in parts:
            raise UnsupportedQuantizationError(f"fp8 checkpoint: {prefix}.{other} is another FP8 layout (per-tensor "
                                               f"scales); graphinfer reads {SUPPORTED}.")
    w, s = parts.get("weight"), parts.get("weight_scale_inv")
    if s is not None and w is None:
        raise UnsupportedQuantizationError(f"fp8 checkpoint: {prefix}.weight_scale_inv has no {prefix}.weight.")
    if s is None:
        if w is not None and _stored_dtype(w) in (*_FP8_DTYPES, *_FP8_STORED.values()):
            raise UnsupportedQuantizationError(f"fp8 checkpoint: {prefix}.weight is float8 but the checkpoint lacks "
                                               f"{prefix}.weight_scale_inv.")
        return
    if len(w.shape) != 2:
        raise UnsupportedQuantizationError(f"fp8 checkpoint: {prefix}.weight has shape {tuple(w.shape)}; block-FP8 "
                                           f"weights are 2-D [out, in].")
    dtype = _stored_dtype(w)
    if dtype is not None and dtype != torch.float8_e4m3fn:
        raise UnsupportedQuantizationError(f"fp8 checkpoint: {prefix}.weight is {dtype}, expected float8_e4m3fn "
                                           f"beside its weight_scale_inv.")
    want = tuple(-(-n // b) for n, b in zip(w.shape, block))
    if tuple(s.shape) != want:
        raise UnsupportedQuantizationError(
            f"fp8 checkpoint: {prefix}.weight_scale_inv has shape {tuple(s.shape)}, expected {list(want)}: "
            f"ceil({list(w.shape)} / weight_block_size {list(block)}).")


def block_fp8_weights(named_tensors, quant_config):
    """A block-FP8 checkpoint's (name, tensor) pairs -> (name, tensor) pairs of a float checkpoint: every quantized
    weight dequantized (block_fp8_checkpoint with nothing kept)."""
    return block_fp8_checkpoint(named_tensors, quant_config)[0]


def block_fp8_checkpoint(named_tensors, quant_config, keep=frozenset()):
    """A block-FP8 checkpoint's (name, tensor) pairs -> ((name, tensor) pairs in our names, {module prefix:
    QuantScheme}). A quantized module named in `keep` (the linears a QuantizedLinear can replace, where the platform
    keeps fp8: platforms' block_fp8_plan) stays fp8: `P.weight` unread, its `P.weight_scale_inv` as `P.weight_scale`,
    scheme block_fp8_scheme(block). Every other quantized `P.weight` becomes a BlockFP8Tensor (read dequantized;
    `P.weight_scale_inv` is consumed by it): MoE experts, layers an op reads itself. Other tensors pass unread. All
    names are read first (a weight and its scale may sit in different files) and checked before anything loads."""
    from graphinfer.quantization.scheme import block_fp8_scheme

    block = weight_block_size(quant_config)
    entries, modules = [], {}
    for name, t in named_tensors:
        prefix, _, suffix = name.rpartition(".")
        entries.append((name, prefix, suffix))
        modules.setdefault(prefix, {})[suffix] = t
    for prefix, parts in modules.items():
        _check(prefix, parts, block)
    kept = {p: block_fp8_scheme(block) for p, parts in modules.items() if "weight_scale_inv" in parts and p in keep}

    def passed(t):
        return t if isinstance(t, Tensor) else _Passthrough(t)

    def weights():
        for name, prefix, suffix in entries:
            parts, t = modules[prefix], modules[prefix][suffix]
            if suffix == "weight_scale_inv":
                if prefix in kept:
                    yield f"{prefix}.weight_scale", passed(t)
                continue
            if suffix == "weight" and "weight_scale_inv" in parts and prefix not in kept:
                yield name, BlockFP8Tensor(name, t, parts["weight_scale_inv"], block)
            else:
                yield name, passed(t)

    return weights(), kept
