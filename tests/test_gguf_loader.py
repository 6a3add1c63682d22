"""graphinfer's GGUF loader against transformers' own GGUF loading of the bundled SmolLM2 (Q4_1/Q8_0/F32),
plus tiny GGUFs written here for the error path and the F16 / Q8_0 / un-permutation round trips."""
import copy
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models import gguf_loader
from graphinfer.models.gguf_loader import load_gguf_config, load_gguf_state_dict, load_gguf_tokenizer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def path(smollm2_path):
    return smollm2_path


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):  # transformers' own GGUF load, shared with the other real-weights tests (conftest)
    return hf_smollm2[0]


def test_config_matches_transformers(path, hf_model):
    ours = load_gguf_config(path)
    # hf_model.config is what AutoConfig.from_pretrained(d, gguf_file=name) built (from_pretrained calls it);
    # reusing it saves a second ~4 s GGUF metadata parse.
    hf = hf_model.config
    assert type(ours) is transformers.LlamaConfig
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "pad_token_id", "attention_bias"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.architectures == ["LlamaForCausalLM"]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert (ours.num_hidden_layers, ours.hidden_size, ours.num_attention_heads, ours.num_key_value_heads) == (30, 576, 9, 3)


def test_state_dict_matches_transformers(path, hf_model):
    ours = load_gguf_state_dict(path)
    hf = hf_model.state_dict()
    assert "lm_head.weight" not in ours  # tied to the embedding
    assert set(ours) == set(hf) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == hf[name].shape, name
        assert torch.equal(tensor, hf[name]), name  # bit-exact: dequantization, naming and Q/K un-permutation


@pytest.fixture(scope="module")
def tokenizers(path, tmp_path_factory):
    """Two load_gguf_tokenizer calls on an empty cache: dict with `first` (converted from the GGUF), `second`,
    `hf` (a copy of what transformers' own GGUF conversion returned inside the first call, before our fix:
    capturing it saves a second ~10 s conversion) and `calls` (the AutoTokenizer calls the second load made)."""
    out = {"calls": []}
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        tok = real(cls, *args, **kwargs)
        if "gguf_file" in kwargs:
            out["hf"] = copy.deepcopy(tok)
        out["calls"].append((args, kwargs))
        return tok

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHINFER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
        out["first"] = load_gguf_tokenizer(path)
        assert [list(kw) for _, kw in out["calls"]] == [["gguf_file"]]  # a miss: converted from the GGUF
        out["calls"].clear()
        out["second"] = load_gguf_tokenizer(path)
        out["cache"] = gguf_loader._tokenizer_cache_dir(path)
    return out


def test_tokenizer_special_tokens_and_ids(tokenizers):
    tok, hf = tokenizers["first"], tokenizers["hf"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == "<|im_end|>"
    assert hf.eos_token_id == 1  # transformers' converter takes eos from the bos id: why we fix it
    ids = tok(PROMPT).input_ids
    assert ids == hf(PROMPT).input_ids == [504, 3575, 282, 4649, 314]
    assert tok.decode(ids) == PROMPT


def test_tokenizer_chat_template(tokenizers):
    tok = tokenizers["first"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_tokenizer_cache_hit(tokenizers):
    first, second, cache = tokenizers["first"], tokenizers["second"], tokenizers["cache"]
    assert tokenizers["calls"] == [((cache,), {})]  # loaded from the cache dir, no GGUF conversion
    assert os.path.isfile(os.path.join(cache, "tokenizer.json"))
    text = "<|im_start|>user\nThe capital of France is hé 😀<|im_end|>"
    assert second(PROMPT).input_ids == first(PROMPT).input_ids
    assert second(text).input_ids == first(text).input_ids
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(second, attr) == getattr(first, attr), attr
    assert len(second) == len(first)


def _write_gguf(file, arch, tensors, **kv):
    """tensors: name -> float32 array (stored F32/F16 by its dtype) or (array, quant type)."""
    w = gguf.GGUFWriter(str(file), arch)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, gguf.quants.quantize(t[0], t[1]), raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(file)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fast_reader_reads_what_gguf_reads(tmp_path, endian):
    """FastGGUFReader (its own slicing under gguf's parser) against gguf.GGUFReader: every field's parts, types and
    values, every tensor, for strings, string arrays, numbers, and both byte orders."""
    file = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(file, "llama", endianess=endian)
    w.add_token_list(["<s>", "a", "bé", "日本"])
    w.add_token_scores([0.0, -1.5, -2.0, 3.25])
    w.add_token_merges(["a b", "b é"])
    w.add_bool("x.flag", True)
    w.add_uint64("x.big", 1 << 40)
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", gguf.quants.quantize(np.ones((2, 32), np.float32), gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    ref, fast = gguf.GGUFReader(file), gguf_loader.FastGGUFReader(file)
    assert list(fast.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = fast.fields[name]
        assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types) and len(g.parts) == len(f.parts), name
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
        assert g.contents() == f.contents(), name
    for t, r in zip(fast.tensors, ref.tensors, strict=True):
        assert (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) == (r.name, r.tensor_type, r.shape.tolist(),
                                                                              r.data_offset)
        assert t.data.dtype == r.data.dtype and np.array_equal(t.data, r.data)


def test_unknown_architecture(tmp_path):
    file = _write_gguf(tmp_path / "m.gguf", "mamba", {"token_embd.weight": np.ones((4, 8), np.float32)})
    with pytest.raises(UnsupportedArchitectureError, match="llama, qwen2, qwen3"):
        load_gguf_config(file)
    with pytest.raises(ValueError):  # a UnsupportedArchitectureError is also a ValueError
        load_gguf_state_dict(file)


def test_unsupported_tensor_type_and_name(tmp_path):
    kv = dict(head_count=2, head_count_kv=2)
    file = _write_gguf(tmp_path / "f64.gguf", "llama", {"output_norm.weight": np.ones(8, np.float64)}, **kv)
    with pytest.raises(UnsupportedArchitectureError, match="output_norm.weight.*F64"):
        load_gguf_state_dict(file)
    file = _write_gguf(tmp_path / "rf.gguf", "llama", {"rope_freqs.weight": np.ones(8, np.float32)}, **kv)
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs.weight"):
        load_gguf_state_dict(file)


def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_f16_q8_0_roundtrip_and_unpermute(tmp_path):
    rng = np.random.default_rng(0)
    emb, up, q, k = (rng.standard_normal(s).astype(np.float32) for s in ((16, 64), (96, 64), (64, 64), (32, 64)))
    norm = rng.standard_normal(64).astype(np.float32)
    file = _write_gguf(tmp_path / "tiny.gguf", "llama", {
        "token_embd.weight": (emb, gguf.GGMLQuantizationType.Q8_0),
        "output_norm.weight": norm,
        "blk.0.ffn_up.weight": up.astype(np.float16),
        "blk.0.attn_q.weight": _permute(q, 4).astype(np.float16),
        "blk.0.attn_k.weight": (_permute(k, 2), gguf.GGMLQuantizationType.Q8_0),
        "output.weight": up[:16].astype(np.float16),
    }, block_count=1, embedding_length=64, feed_forward_length=96, head_count=4, head_count_kv=2,
        context_length=128, rope_freq_base=10000.0, layer_norm_rms_eps=1e-6, vocab_size=16)

    config = load_gguf_config(file)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings is False and config.vocab_size == 16

    sd = load_gguf_state_dict(file)
    assert set(sd) == {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.weight",
                       "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                       "lm_head.weight"}
    t = lambda a: torch.from_numpy(np.asarray(a, np.float32))
    assert torch.equal(sd["model.norm.weight"], t(norm))
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], t(up.astype(np.float16)))
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], t(q.astype(np.float16)))  # un-permuted
    for name, ref in (("model.embed_tokens.weight", emb), ("model.layers.0.self_attn.k_proj.weight", k)):
        # Q8_0: per 32 values a scale d = absmax / 127 (stored f16) and int8 q; |error| <= d / 2 + 127 * f16 rounding of d
        err = (sd[name] - t(ref)).abs().max().item()
        assert sd[name].shape == ref.shape and 0 < err <= np.abs(ref).max() / 127 * 0.57, name
    for dtype in (torch.float16, torch.bfloat16):
        assert all(w.dtype == dtype for w in load_gguf_state_dict(file, dtype).values())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_matches_transformers(arch, tmp_path):
    """Qwen GGUFs are not Q/K-permuted; q/k/v biases (qwen2) and q/k norms (qwen3) get HF names."""
    rng = np.random.default_rng(1)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    hidden, ffn, n_head, n_kv, head_dim = 64, 96, 4, 2, 32  # head_dim != hidden / n_head: must come from key_length
    t = {"token_embd.weight": r(32, hidden), "output_norm.weight": r(hidden), "output.weight": r(32, hidden),
         "blk.0.attn_q.weight": r(n_head * head_dim, hidden), "blk.0.attn_k.weight": r(n_kv * head_dim, hidden),
         "blk.0.attn_v.weight": r(n_kv * head_dim, hidden), "blk.0.attn_output.weight": r(hidden, n_head * head_dim),
         "blk.0.attn_norm.weight": r(hidden), "blk.0.ffn_norm.weight": r(hidden), "blk.0.ffn_gate.weight": r(ffn, hidden),
         "blk.0.ffn_up.weight": r(ffn, hidden), "blk.0.ffn_down.weight": r(hidden, ffn)}
    if arch == "qwen2":
        t.update({f"blk.0.attn_{x}.bias": r(n * head_dim) for x, n in (("q", n_head), ("k", n_kv), ("v", n_kv))})
    else:
        t.update({"blk.0.attn_q_norm.weight": r(head_dim), "blk.0.attn_k_norm.weight": r(head_dim)})
    file = _write_gguf(tmp_path / f"{arch}.gguf", arch, t, block_count=1, embedding_length=hidden,
                       feed_forward_length=ffn, head_count=n_head, head_count_kv=n_kv, key_length=head_dim,
                       value_length=head_dim, context_length=128, rope_freq_base=1e6, layer_norm_rms_eps=1e-6,
                       vocab_size=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.float32)

    config = load_gguf_config(file)
    assert type(config) is type(hf.config) and config.architectures == [type(hf).__name__]
    # transformers ignores key_length for these (qwen2: hidden/heads = 16, qwen3: Qwen3Config's default 128)
    assert config.head_dim == head_dim
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(hf.config, key), key
    assert not getattr(config, "attention_bias", False)  # True would give Qwen2 an o_proj bias it does not have

    ours, theirs = load_gguf_state_dict(file), hf.state_dict()
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name
    assert torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(t["blk.0.attn_q.weight"]))
