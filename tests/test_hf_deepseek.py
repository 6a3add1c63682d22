"""The DeepSeek material of tests/hf_zoo.py (DEEPSEEK, make_mtp_checkpoint) is sound test material for a native
DeepSeek-V2/V3 model: every tiny checkpoint has the documented config, is saved faithfully (per-expert tensors as
DeepSeek ships them, perturbed norms and correction biases kept, reloads to the same logits), HF's greedy oracle is
deterministic and agrees with a cache-free argmax (HF's MLA latent cache included), routing is decisive along the
prompts, the correction bias and the group limit each change HF's greedy tokens, each other feature changes its
logits, and the MTP checkpoint loads in transformers (which ignores the layer: same tokens) and in HF's own MTP
module (every tensor of the layer read)."""
import json
import os
import re

import pytest
import torch

import hf_zoo
from hf_zoo import DEEPSEEK, ZOO_PROMPTS

N_TOKENS = 16
V3_NAMES = [n for n, s in DEEPSEEK.items() if s.model_cls == "DeepseekV3ForCausalLM"]


def _ids(v):
    return re.sub(r"\W+", "_", v.label).strip("_") if isinstance(v, hf_zoo.Mutation) else v


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_entries_and_their_configs():
    import transformers

    assert list(DEEPSEEK) == ["deepseek_v3", "deepseek_v3_no_qlora", "deepseek_v2"]
    assert not set(DEEPSEEK) & (set(hf_zoo.ZOO) | set(hf_zoo.UNSUPPORTED))
    doc = hf_zoo.__doc__.partition("\nDEEPSEEK:")[2]
    table = [line.split()[0] for line in doc.splitlines() if line[:1].isalpha() and "ForCausalLM (" in line]
    assert table == list(DEEPSEEK)  # the docstring's DEEPSEEK table lists every entry, in order
    for name, spec in DEEPSEEK.items():
        assert hasattr(transformers, spec.model_cls) and hasattr(transformers, spec.config_cls), name
        c = spec.config()
        assert (c.hidden_size, c.vocab_size, c.num_hidden_layers, c.num_attention_heads) == (64, 256, 3, 4), name
        assert c.max_position_embeddings >= 512 and c.num_key_value_heads == c.num_attention_heads
        assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 16, 8, 16)
        assert (c.first_k_dense_replace, c.n_routed_experts, c.n_group, c.topk_group) == (1, 8, 4, 2)
        assert c.moe_intermediate_size == 32 and not c.tie_word_embeddings and spec.moe

    v3, no_qlora, v2 = (DEEPSEEK[n].config() for n in DEEPSEEK)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0}
    assert v3.q_lora_rank == 32 and v3.rope_parameters == yarn
    assert no_qlora.q_lora_rank is None and no_qlora.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    for c in (v3, no_qlora):
        assert c.rope_interleave is True  # HF's default, DeepSeek's layout
        assert (c.num_experts_per_tok, c.n_shared_experts, c.norm_topk_prob, c.routed_scaling_factor) == (2, 1, True, 2.5)
        assert (c.scoring_func, c.topk_method, c.num_nextn_predict_layers) == ("sigmoid", "noaux_tc", 0)
    assert v2.q_lora_rank is None and v2.rope_parameters == dict(yarn, mscale=0.707, mscale_all_dim=0.707)
    assert (v2.topk_method, v2.scoring_func, v2.num_experts_per_tok, v2.n_shared_experts) == (
        "group_limited_greedy", "softmax", 3, 2)
    assert v2.norm_topk_prob is False and v2.routed_scaling_factor == 16.0


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_checkpoint_saved_faithfully(name, deepseek_checkpoint):
    from transformers import AutoModelForCausalLM

    spec = DEEPSEEK[name]
    path = deepseek_checkpoint(name)
    files = sorted(os.listdir(path))
    assert "config.json" in files and [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"], files
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [spec.model_cls] and cfg["max_position_embeddings"] >= 512
    v3 = spec.model_cls == "DeepseekV3ForCausalLM"
    assert cfg["scoring_func"] == ("sigmoid" if v3 else "softmax") and ("topk_method" in cfg)
    assert cfg.get("num_nextn_predict_layers", 0) == 0  # HF's DeepseekV3Config default is 1: set to 0, no MTP tensors

    # On disk as DeepSeek ships: per-expert tensors, a dense layer 0, the correction bias (V3) in fp32.
    tensors = _tensors(path)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "model.layers.0.mlp.gate_proj.weight" in tensors and "model.layers.0.mlp.gate.weight" not in tensors
    for layer in (1, 2):
        pre = f"model.layers.{layer}."
        assert tensors[pre + "mlp.gate.weight"].shape == (8, 64)
        assert tensors[pre + "mlp.experts.7.gate_proj.weight"].shape == (32, 64)
        assert tensors[pre + "mlp.experts.7.down_proj.weight"].shape == (64, 32)
        assert tensors[pre + "mlp.shared_experts.up_proj.weight"].shape == (32 * spec.config().n_shared_experts, 64)
        assert tensors[pre + "self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
        assert tensors[pre + "self_attn.kv_b_proj.weight"].shape == (4 * (16 + 16), 32)
        assert (pre + "self_attn.q_a_layernorm.weight" in tensors) == (name == "deepseek_v3")
        assert (pre + "self_attn.q_proj.weight" in tensors) == (name != "deepseek_v3")
        assert (pre + "mlp.gate.e_score_correction_bias" in tensors) == v3
        assert tensors[pre + "mlp.gate.weight"].std().item() > 0.2  # routers widened (HF's init: 0.1 here)
        if v3:
            bias = tensors[pre + "mlp.gate.e_score_correction_bias"]
            assert bias.std().item() > 0.1 and bias.abs().max().item() > 0.2, bias
    norms = [k for k in tensors if "norm" in k.rpartition(".")[0].rpartition(".")[2]]
    assert any("kv_a_layernorm" in k for k in norms) and (name != "deepseek_v3" or any("q_a_layernorm" in k for k in norms))
    for k in norms:  # perturbed: no constant gain survives the save
        assert (tensors[k].max() - tensors[k].min()).item() > 0.05, k

    reloaded, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                          output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded).__name__ == spec.model_cls
    built = hf_zoo.build_model(name)
    ids = torch.tensor([ZOO_PROMPTS[-1]])
    with torch.no_grad(), hf_zoo.one_thread():
        a, b = built(ids).logits, reloaded.eval()(ids).logits
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_hf_greedy_is_deterministic_decisive_and_matches_a_cache_free_argmax(name, deepseek_checkpoint):
    path = deepseek_checkpoint(name)
    first = hf_zoo.hf_greedy(path, ZOO_PROMPTS, N_TOKENS)
    assert hf_zoo.hf_greedy(path, ZOO_PROMPTS, N_TOKENS) == first
    for prompt, expected in zip(ZOO_PROMPTS, first):
        assert len(set(expected)) >= 5, f"{name}: a degenerate continuation {expected}"
        # One forward without the cache (HF's MLA caches the latent and k_pe, and expands them every step).
        logits = hf_zoo.hf_logits(path, prompt + expected, all_positions=True)[len(prompt) - 1:-1]
        ok, why = hf_zoo.greedy_matches_hf(path, prompt, expected, logits.argmax(-1).tolist())
        assert ok, f"{name}, prompt of {len(prompt)}: {why}"
        # Routing along the whole sequence is decided by far more than fp32 noise (so another correct
        # implementation routes every token as HF does).
        margins = hf_zoo.deepseek_routing_margins(path, prompt + expected)
        assert min(margins.values()) > 5e-4, (name, len(prompt), margins)


@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in hf_zoo.DEEPSEEK_TOKEN_MUTATIONS.items() for m in ms],
                         ids=_ids)
def test_routing_features_change_the_greedy_tokens(name, mutation, deepseek_checkpoint):
    path = deepseek_checkpoint(name)
    ref = hf_zoo.hf_greedy(path, ZOO_PROMPTS, N_TOKENS)
    got = hf_zoo.mutated_greedy(path, mutation, ZOO_PROMPTS, N_TOKENS)
    assert got != ref, f"{name}: {mutation.label} leaves HF's greedy tokens as they are"


@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in hf_zoo.DEEPSEEK_MUTATIONS.items() for m in ms],
                         ids=_ids)
def test_each_feature_changes_the_logits(name, mutation, deepseek_checkpoint):
    path = deepseek_checkpoint(name)
    prompt = ZOO_PROMPTS[-1]
    ref = hf_zoo.hf_logits(path, prompt, all_positions=True)
    got = hf_zoo.mutated_logits(path, mutation, prompt)
    change = ((got - ref).abs().max() / ref.std()).item()
    assert change > 0.1, f"{name}: {mutation.label} moves the logits by only {change:.3g} of their spread"


def test_mtp_checkpoint(deepseek_checkpoint, deepseek_mtp_checkpoint):
    from transformers import AutoModelForCausalLM

    base, path = deepseek_checkpoint("deepseek_v3"), deepseek_mtp_checkpoint()
    assert sorted(os.listdir(path)) == sorted(os.listdir(base))
    with open(os.path.join(base, "config.json")) as f:
        base_cfg = json.load(f)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg == dict(base_cfg, num_nextn_predict_layers=1)

    src, tensors = _tensors(base), _tensors(path)
    assert all(torch.equal(tensors[k], v) for k, v in src.items())
    n = cfg["num_hidden_layers"]
    new = {k[len(f"model.layers.{n}."):]: v for k, v in tensors.items() if k not in src}
    assert all(k.startswith(f"model.layers.{n}.") for k in set(tensors) - set(src))
    last = {k[len(f"model.layers.{n - 1}."):]: v for k, v in src.items() if k.startswith(f"model.layers.{n - 1}.")}
    assert set(new) == set(last) | set(hf_zoo.MTP_EXTRA_TENSORS)  # a whole MoE decoder layer, plus MTP's own
    assert all(new[k].shape == v.shape and not torch.equal(new[k], v) for k, v in last.items())
    assert new["eh_proj.weight"].shape == (64, 128)
    assert torch.equal(new["embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert torch.equal(new["shared_head.head.weight"], src["lm_head.weight"])
    for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.gate.e_score_correction_bias"):
        assert new[k].shape == (64 if "norm" in k else 8,) and (new[k].max() - new[k].min()).item() > 0.05, k

    # transformers loads it, ignoring the layer (listed as unexpected: its pattern names layer 61 only)...
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert len(model.model.layers) == n
    # ... and gives the same tokens.
    assert hf_zoo.hf_greedy(path, ZOO_PROMPTS, N_TOKENS) == hf_zoo.hf_greedy(base, ZOO_PROMPTS, N_TOKENS)


def test_hf_mtp_module_reads_the_layer(deepseek_mtp_checkpoint):
    from transformers.cache_utils import MtpCache

    path = deepseek_mtp_checkpoint()
    main, mtp = hf_zoo.load_hf_mtp(path)  # MtpModel.from_pretrained raises on any missing tensor
    tensors = _tensors(path)
    pre = f"model.layers.{main.config.num_hidden_layers}."
    layer = mtp.layers[0]
    pairs = [(layer.enorm.weight, "enorm.weight"), (layer.hnorm.weight, "hnorm.weight"),
             (layer.eh_proj.weight, "eh_proj.weight"), (layer.post_norm.weight, "shared_head.norm.weight"),
             (layer.mtp_block.mlp.gate.e_score_correction_bias, "mlp.gate.e_score_correction_bias"),
             (layer.mtp_block.mlp.experts.gate_up_proj[5, :32], "mlp.experts.5.gate_proj.weight"),
             (layer.mtp_block.mlp.experts.gate_up_proj[5, 32:], "mlp.experts.5.up_proj.weight"),
             (layer.mtp_block.self_attn.kv_b_proj.weight, "self_attn.kv_b_proj.weight")]
    for got, key in pairs:
        assert torch.equal(got, tensors[pre + key]), key
    assert type(layer.mtp_block.mlp).__name__ == "DeepseekV3MoE"

    prompt = ZOO_PROMPTS[1]
    logits = hf_zoo.hf_mtp_logits(path, prompt)
    assert logits.shape == (len(prompt) - 1, 256) and len(set(logits.argmax(-1).tolist())) > 3
    # hf_mtp_logits' last row is what MtpModel's own forward (generate(use_mtp=True)'s drafter) drafts.
    ids = torch.tensor([prompt])
    with torch.no_grad(), hf_zoo.one_thread():
        hidden = main(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
        positions = torch.arange(len(prompt)).unsqueeze(0)
        _, drafted, _ = mtp(input_ids=ids[:, 1:], last_hidden_states=hidden[:, :-1],
                            attention_mask=torch.ones(1, len(prompt) - 1, dtype=torch.long),
                            position_ids=positions[:, 1:], mtp_cache=MtpCache(config=main.config.get_mtp_config()))
    assert torch.allclose(drafted[0, -1], logits[-1], atol=1e-5, rtol=1e-5)
