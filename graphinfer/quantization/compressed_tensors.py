"""compressed-tensors checkpoints (config.json's quantization_config, quant_method "compressed-tensors", as written by
llm-compressor) read into our packed forms (ops/quant.py, scheme.py).

Supported, per config group (its format: the group's `format`, else the config's):
- "int-quantized" (or "naive-quantized" with int weights), W8A8: int8 weights, symmetric, per channel (weight_scale
  [N, 1]) or per tensor ([1], expanded to [N]); int8 activations, symmetric, dynamic per token or static per tensor
  (input_scale [1]) -> QuantScheme(bits=8, act_dtype="int8"[, static_input]). Without input_activations (W8A16):
  weight-only int8, per channel / tensor / group, symmetric or asymmetric -> QuantScheme(bits=8[, group_size,
  has_zero]).
- "float-quantized" (or "naive-quantized" with float weights), FP8 W8A8: float8_e4m3fn weights and activations,
  with the same strategies -> QuantScheme(bits=8, act_dtype="fp8", weight_fp8=True[, static_input]).
- "pack-quantized", W4A16 / W8A16: weight_packed int32 [N, ceil(K * bits / 32)] (bits 4 or 8: element i of a word
  in bits [bits * i, bits * (i + 1)), stored as q + 2^(bits - 1)), weight_shape [N, K], weight_scale [N, K // g]
  (group) or [N, 1] (channel; [1] tensor-wise), weight_zero_point (asymmetric; packed the same way along N) ->
  bits 4: codes q + 8 in [0, 15], two a byte, and w = q * s = c * s - 8 s (symmetric) or (q - zp) * s = c * s
  - (zp + 8) * s (asymmetric): QuantScheme(bits=4, group_size, has_zero=True); bits 8: int8 codes q, zero - zp * s
  when asymmetric.
Anything else (sparsity_config, transform_config, kv_cache_scheme, output_activations, asymmetric or grouped
activations, actorder "group" / g_idx, block or tensor-group strategies, other bit widths or formats, FP8 weight-only)
raises UnsupportedQuantizationError naming the field.

Scales are kept in fp32. compressed-tensors dequantizes in the scale's dtype: ((q - zp) in that dtype) * s. With
bf16 / fp16 scales (llm-compressor saves the model's dtype) every product here is exact in fp32 (a 4- to 9-bit
integer times an 8- or 11-bit significand), so `dequantize_weight` of our tensors cast to the scale dtype equals its
decompression bit for bit. With fp32 scales c * s + zero rounds twice where (q - zp) * s rounds once: they
differ by at most 16 ulps of s.
"""
import re

import torch
from torch import Tensor

from graphinfer.errors import UnsupportedQuantizationError
from graphinfer.models.checkpoint_tensor import CheckpointTensor
from graphinfer.quantization.scheme import QuantScheme

SUPPORTED = ("int-quantized W8A8 (int8 weights per channel or tensor, symmetric; int8 activations symmetric, dynamic "
             "per token or static per tensor) and W8A16; float-quantized FP8 W8A8 (the same strategies); "
             "pack-quantized W4A16 / W8A16 (int weights per group, channel or tensor, symmetric or asymmetric)")

def _unsupported(where: str, field: str, value, expected: str):
    raise UnsupportedQuantizationError(
        f"compressed-tensors {where}: {field}={value!r} is not supported ({expected}). graphinfer reads {SUPPORTED}.")


def parse_quantization_config(quant_config):
    """config.json's quantization_config (a dict, transformers' CompressedTensorsConfig, or compressed-tensors'
    QuantizationConfig) -> compressed_tensors QuantizationConfig, refusing what graphinfer cannot run."""
    if isinstance(quant_config, dict):  # config.json's
        d = dict(quant_config)
    elif hasattr(quant_config, "model_dump"):  # compressed-tensors' QuantizationConfig
        d = quant_config.model_dump()
    else:  # e.g. transformers' CompressedTensorsConfig
        d = quant_config.to_dict()
    method = d.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        _unsupported("quantization_config", "quant_method", method, "only 'compressed-tensors' is read here")
    try:
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    except ImportError as e:
        raise UnsupportedQuantizationError(
            f"Reading a compressed-tensors checkpoint needs the compressed-tensors package ({e}): "
            f"pip install 'compressed-tensors>=0.20' (graphinfer's extra [compressed-tensors]).") from e
    for field in ("sparsity_config", "transform_config"):  # 2:4 sparsity; Hadamard / SpinQuant rotations
        if d.get(field):
            _unsupported("quantization_config", field, d[field], "dense, unrotated weights only")
    if d.get("kv_cache_scheme") is not None:
        _unsupported("quantization_config", "kv_cache_scheme", d["kv_cache_scheme"], "the KV cache stays in the "
                     "model dtype")
    for group, scheme in (d.get("config_groups") or {}).items():  # g_idx (compressed-tensors 0.20 refuses them too)
        actorder = isinstance(scheme, dict) and (scheme.get("weights") or {}).get("actorder")
        if actorder in ("group", "dynamic", True):
            _unsupported(f"config group {group!r}.weights", "actorder", actorder, "None or 'weight' (no g_idx)")
    fields = set(QuantizationConfig.model_fields)
    try:
        config = QuantizationConfig.model_validate({k: v for k, v in d.items() if k in fields})
    except (ValueError, NotImplementedError) as e:
        raise UnsupportedQuantizationError(f"compressed-tensors quantization_config does not parse ({e}); graphinfer "
                                           f"reads {SUPPORTED}.") from e
    if config.quantization_status != QuantizationStatus.COMPRESSED:
        _unsupported("quantization_config", "quantization_status", str(config.quantization_status.value),
                     "a checkpoint saved compressed: 'compressed'")
    return config


def _act(where: str, a, weight_type: str) -> tuple[str, bool]:
    """input_activations -> (act_dtype, static_input)."""
    a_where = f"{where}.input_activations"
    if a.type != weight_type:
        _unsupported(a_where, "type", a.type, f"the weights' type, {weight_type!r}")
    if a.num_bits != 8:
        _unsupported(a_where, "num_bits", a.num_bits, "8")
    if not a.symmetric:
        _unsupported(a_where, "symmetric", a.symmetric, "symmetric activations only")
    if a.strategy == "token" and a.dynamic is True:
        static = False
    elif a.strategy == "tensor" and a.dynamic is False:
        static = True
    else:
        _unsupported(a_where, "strategy / dynamic", (a.strategy, a.dynamic),
                     "('token', True): dynamic per token, or ('tensor', False): a static input_scale")
    return ("int8" if weight_type == "int" else "fp8"), static


def scheme_of(group: str, ct_scheme, fmt: str) -> QuantScheme:
    """One config group's compressed-tensors QuantizationScheme, stored in format `fmt` -> our QuantScheme, or a
    typed error naming what is not supported."""
    where = f"config group {group!r}"
    w, a = ct_scheme.weights, ct_scheme.input_activations
    if w is None:
        _unsupported(where, "weights", None, "weights must be quantized")
    if ct_scheme.output_activations is not None:
        _unsupported(where, "output_activations", ct_scheme.output_activations.model_dump(), "none")
    ww = f"{where}.weights"
    if w.actorder in ("group", "dynamic"):
        _unsupported(ww, "actorder", w.actorder, "None or 'weight' (no g_idx)")
    if w.dynamic is not False:
        _unsupported(ww, "dynamic", w.dynamic, "static weight scales")
    if w.strategy not in ("tensor", "channel", "group"):
        _unsupported(ww, "strategy", w.strategy, "'tensor', 'channel' or 'group'")
    if w.strategy == "group" and not (w.group_size and w.group_size > 0):
        _unsupported(ww, "group_size", w.group_size, "a positive group size with strategy 'group'")
    group = w.group_size if w.strategy == "group" else None
    if fmt == "naive-quantized":
        fmt = "float-quantized" if w.type == "float" else "int-quantized"
    if fmt in ("int-quantized", "float-quantized"):
        want = "int" if fmt == "int-quantized" else "float"
        if w.type != want:
            _unsupported(ww, "type", w.type, f"{want!r} in format {fmt!r}")
        if w.num_bits != 8:
            _unsupported(ww, "num_bits", w.num_bits, f"8 in format {fmt!r}")
        if a is None:
            if w.type == "float":
                _unsupported(where, "input_activations", None, "FP8 weights need FP8 activations (W8A8)")
            return QuantScheme(bits=8, group_size=group, has_zero=not w.symmetric)
        if not w.symmetric:
            _unsupported(ww, "symmetric", w.symmetric, "symmetric weights with quantized activations")
        if w.strategy == "group":
            _unsupported(ww, "strategy", w.strategy, "'channel' or 'tensor' with quantized activations")
        act, static = _act(where, a, w.type)
        return QuantScheme(bits=8, act_dtype=act, static_input=static, weight_fp8=w.type == "float")
    if fmt == "pack-quantized":
        if w.type != "int":
            _unsupported(ww, "type", w.type, "'int' in format 'pack-quantized'")
        if w.num_bits not in (4, 8):
            _unsupported(ww, "num_bits", w.num_bits, "4 or 8 in format 'pack-quantized'")
        if a is not None:
            _unsupported(where, "input_activations", a.model_dump(), "none (weight-only) in format 'pack-quantized'")
        if not w.symmetric and w.strategy == "tensor":
            _unsupported(ww, "strategy", w.strategy, "'group' or 'channel' for asymmetric weights")
        return QuantScheme(bits=w.num_bits, group_size=group, has_zero=w.num_bits == 4 or not w.symmetric)
    _unsupported(where, "format", fmt, "'int-quantized', 'float-quantized', 'naive-quantized' or 'pack-quantized'")


def _matches(name: str, target: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def _group_of(prefix: str, config) -> str | None:
    """The config group whose targets match a quantized module, as compressed-tensors resolves them (exact names,
    then regexes, then class names; a later group claiming the same target wins). A checkpoint only quantizes
    linear layers, so the class target "Linear" matches any module with quantized tensors."""
    target_group = {}
    for group, scheme in config.config_groups.items():
        for target in scheme.targets:
            target_group[target] = group
    targets = sorted(target_group, key=lambda t: ("re:" in t, t))
    for target in targets:
        if _matches(prefix, target):
            return target_group[target]
    for target in targets:
        if target == "Linear":
            return target_group[target]
    return None


def _ignored(prefix: str, config) -> bool:
    return any(_matches(prefix, t) for t in config.ignore or ())


def _read(t) -> Tensor:
    """The whole tensor. A checkpoint iterator's tensors are read after it is exhausted, when e.g. a `with safe_open`
    generator has closed its file: a safetensors handle still reads slices then, so read the full slice."""
    if isinstance(t, Tensor):
        return t
    shape = tuple(t.shape)
    return t.read() if not shape else t.read(0, 0, shape[0])


class _Passthrough(CheckpointTensor):
    """An unquantized tensor (norms, embeddings, biases, ignored layers) handed on unread; whole reads go through
    a full slice (see _read), sliced reads (tensor parallelism) unchanged."""

    def __init__(self, src):
        self.src, self.shape = src, tuple(src.shape)

    def read(self, dim=None, start=0, length=None) -> Tensor:
        return _read(self.src) if dim is None else self.src.read(dim, start, length)


def _unpack(words: Tensor, bits: int, count: int) -> Tensor:
    """int32 [R, W] words of `bits`-bit fields (element i in bits [bits * i, bits * (i + 1))) -> int32 [R, count]
    unsigned fields; by shifts, so the host's byte order does not matter."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(words.shape[0], -1)[:, :count]


def _to_rows(scale: Tensor, n: int, where: str) -> Tensor:
    """A per-channel ([N], [N, 1]) or per-tensor ([], [1]) weight scale -> fp32 [N, 1]."""
    s = scale.float().reshape(-1, 1)
    if s.shape[0] == 1:
        return s.expand(n, 1).contiguous()
    if s.shape[0] != n:
        raise UnsupportedQuantizationError(f"{where}: weight_scale has shape {tuple(scale.shape)}, not [{n}, 1] "
                                           f"or [1].")
    return s


def _convert(prefix: str, parts: dict, scheme: QuantScheme, fmt: str, symmetric: bool, where: str):
    """Yield (our name, tensor) for one quantized module's checkpoint tensors `parts` (suffix -> tensor)."""
    if "weight_g_idx" in parts:
        _unsupported(where, f"{prefix}.weight_g_idx", "present", "no activation-order g_idx")
    # Zero points of symmetric schemes (0) and the input_scale of dynamic ones are dropped if present.
    known = {"weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "bias"} if fmt == "pack-quantized" \
        else {"weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point", "bias"}
    for suffix in parts:
        if suffix not in known:
            _unsupported(where, "tensor", f"{prefix}.{suffix}", f"a {fmt} layer holds {', '.join(sorted(known))}")
    wname = "weight_packed" if fmt == "pack-quantized" else "weight"
    for need in (wname, "weight_scale") + (("weight_shape",) if fmt == "pack-quantized" else ()) + \
            (("weight_zero_point",) if not symmetric else ()) + (("input_scale",) if scheme.static_input else ()):
        if need not in parts:
            raise UnsupportedQuantizationError(f"{where}: checkpoint lacks {prefix}.{need}, which its scheme needs.")
    if fmt == "pack-quantized":
        N, K = (int(x) for x in _read(parts["weight_shape"]).reshape(-1).tolist())
    else:
        N, K = (int(x) for x in parts["weight"].shape)
    g = scheme.group(K)
    if K % g or (scheme.bits == 4 and K % 2):
        raise UnsupportedQuantizationError(f"{where}: {prefix} has {K} input features, not a multiple of its group "
                                           f"{g}{' and of 2' if scheme.bits == 4 else ''}.")
    scale = _read(parts["weight_scale"])
    if scheme.weight_only:
        scale = scale.float().reshape(N, -1) if scale.dim() == 2 and scale.shape[1] > 1 else _to_rows(scale, N, where)
        if scale.shape != (N, K // g):
            raise UnsupportedQuantizationError(f"{where}: {prefix}.weight_scale has shape {tuple(scale.shape)}, "
                                               f"expected [{N}, {K // g}].")
    else:
        scale = _to_rows(scale, N, where).reshape(N)
    # The codes.
    if fmt == "pack-quantized":
        words = _read(parts["weight_packed"])
        if words.dtype != torch.int32 or words.shape[0] != N:
            raise UnsupportedQuantizationError(f"{where}: {prefix}.weight_packed is {words.dtype} "
                                               f"{tuple(words.shape)}, expected int32 [{N}, ...].")
        if scheme.bits == 4:  # byte b of the row holds elements 2b (low nibble) and 2b + 1: our layout already
            codes = _unpack(words, 8, K // 2).to(torch.uint8)
        else:
            codes = (_unpack(words, 8, K) - 128).to(torch.int8)
    else:
        codes = _read(parts["weight"])
        want = torch.float8_e4m3fn if scheme.weight_fp8 else torch.int8
        if codes.dtype != want:
            raise UnsupportedQuantizationError(f"{where}: {prefix}.weight is {codes.dtype}, expected {want}.")
    yield f"{prefix}.weight", codes.contiguous()
    yield f"{prefix}.weight_scale", scale.contiguous()
    if scheme.has_zero:
        if symmetric:  # pack-quantized int4: codes q + 8
            zero = scale * -8.0
        else:
            zp = _read(parts["weight_zero_point"])
            if fmt == "pack-quantized":  # packed along N, stored as zp + 2^(bits - 1): [ceil(N * bits / 32), groups]
                zp = _unpack(zp.reshape(zp.shape[0], -1).T.contiguous(), scheme.bits, N).T - (1 << (scheme.bits - 1))
            zp = zp.float().reshape(N, -1) if zp.numel() != 1 else zp.float().reshape(1, 1).expand(N, 1)
            if zp.shape != scale.shape:
                raise UnsupportedQuantizationError(f"{where}: {prefix}.weight_zero_point has {zp.numel()} values, "
                                                   f"expected {N} x {scale.shape[1]}.")
            zero = -((zp + 8.0) * scale) if scheme.bits == 4 else -(zp * scale)
        yield f"{prefix}.weight_zero", zero.contiguous()
    if scheme.static_input:
        yield f"{prefix}.input_scale", _read(parts["input_scale"]).float().reshape(1)
    if "bias" in parts:
        yield f"{prefix}.bias", _Passthrough(parts["bias"]) if not isinstance(parts["bias"], Tensor) else parts["bias"]


def compressed_tensors_weights(named_tensors, quant_config):
    """A compressed-tensors checkpoint's (name, tensor) pairs (tensors or CheckpointTensors) and its
    quantization_config -> (iterator of (name, tensor) in our names, {module prefix: QuantScheme}).

    A module is quantized where the checkpoint holds its weight_scale; its config group (targets / ignore) gives
    the scheme. It yields `P.weight` (codes), `P.weight_scale` (fp32), `P.weight_zero` (has_zero), `P.input_scale`
    (static_input) and `P.bias`; every other tensor (norms, embeddings, an ignored lm_head) comes unchanged. The
    names are all read first (they decide the schemes); each module's tensors are converted when the iterator
    reaches it."""
    config = parse_quantization_config(quant_config)
    formats = {}
    for group, ct_scheme in config.config_groups.items():
        fmt = ct_scheme.format or config.format
        if fmt == "mixed-precision":
            _unsupported(f"config group {group!r}", "format", None, "a format per group in a mixed-precision config")
        formats[group] = fmt
    entries, modules = [], {}
    for name, t in named_tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight_shape" and not isinstance(t, Tensor):
            t = t.read()  # tiny; read while its file is surely open
        entries.append((name, prefix, suffix))
        modules.setdefault(prefix, {})[suffix] = t
    schemes, groups = {}, {}
    for prefix, parts in modules.items():
        if "weight_scale" not in parts and "weight_packed" not in parts:
            continue
        group = _group_of(prefix, config)
        if group is None or _ignored(prefix, config):
            why = "is in the ignore list" if group is not None else "matches no config group's targets"
            raise UnsupportedQuantizationError(f"compressed-tensors checkpoint: {prefix} holds quantized tensors but "
                                               f"{why}; the checkpoint does not match its quantization_config.")
        schemes[prefix] = scheme_of(group, config.config_groups[group], formats[group])
        groups[prefix] = group

    def weights():
        done = set()
        for name, prefix, suffix in entries:
            if prefix in schemes:
                if prefix not in done:
                    done.add(prefix)
                    group = groups[prefix]
                    yield from _convert(prefix, modules[prefix], schemes[prefix], formats[group],
                                        config.config_groups[group].weights.symmetric, f"config group {group!r}")
                continue
            t = modules[prefix][suffix]
            yield name, t if isinstance(t, Tensor) else _Passthrough(t)

    return weights(), schemes
