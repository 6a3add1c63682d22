"""PEFT LoRA adapters read by graphinfer.lora.load_adapter, checked against peft itself: for every adapted module,
b @ a equals the weight delta of peft's merge_and_unload() (merged - base). Plus the refusals (each message names
the field or module), LoRARequest's vLLM semantics and the CPU LRU."""
import copy
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from graphinfer.errors import InvalidRequestError, LoRAAdapterError  # noqa: E402
from graphinfer.lora import LoRACPUCache, LoRAAdapter, LoRALayerWeights, LoRARequest, load_adapter  # noqa: E402

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(hidden=64, layers=2):
    cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=128,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _qwen3():
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(1)
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


def _base_shapes(model) -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n != "lm_head"}


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def qwen3():
    return _qwen3()


def _save(base, out_dir, seed=0, safe=True, **lora_kwargs):
    """A PEFT adapter on a copy of base (non-zero B), saved to out_dir; returns the PeftModel."""
    kwargs = dict(r=8, lora_alpha=16, target_modules=LLAMA_ALL, init_lora_weights=False)
    kwargs.update(lora_kwargs)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kwargs))
    model.save_pretrained(str(out_dir), safe_serialization=safe)
    return model


def _peft_deltas(base, peft_model) -> dict[str, torch.Tensor]:
    """merged - base weight of every Linear peft changed."""
    merged = dict(peft_model.merge_and_unload().named_modules())
    deltas = {}
    for name, m in base.named_modules():
        if isinstance(m, nn.Linear):
            d = merged[name].weight.detach() - m.weight.detach()
            if d.abs().max() > 0:
                deltas[name] = d
    return deltas


def _check_against_peft(base, adapter_dir, peft_model, max_lora_rank=16):
    adapter = load_adapter(str(adapter_dir), _base_shapes(base), max_lora_rank, torch.float32)
    deltas = _peft_deltas(base, peft_model)
    assert set(adapter.modules) == set(deltas)
    for name, w in adapter.modules.items():
        assert w.a.dtype == torch.float32 and w.a.is_contiguous() and w.b.is_contiguous() and w.a.device.type == "cpu"
        torch.testing.assert_close(w.b @ w.a, deltas[name], rtol=1e-5, atol=1e-6)
    return adapter


def test_llama_all_projections(llama, tmp_path):
    model = _save(llama, tmp_path)
    adapter = _check_against_peft(llama, tmp_path, model)
    assert isinstance(adapter, LoRAAdapter) and adapter.rank == 8
    assert len(adapter.modules) == 2 * 7
    w = adapter.modules["model.layers.1.mlp.down_proj"]
    assert isinstance(w, LoRALayerWeights) and w.a.shape == (8, 128) and w.b.shape == (64, 8)


def test_rslora(llama, tmp_path):
    model = _save(llama, tmp_path, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    _check_against_peft(llama, tmp_path, model)


def test_rank_and_alpha_pattern(llama, tmp_path):
    model = _save(llama, tmp_path, rank_pattern={"model.layers.0.self_attn.q_proj": 4, "v_proj": 2},
                  alpha_pattern={"layers.1.mlp.down_proj": 3, "v_proj": 5})
    adapter = _check_against_peft(llama, tmp_path, model)
    ranks = {n: w.rank for n, w in adapter.modules.items()}
    assert ranks["model.layers.0.self_attn.q_proj"] == 4 and ranks["model.layers.1.self_attn.q_proj"] == 8
    assert ranks["model.layers.0.self_attn.v_proj"] == 2 and ranks["model.layers.1.self_attn.v_proj"] == 2
    assert adapter.rank == 8


def test_target_modules_regex(llama, tmp_path):
    model = _save(llama, tmp_path, target_modules=r".*\.layers\.1\..*(q_proj|down_proj)")
    adapter = _check_against_peft(llama, tmp_path, model)
    assert set(adapter.modules) == {"model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"}


def test_bin_format_and_dropout_accepted(llama, tmp_path):
    model = _save(llama, tmp_path, safe=False, lora_dropout=0.1, target_modules=["k_proj", "up_proj"])
    assert (tmp_path / "adapter_model.bin").is_file() and not (tmp_path / "adapter_model.safetensors").exists()
    _check_against_peft(llama, tmp_path, model)


def test_adapter_name_segment_and_dtype(llama, tmp_path):
    """Keys with the adapter name left in (<module>.lora_A.default.weight) read the same; dtype is honoured."""
    _save(llama, tmp_path, target_modules=["q_proj"])
    ref = load_adapter(str(tmp_path), _base_shapes(llama), 8, torch.float32)
    f = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(f))
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in tensors.items()}, str(f))
    got = load_adapter(str(tmp_path), _base_shapes(llama), 8, torch.bfloat16)
    assert set(got.modules) == set(ref.modules)
    for name, w in got.modules.items():
        assert w.a.dtype == w.b.dtype == torch.bfloat16
        torch.testing.assert_close(w.b.float(), ref.modules[name].b, rtol=1e-2, atol=1e-2)


def test_qwen3(qwen3, tmp_path):
    model = _save(qwen3, tmp_path, target_modules=LLAMA_ALL)
    adapter = _check_against_peft(qwen3, tmp_path, model)
    assert adapter.modules["model.layers.0.self_attn.q_proj"].b.shape == (64, 8)  # 4 heads x head_dim 16


# ---- refusals -------------------------------------------------------------------------------------------------


def _refused(match, path, shapes, max_lora_rank=16):
    with pytest.raises(LoRAAdapterError, match=match) as e:
        load_adapter(str(path), shapes, max_lora_rank, torch.float32)
    assert str(path) in str(e.value)
    return str(e.value)


def test_refuses_dora(llama, tmp_path):
    _save(llama, tmp_path, use_dora=True, target_modules=["q_proj"])
    _refused("use_dora.*DoRA.*not supported", tmp_path, _base_shapes(llama))


def test_refuses_rank_above_max(llama, tmp_path):
    _save(llama, tmp_path, target_modules=["q_proj"])
    msg = _refused("rank 8, above max_lora_rank=4", tmp_path, _base_shapes(llama), max_lora_rank=4)
    assert "--max-lora-rank" in msg and "model.layers.0.self_attn.q_proj" in msg


def test_refuses_unknown_module(tmp_path):
    deeper = _llama(layers=3)
    _save(deeper, tmp_path, target_modules=["o_proj"])
    shapes = {n: s for n, s in _base_shapes(deeper).items() if ".layers.2." not in n}
    _refused(r"module 'model\.layers\.2\.self_attn\.o_proj' is not a LoRA-targetable Linear", tmp_path, shapes)


def test_refuses_other_model_size(llama, tmp_path):
    _save(llama, tmp_path, target_modules=["gate_proj"])
    _refused(r"'model\.layers\.0\.mlp\.gate_proj': shapes do not match the base model.*another model size",
             tmp_path, _base_shapes(_llama(hidden=32)))


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_refuses_embeddings_and_head(llama, tmp_path, target):
    _save(llama, tmp_path, target_modules=["q_proj", target])
    _refused(rf"'{'model.embed_tokens' if target == 'embed_tokens' else 'lm_head'}'.*embed_tokens, lm_head.*not "
             r"supported", tmp_path, _base_shapes(llama))


def test_refuses_modules_to_save(llama, tmp_path):
    _save(llama, tmp_path, target_modules=["q_proj"], modules_to_save=["lm_head"])
    _refused(r"modules_to_save=\['lm_head'\] is not supported", tmp_path, _base_shapes(llama))


def test_refuses_missing_files(llama, tmp_path):
    _refused("directory does not exist", tmp_path / "nope", _base_shapes(llama))
    _refused("no adapter_config.json", tmp_path, _base_shapes(llama))
    _save(llama, tmp_path / "a", target_modules=["q_proj"])
    (tmp_path / "a" / "adapter_model.safetensors").unlink()
    _refused("no adapter_model.safetensors or adapter_model.bin", tmp_path / "a", _base_shapes(llama))


def _edit_config(path, **fields):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_weights(path, fn):
    f = path / "adapter_model.safetensors"
    save_file(fn(load_file(str(f))), str(f))


def test_refuses_bias_and_config_mismatch(llama, tmp_path):
    _save(llama, tmp_path, target_modules=["q_proj", "v_proj"])
    shapes = _base_shapes(llama)
    _edit_config(tmp_path, bias="all")
    _refused("bias='all' is not supported", tmp_path, shapes)
    _edit_config(tmp_path, bias="none", target_modules=["q_proj"])  # weights of v_proj the config does not target
    _refused(r"'model\.layers\.0\.self_attn\.v_proj'.*target_modules=\['q_proj'\] does not target it", tmp_path,
             shapes)
    _edit_config(tmp_path, target_modules=["q_proj", "v_proj"], r=4)
    _refused(r"rank 8 in its weights, but adapter_config.json says r=4", tmp_path, shapes)


def test_refuses_bad_weights(llama, tmp_path):
    _save(llama, tmp_path, target_modules=["q_proj"])
    shapes = _base_shapes(llama)
    key_b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"

    def inf(t):
        t[key_b][0, 0] = float("inf")
        return t
    _edit_weights(tmp_path, inf)
    _refused(r"'model\.layers\.1\.self_attn\.q_proj': lora_B holds non-finite", tmp_path, shapes)

    def narrow(t):
        t[key_b] = t[key_b][:, :4].contiguous()
        return t
    _edit_weights(tmp_path, narrow)
    _refused(r"'model\.layers\.1\.self_attn\.q_proj': ranks disagree", tmp_path, shapes)


# ---- LoRARequest, LoRACPUCache --------------------------------------------------------------------------------


def test_lora_request():
    a = LoRARequest("sql", 1, "/adapters/sql")
    assert (a.name, a.adapter_id, a.path, a.base_model_name) == ("sql", 1, "/adapters/sql", None)
    assert a == LoRARequest("sql", 2, "/elsewhere") and hash(a) == hash(LoRARequest("sql", 2, "/elsewhere"))
    assert a != LoRARequest("chat", 1, "/adapters/sql") and a != "sql"
    assert len({a, LoRARequest("sql", 1, "/adapters/sql"), LoRARequest("chat", 3, "/c")}) == 2
    b = pickle.loads(pickle.dumps(LoRARequest("chat", 3, "/c", base_model_name="llama")))
    assert (b.lora_name, b.lora_int_id, b.lora_path, b.base_model_name) == ("chat", 3, "/c", "llama")
    for bad in (0, -1):
        with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
            LoRARequest("x", bad, "/p")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("x", 1)


def test_cpu_cache_lru():
    cache = LoRACPUCache(2)
    assert cache.put(1, "a") == [] and cache.put(2, "b") == []
    assert cache.get(1) == "a"  # 2 is now the least recently used
    assert cache.put(3, "c") == [(2, "b")]
    assert cache.ids() == [1, 3] and 2 not in cache and 3 in cache and len(cache) == 2
    assert cache.get(2) is None
    assert cache.put(1, "a2") == [] and cache.ids() == [3, 1]  # a re-put refreshes, evicts nothing
    assert cache.remove(3) == "c" and cache.remove(3) is None and cache.ids() == [1]
