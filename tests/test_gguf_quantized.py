"""GGUF tensors kept quantized (graphinfer/quantization/gguf.py): the packed forms dequantize
(ops.quant.dequantize_weight) to exactly what gguf.quants.dequantize gives for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, for
blocks gguf-py quantizes and for random valid blocks, in a written GGUF with llama's permuted Q / K rows, and for every
tensor of the bundled SmolLM2 (Q4_1 / Q8_0), whose packed form is also measured against fp32."""
import time
import types

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from graphinfer.errors import UnsupportedQuantizationError
from graphinfer.models.gguf_loader import GGUFTensor, _unpermute, gguf_tensors, load_gguf_config, load_gguf_state_dict
from graphinfer.ops.quant import dequantize_weight, unpack_int4
from graphinfer.quantization.gguf import SCHEMES, gguf_quantized_weights, gguf_tensor_to_quantized
from graphinfer.quantization.linear import QuantizedLinear
from graphinfer.quantization.scheme import QuantScheme

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # gguf-py 0.19 quantizes these; the K-quants it only dequantizes
_F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets in a block


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes] of valid random blocks: random code / sub-scale bytes, small finite random fp16 scale fields."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        d = rng.uniform(-0.05, 0.05, b.shape[:2]).astype(np.float16)
        d.flat[:3] = (0.0, 6e-8, -6e-5)  # a zero and fp16 subnormals too
        b[..., off:off + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


def reader_tensor(qtype, data, rows, cols, name="t"):
    """The fields of gguf's ReaderTensor the converter reads (.shape lists the innermost dimension first)."""
    return types.SimpleNamespace(name=name, tensor_type=qtype, data=data, shape=np.array([cols, rows], np.uint32))


def assert_same(ours: torch.Tensor, ref: np.ndarray):
    """Equal fp32 values, and equal bits except possibly the sign of a zero: Q4_0 gives (q - 8) * d = -0.0 where
    d < 0 and q = 8 (gguf-py), q * d - 8 d = +0.0 (ours)."""
    ref = torch.from_numpy(np.ascontiguousarray(ref, np.float32)).reshape(ours.shape)
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)
    same_bits = ours.view(torch.int32) == ref.view(torch.int32)
    assert bool((same_bits | ((ours == 0) & (ref == 0))).all())


def dequant(scheme: QuantScheme, t: dict) -> torch.Tensor:
    return dequantize_weight(t["weight"], t["weight_scale"], t.get("weight_zero"), scheme.bits)


def expected_forms(scheme: QuantScheme, rows: int, cols: int) -> dict:
    """name -> (dtype, shape) of a QuantizedLinear(cols -> rows) with this scheme: what the loader fills."""
    layer = QuantizedLinear(cols, rows, scheme, device="meta")
    return {n: (p.dtype, tuple(p.shape)) for n, p in layer.named_parameters()}


@pytest.mark.parametrize("qtype,source", [(q, "gguf-quantize") for q in QUANTIZABLE]
                         + [(q, "random-blocks") for q in TYPES], ids=lambda x: getattr(x, "name", x))
def test_block_types_match_gguf_dequantize(qtype, source):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 24, 768  # three K-quant super-blocks a row
    if source == "gguf-quantize":
        w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2, (rows, 1)).astype(np.float32)
        w[0, :32] = 0  # an all-zero block: d = 0
        data = quantize(w, qtype)
    else:
        data = random_blocks(qtype, rows, cols, rng)
    scheme, t = gguf_tensor_to_quantized(reader_tensor(qtype, data, rows, cols))
    assert scheme == SCHEMES[qtype] and scheme.weight_only
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == expected_forms(scheme, rows, cols)
    assert_same(dequant(scheme, t), dequantize(data, qtype))
    if qtype == Q.Q8_0:  # the codes are the file's bytes, untouched
        codes = data.reshape(rows, -1, 34)[..., 2:].copy().view(np.int8).reshape(rows, cols)
        assert torch.equal(t["weight"], torch.from_numpy(codes))
    if scheme.bits == 4:
        assert int(unpack_int4(t["weight"]).max()) <= 15


def test_schemes_per_type():
    assert SCHEMES == {
        Q.Q4_0: QuantScheme(bits=4, group_size=32, has_zero=True, scale_dtype="float16"),
        Q.Q4_1: QuantScheme(bits=4, group_size=32, has_zero=True, scale_dtype="float16"),
        Q.Q4_K: QuantScheme(bits=4, group_size=32, has_zero=True),
        Q.Q8_0: QuantScheme(bits=8, group_size=32, scale_dtype="float16"),
        Q.Q6_K: QuantScheme(bits=8, group_size=16)}


@pytest.mark.parametrize("qtype", (Q.Q4_0, Q.Q4_K, Q.Q6_K), ids=lambda q: q.name)
def test_row_permutation_follows_the_float_loader(qtype):
    rng = np.random.default_rng(3)
    rows, cols, n_head = 64, 256, 4
    data = random_blocks(qtype, rows, cols, rng)
    scheme, t = gguf_tensor_to_quantized(reader_tensor(qtype, data, rows, cols), n_head=n_head)
    ref = _unpermute(torch.from_numpy(dequantize(data, qtype)).reshape(rows, cols), n_head)
    assert torch.equal(dequant(scheme, t), ref)


def test_unsupported_types_are_refused():
    rng = np.random.default_rng(4)
    data = quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q5_0)
    with pytest.raises(UnsupportedQuantizationError, match="Q5_0.*supported: Q4_0, Q4_1, Q4_K, Q8_0, Q6_K"):
        gguf_tensor_to_quantized(reader_tensor(Q.Q5_0, data, 4, 64))
    with pytest.raises(UnsupportedQuantizationError, match="F32"):
        gguf_tensor_to_quantized(reader_tensor(Q.F32, np.ones((4, 64), np.float32), 4, 64))


def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, on rows (of floats or of blocks)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(file, tensors: dict, **kv):
    """tensors: name -> float32 / float16 array (F32 / F16), or (uint8 [rows, bytes] blocks, quant type)."""
    w = gguf.GGUFWriter(str(file), "llama")
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(file)


def test_quantized_weights_of_a_written_gguf(tmp_path):
    """Every kept type in one llama file (HF names, schemes, the Q / K rows permuted in the file); a Q5_0 and an F16
    weight and the norms come as gguf_tensors gives them (float)."""
    rng = np.random.default_rng(5)
    hidden, ffn, n_head, n_kv, vocab = 256, 512, 4, 2, 32
    blocks = lambda q, r, c: random_blocks(q, r, c, rng)
    q_blocks, k_blocks = blocks(Q.Q4_K, hidden, hidden), blocks(Q.Q4_0, hidden // 2, hidden)
    tensors = {
        "token_embd.weight": (quantize(rng.standard_normal((vocab, hidden)).astype(np.float32), Q.Q8_0), Q.Q8_0),
        "output_norm.weight": rng.standard_normal(hidden).astype(np.float32),
        "output.weight": (blocks(Q.Q4_1, vocab, hidden), Q.Q4_1),
        "blk.0.attn_norm.weight": rng.standard_normal(hidden).astype(np.float32),
        "blk.0.attn_q.weight": (_permute(q_blocks, n_head), Q.Q4_K),
        "blk.0.attn_k.weight": (_permute(k_blocks, n_kv), Q.Q4_0),
        "blk.0.attn_v.weight": (blocks(Q.Q8_0, hidden // 2, hidden), Q.Q8_0),
        "blk.0.attn_output.weight": (blocks(Q.Q6_K, hidden, hidden), Q.Q6_K),
        "blk.0.ffn_norm.weight": rng.standard_normal(hidden).astype(np.float32),
        "blk.0.ffn_gate.weight": rng.standard_normal((ffn, hidden)).astype(np.float16),
        "blk.0.ffn_up.weight": (quantize(rng.standard_normal((ffn, hidden)).astype(np.float32), Q.Q5_0), Q.Q5_0),
        "blk.0.ffn_down.weight": (blocks(Q.Q6_K, hidden, ffn), Q.Q6_K),
    }
    file = _write_gguf(tmp_path / "mixed.gguf", tensors, block_count=1, embedding_length=hidden,
                       feed_forward_length=ffn, head_count=n_head, head_count_kv=n_kv, context_length=128,
                       rope_freq_base=10000.0, layer_norm_rms_eps=1e-6, vocab_size=vocab)
    config = load_gguf_config(file)
    weights, schemes = gguf_quantized_weights(file, config)
    L = "model.layers.0."
    assert schemes == {"model.embed_tokens": SCHEMES[Q.Q8_0], "lm_head": SCHEMES[Q.Q4_1],
                       L + "self_attn.q_proj": SCHEMES[Q.Q4_K], L + "self_attn.k_proj": SCHEMES[Q.Q4_0],
                       L + "self_attn.v_proj": SCHEMES[Q.Q8_0], L + "self_attn.o_proj": SCHEMES[Q.Q6_K],
                       L + "mlp.down_proj": SCHEMES[Q.Q6_K]}
    ours = dict(weights)
    floats = load_gguf_state_dict(file)  # the float loader: dequantized, HF names, Q / K rows un-permuted
    assert set(ours) == {f"{p}.{n}" for p, s in schemes.items() for n in ("weight", "weight_scale")
                         + (("weight_zero",) if s.has_zero else ())} | (set(floats) - {f"{p}.weight" for p in schemes})
    for prefix, scheme in schemes.items():
        t = {n: ours[f"{prefix}.{n}"] for n in ("weight", "weight_scale", "weight_zero") if f"{prefix}.{n}" in ours}
        rows, cols = floats[f"{prefix}.weight"].shape
        assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == expected_forms(scheme, rows, cols), prefix
        assert torch.equal(dequant(scheme, t), floats[f"{prefix}.weight"]), prefix
    assert torch.equal(dequant(schemes[L + "self_attn.q_proj"], {n: ours[f"{L}self_attn.q_proj.{n}"] for n in
                       ("weight", "weight_scale", "weight_zero")}),
                       torch.from_numpy(dequantize(q_blocks, Q.Q4_K)).reshape(hidden, hidden))  # back in HF row order
    for name in (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight", "model.norm.weight"):
        assert isinstance(ours[name], GGUFTensor) and torch.equal(ours[name].read(), floats[name]), name

    weights, float_embedding = gguf_quantized_weights(file, config, embedding=False)
    assert float_embedding == {p: s for p, s in schemes.items() if p != "model.embed_tokens"}
    embed = dict(weights)["model.embed_tokens.weight"]
    assert isinstance(embed, GGUFTensor) and torch.equal(embed.read(), floats["model.embed_tokens.weight"])

    config.tie_word_embeddings = True  # the file has output.weight: a config saying tied does not describe it
    with pytest.raises(UnsupportedQuantizationError, match="tie_word_embeddings"):
        gguf_quantized_weights(file, config)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path):
    return gguf.GGUFReader(smollm2_path)


def test_smollm2_kept_quantized(smollm2_reader):
    """The bundled SmolLM2: 210 Q4_1 linears and the Q8_0 embedding (its tied head) kept quantized, each equal to
    the float loader's dequantized tensor; converting the file takes well under a second here; the packed
    model is about a fifth of its fp32 size."""
    reader = smollm2_reader
    types_ = {}
    for t in reader.tensors:
        types_[t.tensor_type.name] = types_.get(t.tensor_type.name, 0) + 1
    assert types_ == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    start = time.perf_counter()
    weights, schemes = gguf_quantized_weights(reader, load_gguf_config(reader))
    ours = dict(weights)
    seconds = time.perf_counter() - start
    assert len(schemes) == 211 and schemes["model.embed_tokens"] == SCHEMES[Q.Q8_0] and "lm_head" not in schemes
    assert sum(s == SCHEMES[Q.Q4_1] for s in schemes.values()) == 210
    assert seconds < 30, seconds  # vectorised: ~0.5 s on one core here

    floats = dict(gguf_tensors(reader))  # HF name -> GGUFTensor, dequantized (and un-permuted) when read
    for prefix, scheme in schemes.items():
        t = {n: ours[f"{prefix}.{n}"] for n in ("weight", "weight_scale", "weight_zero") if f"{prefix}.{n}" in ours}
        assert torch.equal(dequant(scheme, t), floats[f"{prefix}.weight"].read()), prefix

    packed = sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 4 * int(np.prod(v.shape))
                 for v in ours.values())  # the float tensors (norms) as fp32
    fp32 = 4 * sum(int(t.n_elements) for t in reader.tensors)
    print(f"SmolLM2 packed: {packed / 2**20:.1f} MiB, fp32: {fp32 / 2**20:.1f} MiB ({packed / fp32:.1%}); "
          f"converted in {seconds:.2f} s")
    assert packed / fp32 < 0.30
    # weight traffic of a decode step at the file's width (fp16 scales and mins): 5 bits a weight for Q4_1 (16 bytes
    # of codes + 2 + 2 per block of 32), 8.5 for Q8_0, as llama.cpp reads them
    for prefix, bits in (("model.layers.0.mlp.down_proj", 5.0), ("model.embed_tokens", 8.5)):
        parts = [ours[f"{prefix}.{n}"] for n in ("weight", "weight_scale", "weight_zero") if f"{prefix}.{n}" in ours]
        weights_ = floats[f"{prefix}.weight"].read().numel()
        assert 8 * sum(p.numel() * p.element_size() for p in parts) / weights_ == bits, prefix
