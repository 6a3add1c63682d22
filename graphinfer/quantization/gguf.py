"""GGUF tensors kept quantized: llama.cpp's blocks rewritten into the packed weight-only forms (ops/quant.py) with their
codes unchanged, never dequantized.

Each block type maps onto `w = q * scale[n, k // g] + zero[n, k // g]` (QuantScheme: weight-only, bits, group g):

  type  | bits | group | codes (P.weight)                     | scale (P.weight_scale) | zero (P.weight_zero)
  Q4_0  | 4    | 32    | q in [0, 15], packed two a byte      | d                      | -8 d
  Q4_1  | 4    | 32    | q in [0, 15], packed                 | d                      | m
  Q4_K  | 4    | 32    | q in [0, 15], packed (8 sub-blocks)  | d * sc (6-bit)         | -dmin * m (6-bit)
  Q8_0  | 8    | 32    | q int8                               | d                      | none
  Q6_K  | 8    | 16    | q - 32 as int8, in [-32, 31]         | d * sc (int8)          | none

Scales and zeros of Q4_0 / Q4_1 / Q8_0 stay fp16, as the file has them (-8 d of Q4_0 is exact in fp16: a power-of-two
scaling); the K-quants' products need fp32. `dequantize_weight` of the result equals gguf.quants.dequantize of the same tensor bit
for bit in fp32 (tests/test_quantization_formats.py): d, dmin, m are fp16 (exact in fp32) and gguf-py computes the
same products in fp32: Q4_1 d * q + m, Q8_0 q * d, and Q4_K (d * sc) * q - dmin * m, Q6_K (d * sc) * q with the
same (d * sc) and (dmin * m) we store; x + (-y) is x - y in IEEE arithmetic. Q4_0 is the one rewrite: gguf-py
computes d * (q - 8), we q * d + (-8 d); each product is exact in fp32 (an 11-bit significand times a 4-bit integer
needs 15 bits of the 24; -8 d is a power-of-two scaling), and so is their sum, (q - 8) d, which fits in 15 bits.
The K-quants' products are exact too (d * sc: 11 + 6 bits; (d * sc) * q: 17 + 4 bits; Q6_K: 11 + 7 + 5 bits) but
bit-equality does not depend on it.

The layout is torch's, [N = out features, K = in features] (a GGUF row is an output row), with llama's Q / K rows
un-permuted like gguf_loader does for float weights: the permutation moves whole rows and every block lies within
one row, so it applies unchanged to the codes, scales and zeros.
"""
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K as _GGUF_Q4_K

from graphinfer.errors import UnsupportedQuantizationError
from graphinfer.models.gguf_loader import _open, _unpermute, gguf_tensors
from graphinfer.quantization.scheme import QuantScheme

Q = GGMLQuantizationType
SCHEMES = {  # the GGUF types kept quantized, and the scheme each becomes
    Q.Q4_0: QuantScheme(bits=4, group_size=32, has_zero=True, scale_dtype="float16"),
    Q.Q4_1: QuantScheme(bits=4, group_size=32, has_zero=True, scale_dtype="float16"),
    Q.Q4_K: QuantScheme(bits=4, group_size=32, has_zero=True),
    Q.Q8_0: QuantScheme(bits=8, group_size=32, scale_dtype="float16"),
    Q.Q6_K: QuantScheme(bits=8, group_size=16),
}


def _f16(blocks: np.ndarray, offset: int, dtype=np.float32) -> np.ndarray:
    """The fp16 field at byte `offset` of every block [rows, blocks, bytes] -> [rows, blocks] in dtype (exact)."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(dtype)


def _pack(codes: np.ndarray) -> np.ndarray:
    """[rows, K] 4-bit codes in element order -> [rows, K // 2] uint8, even k in the low nibble (as pack_int4)."""
    return codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))


def _q4_0_1(blocks: np.ndarray, rows: int, has_min: bool):
    d = _f16(blocks, 0, np.float16)
    qs = blocks[..., 4 if has_min else 2:]  # [rows, nb, 16]: elements j (low nibble) and j + 16 (high) of a block
    codes = np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=-1).reshape(rows, -1)
    if has_min:
        zero = _f16(blocks, 2, np.float16)
    else:
        with np.errstate(over="ignore"):
            zero = d * np.float16(-8.0)
        if not np.isfinite(zero[np.isfinite(d)]).all():
            raise UnsupportedQuantizationError("a Q4_0 block scale d above 8188 overflows -8 d in fp16: this file "
                                               "cannot be kept quantized (load it without quantization='gguf').")
    return _pack(codes), d, zero


def _q4_k(blocks: np.ndarray, rows: int):
    nb = blocks.shape[1]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _GGUF_Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(rows * nb, 12))
    scale = (d[..., None] * sc.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, -1)
    zero = -(dmin[..., None] * m.reshape(rows, nb, 8).astype(np.float32)).reshape(rows, -1)
    qs = blocks[..., 16:].reshape(rows, nb, 4, 1, 32)  # 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1 (high)
    codes = np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=3).reshape(rows, -1)
    return _pack(codes), scale, zero


def _q8_0(blocks: np.ndarray, rows: int):
    return blocks[..., 2:].view(np.int8).reshape(rows, -1), _f16(blocks, 0, np.float16), None


def _q6_k(blocks: np.ndarray, rows: int):
    nb = blocks.shape[1]  # as gguf.quants.Q6_K.dequantize_blocks: ql (128 B), qh (64 B), 16 int8 scales, fp16 d
    ql = blocks[..., :128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    ql = (ql & np.uint8(0x0F)).reshape(rows, nb, 8, 32)
    qh = (qh & np.uint8(0x03)).reshape(rows, nb, 8, 32)
    codes = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(rows, -1)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    return codes, (_f16(blocks, 208)[..., None] * sc).reshape(rows, -1), None


_CONVERT = {Q.Q4_0: lambda b, r: _q4_0_1(b, r, False), Q.Q4_1: lambda b, r: _q4_0_1(b, r, True),
            Q.Q4_K: _q4_k, Q.Q8_0: _q8_0, Q.Q6_K: _q6_k}


def gguf_tensor_to_quantized(t, n_head: int | None = None) -> tuple[QuantScheme, dict[str, torch.Tensor]]:
    """One 2-D GGUF tensor (gguf's ReaderTensor: .tensor_type, .shape [K, N], .data [N, bytes of a row] uint8) ->
    (scheme, {"weight": codes, "weight_scale": [N, K // g], "weight_zero": [N, K // g] (has_zero only)}, in the
    scheme's scale_dtype),
    the codes uint8 [N, K // 2] (bits 4) or int8 [N, K] (bits 8). n_head: llama's q / k heads, whose rows are
    un-permuted as gguf_loader does (None: rows kept in file order)."""
    qtype = Q(t.tensor_type)
    if qtype not in _CONVERT:
        raise UnsupportedQuantizationError(
            f"GGUF tensor {t.name!r} has type {qtype.name}, which graphinfer cannot keep quantized; supported: "
            f"{', '.join(q.name for q in SCHEMES)} (load it dequantized without quantization='gguf').")
    shape = [int(s) for s in t.shape]
    if len(shape) != 2:
        raise UnsupportedQuantizationError(f"GGUF tensor {t.name!r} has {len(shape)} dimensions; only 2-D weights are "
                                           f"kept quantized.")
    K, N = shape  # GGUF lists dimensions innermost first
    block, type_size = GGML_QUANT_SIZES[qtype]
    data = np.asarray(t.data)
    if data.dtype != np.uint8 or data.shape != (N, K // block * type_size) or K % block:
        raise UnsupportedQuantizationError(f"GGUF tensor {t.name!r}: data {data.dtype} {data.shape} is not {N} rows of "
                                           f"{K // block} {qtype.name} blocks.")
    codes, scale, zero = _CONVERT[qtype](data.reshape(N, K // block, type_size), N)
    out = {"weight": codes, "weight_scale": scale.reshape(N, -1)}
    if zero is not None:
        out["weight_zero"] = zero.reshape(N, -1)
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
    if n_head:
        out = {k: _unpermute(v, n_head).contiguous() for k, v in out.items()}
    return SCHEMES[qtype], out


def _kept_quantized(t) -> bool:
    return Q(t.tensor_type) in _CONVERT and len(t.shape) == 2


def gguf_quantized_weights(src: "str | GGUFReader", config=None, embedding: bool = True):
    """gguf_loader.gguf_tensors with the quantized blocks kept: -> (iterator of (HF name, tensor), {HF module prefix:
    QuantScheme}). Every 2-D tensor of a type in SCHEMES (the linears' weights, the embedding, an untied lm_head) gives
    `P.weight` (codes), `P.weight_scale` and, with has_zero, `P.weight_zero` (gguf_tensor_to_quantized); everything
    else (norms, biases, F32 / F16 / BF16 weights, and quantized types not in SCHEMES, e.g. Q5_K, which stay float
    layers) comes as gguf_tensors gives it, dequantized when read. The schemes are known before anything is read; each
    tensor is converted when the iterator reaches it.

    A tied head has no tensors and no entry of its own (as in gguf_tensors): it computes with model.embed_tokens'.
    embedding=False: the embedding (and so a tied head) comes as float, like the norms.
    config: the HF config of the same file (load_gguf_config), checked against it (tied head)."""
    reader = _open(src)
    entries = list(gguf_tensors(reader))  # (HF name, GGUFTensor); nothing read yet
    names = {name for name, _ in entries}
    if config is not None and bool(getattr(config, "tie_word_embeddings", False)) != ("lm_head.weight" not in names):
        raise UnsupportedQuantizationError(f"config.tie_word_embeddings={config.tie_word_embeddings} does not match "
                                           f"the GGUF file, which {'has' if 'lm_head.weight' in names else 'lacks'} "
                                           f"output.weight.")
    schemes = {name.rpartition(".")[0]: SCHEMES[Q(g.t.tensor_type)] for name, g in entries
               if name.endswith(".weight") and _kept_quantized(g.t)
               and (embedding or name != "model.embed_tokens.weight")}

    def weights():
        for name, g in entries:
            prefix = name.rpartition(".")[0]
            if name.endswith(".weight") and prefix in schemes:
                _, tensors = gguf_tensor_to_quantized(g.t, g.n_head)
                for key, tensor in tensors.items():
                    yield f"{prefix}.{key}", tensor
            else:
                yield name, g

    return weights(), schemes
