"""The HF zoo (tests/hf_zoo.py) is sound test material: every tiny checkpoint builds, is saved faithfully (reloads to
the same logits, no missing or unexpected keys, perturbed constants kept), HF's greedy oracle is deterministic and
agrees with a cache-free argmax loop, the prompts cross every sliding window, and each special feature changes HF's
logits (a path that ignored it could not match). Also the unsupported checkpoints for the refusal tests."""
import json
import os
import re

import pytest
import torch

import hf_zoo
from hf_zoo import UNSUPPORTED, ZOO, ZOO_PROMPTS

NATIVE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


def test_zoo_covers_the_long_tail():
    import transformers

    assert len(ZOO) >= 14
    for name, spec in {**ZOO, **UNSUPPORTED}.items():
        assert hasattr(transformers, spec.model_cls) and hasattr(transformers, spec.config_cls), name
    assert not NATIVE & {s.model_cls for s in ZOO.values()}
    assert sum(s.moe for s in ZOO.values()) >= 4
    assert sum(s.sliding_window is not None for s in ZOO.values()) >= 4
    tied = [bool(s.config().tie_word_embeddings) for s in ZOO.values()]
    assert sum(tied) >= 2 and len(tied) - sum(tied) >= 2
    assert sum(s.shard is not None for s in ZOO.values()) >= 1
    zoo_doc = hf_zoo.__doc__.partition("\nDEEPSEEK:")[0]  # DEEPSEEK's own table follows (tests/test_hf_deepseek.py)
    table = [line.split()[0] for line in zoo_doc.splitlines() if line[:1].isalpha() and "ForCausalLM (" in line]
    assert table == list(ZOO)  # the docstring's table lists every entry, in order
    assert not set(ZOO) & set(hf_zoo.DEEPSEEK)


def test_prompts():
    assert [len(p) for p in ZOO_PROMPTS] == list(hf_zoo.ZOO_PROMPT_LENGTHS)
    assert len({tuple(p) for p in ZOO_PROMPTS}) == len(ZOO_PROMPTS)
    vocab = min(s.config().vocab_size for s in ZOO.values())
    assert vocab >= hf_zoo.ZOO_MIN_VOCAB and all(0 <= t < hf_zoo.ZOO_MIN_VOCAB for p in ZOO_PROMPTS for t in p)
    assert hf_zoo._draw_prompts() == ZOO_PROMPTS  # a fixed seed


@pytest.mark.parametrize("name", list(ZOO))
def test_checkpoint_saved_faithfully(name, hf_zoo_checkpoint):
    from transformers import AutoModelForCausalLM

    spec = ZOO[name]
    path = hf_zoo_checkpoint(name)
    files = sorted(os.listdir(path))
    assert "config.json" in files and not [f for f in files if f.endswith((".bin", ".pt"))], files
    shards = [f for f in files if f.endswith(".safetensors")]
    if spec.shard:
        assert len(shards) > 1 and "model.safetensors.index.json" in files, files
    else:
        assert shards == ["model.safetensors"], files
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [spec.model_cls]
    assert cfg["max_position_embeddings"] >= 512

    reloaded, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                          output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(reloaded).__name__ == spec.model_cls
    tied = reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    assert tied == bool(spec.config().tie_word_embeddings)

    moved = [(n, p) for n, p in reloaded.named_parameters() if hf_zoo.constant_at_init(reloaded, n) is not None]
    assert moved, "no norm / bias / sink parameters found"
    for n, p in moved:  # perturbed: no constant vector survives the save (a (1 + w) vs w slip shows)
        assert p.numel() == 1 or (p.max() - p.min()).item() > 0.05, n

    built = hf_zoo.build_model(name)
    ids = torch.tensor([ZOO_PROMPTS[-1]])
    with torch.no_grad(), hf_zoo.one_thread():
        a, b = built(ids).logits, reloaded.eval()(ids).logits
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize("name", list(ZOO))
def test_hf_greedy_is_deterministic_and_matches_a_cache_free_argmax(name, hf_zoo_checkpoint):
    path = hf_zoo_checkpoint(name)
    n = 12
    first = hf_zoo.hf_greedy(path, ZOO_PROMPTS, n)
    assert all(len(t) == n for t in first)
    assert hf_zoo.hf_greedy(path, ZOO_PROMPTS, n) == first
    for prompt, expected in zip(ZOO_PROMPTS, first):
        # No cache: one forward over prompt + continuation (windows, sinks, rope over the full sequence); its argmax
        # at each position is the cache-free greedy token while the two agree (tie-aware where they do not).
        logits = hf_zoo.hf_logits(path, prompt + expected, all_positions=True)[len(prompt) - 1:-1]
        got = logits.argmax(-1).tolist()
        ok, why = hf_zoo.greedy_matches_hf(path, prompt, expected, got)
        assert ok, f"{name}, prompt of {len(prompt)}: {why}"


@pytest.mark.parametrize("name", [n for n, s in ZOO.items() if s.sliding_window is not None])
def test_prompts_cross_the_sliding_window(name):
    spec = ZOO[name]
    config = spec.config()
    window = spec.sliding_window
    assert config.sliding_window == window <= 16
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        assert "sliding_attention" in layer_types
    crossing = [len(p) for p in ZOO_PROMPTS if len(p) > window]
    assert len(crossing) >= 3 and max(crossing) >= 4 * window, (window, crossing)


@pytest.mark.parametrize("name", [n for n, s in ZOO.items() if s.sliding_window is None])
def test_models_without_windows_have_none(name):
    config = ZOO[name].config()
    assert not getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", True) is False
    assert "sliding_attention" not in (getattr(config, "layer_types", None) or [])


@pytest.mark.parametrize("name,mutation", [(n, m) for n, ms in hf_zoo.FEATURE_MUTATIONS.items() for m in ms],
                         ids=lambda v: re.sub(r"\W+", "_", v.label).strip("_") if isinstance(v, hf_zoo.Mutation) else v)
def test_each_feature_changes_the_logits(name, mutation, hf_zoo_checkpoint):
    path = hf_zoo_checkpoint(name)
    prompt = ZOO_PROMPTS[-1]
    ref = hf_zoo.hf_logits(path, prompt, all_positions=True)
    got = hf_zoo.mutated_logits(path, mutation, prompt)
    change = ((got - ref).abs().max() / ref.std()).item()
    assert change > 0.1, f"{name}: {mutation.label} moves the logits by only {change:.3g} of their spread"


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_checkpoints(name, hf_zoo_checkpoint):
    import transformers

    spec = UNSUPPORTED[name]
    path = hf_zoo_checkpoint(name)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [spec.model_cls]
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    model = getattr(transformers, spec.model_cls).from_pretrained(path, dtype=torch.float32).eval()
    if name == "t5":
        assert spec.reason == "encoder-decoder" and cfg["is_encoder_decoder"] is True
    else:
        assert spec.reason == "Mamba / state-space layers" and cfg["model_type"] == "mamba"
        assert not [m for m in model.modules() if "attention" in type(m).__name__.lower()]
        with torch.no_grad(), hf_zoo.one_thread():  # a real decoder: it runs
            assert model(torch.tensor([ZOO_PROMPTS[0]])).logits.shape == (1, 5, 256)


def test_tie_helpers(hf_zoo_checkpoint):
    logits = torch.tensor([1.0, 3.0, 3.0 - 1e-7, -2.0])
    assert hf_zoo.top2_gap(logits)[:2] == (1, 2) and hf_zoo.top2_gap(logits)[2] < 1e-6
    assert hf_zoo.is_tie(logits, 1, 2) and hf_zoo.is_tie(logits, 2, 1)
    assert not hf_zoo.is_tie(logits, 0, 1) and not hf_zoo.is_tie(torch.tensor([1.0, 3.0, 2.9]), 1, 2)

    path = hf_zoo_checkpoint("mistral")
    prompt = ZOO_PROMPTS[1]
    expected = hf_zoo.hf_greedy(path, [prompt], 6)[0]
    assert hf_zoo.greedy_matches_hf(path, prompt, expected, expected) == (True, "identical")
    t1, t2, gap = hf_zoo.top2_gap(hf_zoo.hf_logits(path, prompt + expected[:3]))
    assert t1 == expected[3] and gap > 1e-5
    wrong = expected[:3] + [t2] + expected[4:]
    ok, why = hf_zoo.greedy_matches_hf(path, prompt, expected, wrong)
    assert not ok and "mismatch at generated position 3" in why
    assert not hf_zoo.greedy_matches_hf(path, prompt, expected, expected[:-1])[0]
