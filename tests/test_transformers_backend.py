"""model_impl="transformers": transformers' own modeling code captured by TorchDynamo, run on graphinfer's paged
attention and runtime; judged against HF's own greedy tokens on the same weights (fp32)."""
import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.errors import UnsupportedArchitectureError

PROMPTS = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in (5, 23, 41, 67)]
NEW = 8


def _hf_greedy(hf, prompts, n=NEW):
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _greedy(llm, prompts, n=NEW):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "qwen3_moe"])
def test_transformers_path_gives_hf_greedy_tokens(tiny_checkpoint, arch):
    path, hf = tiny_checkpoint(arch)
    llm = LLM(path, dtype="float32", model_impl="transformers", max_model_len=256)
    assert type(llm.llm_engine.worker.model).__name__ == "TransformersForCausalLM"
    assert _greedy(llm, PROMPTS) == _hf_greedy(hf, PROMPTS)


def test_chunked_prefill_prefix_hits_and_async_scheduling(tiny_checkpoint):
    path, hf = tiny_checkpoint("qwen3")
    expected = _hf_greedy(hf, PROMPTS)
    llm = LLM(path, dtype="float32", model_impl="transformers", max_model_len=256, max_num_batched_tokens=16,
              block_size=4, async_scheduling=True)
    assert _greedy(llm, PROMPTS) == expected  # prompts chunked into 16-token steps, sharing steps with decodes
    again = _greedy(llm, PROMPTS[2:])  # the same prompts again: their full blocks come from the prefix cache
    assert again == expected[2:]


def test_auto_keeps_the_native_model(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen2")
    assert type(LLM(path, dtype="float32").llm_engine.worker.model).__name__ == "Qwen2ForCausalLM"


def test_graphinfer_impl_refuses_an_architecture_it_lacks(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    hf = AutoModelForCausalLM.from_config(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, max_position_embeddings=128))
    hf.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="has no graphinfer model.*model_impl='auto' or 'transformers'"):
        LLM(str(tmp_path), model_impl="graphinfer")


# ----- the zoo (tests/hf_zoo.py): sixteen other architectures, HF's own tokens as the oracle -----

from hf_zoo import UNSUPPORTED, ZOO, ZOO_PROMPTS, assert_engine_matches_hf, hf_greedy  # noqa: E402

# transformers' code that TorchDynamo cannot capture as one graph valid for every batch: refused, with the reason
NOT_CAPTURABLE = {"phi3": "TorchDynamo cannot capture"}  # longrope switches factors on the sequence length


# layers without rotary (NoPE): Cohere 2's full-attention layer, SmolLM3's every fourth
ROPE_LAYERS = {"cohere2": 2, "smollm3": 3}


@pytest.mark.parametrize("name", [n for n in ZOO if n not in NOT_CAPTURABLE])
def test_zoo_gives_hf_greedy_tokens_through_chunks_and_prefix_hits(hf_zoo_checkpoint, name):
    """Plain LLM(dir) (model_impl auto: no graphinfer model for these), prompts of 5-67 tokens (past every sliding
    window) chunked into 32-token steps beside decodes, then again with their full blocks from the prefix cache.
    canon_rotary rewrites every layer's rotary: neox, interleaved (GLM-4, Ernie, Cohere 2), partial (GLM-4), after
    q/k norms in transformers' layout (Gemma 3), in fp32 casts (Ernie, Cohere 2)."""
    path = hf_zoo_checkpoint(name)
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=8)
    assert type(llm.llm_engine.worker.model).__name__ == "TransformersForCausalLM"
    matches = {r.name: r.matches for r in llm.llm_engine.pass_reports}
    assert matches["canon_rotary"] == ROPE_LAYERS.get(name, llm.llm_engine.hf_config.num_hidden_layers)
    if name in ("gemma2", "gemma3"):  # GeGLU: the captured F.gelu(approximate="tanh") -> gelu_and_mul, every layer
        assert matches["fuse_gate_up"] == llm.llm_engine.hf_config.num_hidden_layers
    assert_engine_matches_hf(llm, path, expected)
    assert llm.llm_engine.stats()["kv_usage"] == 0


@pytest.mark.parametrize("name", sorted(NOT_CAPTURABLE))
def test_models_the_capture_cannot_hold_are_refused(hf_zoo_checkpoint, name):
    with pytest.raises(UnsupportedArchitectureError, match=NOT_CAPTURABLE[name]):
        LLM(hf_zoo_checkpoint(name), dtype="float32", max_model_len=256)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_architectures_are_refused_naming_the_reason(hf_zoo_checkpoint, name):
    with pytest.raises(UnsupportedArchitectureError, match=UNSUPPORTED[name].reason):
        LLM(hf_zoo_checkpoint(name), dtype="float32", max_model_len=256)


def test_canonicalised_graph_has_the_native_ops(tiny_checkpoint):
    """A Qwen3 through transformers' code, after the canonicalisation passes, holds the graphinfer ops of the native
    model's fused graph (qkv split + qk_norm_rope_cache, add_rms_norm, gate_up + silu_and_mul, paged attention)."""
    from graphinfer.compiler.trace import op_histogram

    path, _ = tiny_checkpoint("qwen3")
    ops = lambda llm: {k: v for k, v in op_histogram(llm.llm_engine.worker.graph).items()  # noqa: E731
                       if k.startswith("graphinfer::")}
    transformers = LLM(path, dtype="float32", model_impl="transformers", max_model_len=256)
    native = LLM(path, dtype="float32", model_impl="graphinfer", max_model_len=256)
    assert ops(transformers) == ops(native), (ops(transformers), ops(native))
    reports = {r.name: r.matches for r in transformers.llm_engine.pass_reports}
    layers = transformers.llm_engine.hf_config.num_hidden_layers
    assert reports["canon_rotary"] == reports["fuse_qkv"] == reports["fuse_gate_up"] == layers
    assert reports["canon_rms_norm"] == 4 * layers + 1  # input, post-attention, q and k norms, and the final one


def test_compile_then_serve_the_artifact_to_the_openai_client(hf_zoo_checkpoint, smollm2_path, tmp_path):
    """`graphinfer compile DIR --model-impl transformers`, then `graphinfer serve ART`: a Mistral (sliding window) with
    SmolLM2's tokenizer beside it, so the served text is comparable: HF's greedy tokens, decoded."""
    import shutil

    from server_utils import served_artifact_completion

    from graphinfer.models.gguf_loader import load_gguf_tokenizer

    path = str(tmp_path / "mistral")
    shutil.copytree(hf_zoo_checkpoint("mistral"), path)
    tokenizer = load_gguf_tokenizer(smollm2_path)
    tokenizer.save_pretrained(path)
    prompt = ZOO_PROMPTS[2]
    expected = tokenizer.decode(hf_greedy(path, [prompt], NEW)[0], skip_special_tokens=True)  # as the server does
    args = ["--model-impl", "transformers", "--dtype", "float32"]
    assert served_artifact_completion(path, args, prompt, NEW, tmp_path) == (expected, NEW)


# ----- tensor parallel: transformers' base_model_tp_plan on graphinfer's parallel layers (gloo, a worker process) -----

@pytest.mark.parametrize("name", ["gemma3", pytest.param("phi3_rope", marks=pytest.mark.slow)])  # budget: one in the default suite
def test_tp2_gives_hf_greedy_tokens(hf_zoo_checkpoint, name):
    """tp 2 by the config's plan, chunked prefill beside decodes, then prefix-cache hits. Gemma 3 ("colwise" /
    "rowwise"): q/k/v and gate/up split by columns, o/down by rows, two all-reduces a layer; its scaled embedding and
    the LM head tied to it stay whole. Phi-3 ("colwise_gather_output" / "rowwise_split_input" on its fused qkv_proj
    and gate_up_proj): weights split, outputs all-gathered, so attention keeps every head."""
    from graphinfer.compiler.trace import op_histogram
    from graphinfer.models.transformers_tp import GatheredColumnParallelLinear, SplitInputRowParallelLinear

    path = hf_zoo_checkpoint(name)
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=32,
             block_size=8) as llm:
        assert_engine_matches_hf(llm, path, expected)
        worker, config = llm.llm_engine.worker, llm.llm_engine.hf_config
        layer, heads, kv = worker.model.model.layers[0], config.num_attention_heads, config.num_key_value_heads
        attn, layers = layer.self_attn.graphinfer_attn, config.num_hidden_layers
        assert worker.compiled.pass_reports.passed, worker.compiled.pass_reports.failures()
        ops = op_histogram(worker.graph)
        if name == "gemma3":
            assert (attn.num_heads, attn.num_kv_heads) == (heads // 2, kv // 2)
            assert layer.self_attn.o_proj.weight.shape[1] == heads // 2 * config.head_dim  # rank 0's half of the heads
            assert layer.mlp.down_proj.weight.shape[1] == config.intermediate_size // 2
            assert ops["graphinfer::all_reduce"] == 2 * layers
            assert worker.model.model.embed_tokens.weight.shape[0] == config.vocab_size  # whole
        else:
            qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
            assert isinstance(qkv, GatheredColumnParallelLinear) and isinstance(down, SplitInputRowParallelLinear)
            assert qkv.weight.shape[0] == (heads + 2 * kv) * (config.hidden_size // heads) // 2
            assert down.weight.shape[1] == config.intermediate_size // 2
            assert (attn.num_heads, attn.num_kv_heads) == (heads, kv)
            assert ops["graphinfer::all_gather"] == 2 * layers  # qkv_proj, gate_up_proj
            assert ops["graphinfer::all_reduce"] == 2 * layers + 1  # o_proj, down_proj; the vocab-parallel embedding


@pytest.mark.slow  # ~21 s on 2 cores (budget); native tp artifacts: test_tp_artifact.py
def test_tp2_artifact_of_mistral_gives_hf_greedy_tokens(hf_zoo_checkpoint, tmp_path):
    """`graphinfer compile DIR -tp 2` (each rank reads its slices of the checkpoint), then the artifact at tp 2: a
    plain embedding and untied head split over the vocabulary, GQA heads halved, sliding windows."""
    from graphinfer.cli import main
    from graphinfer.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding

    path, art = hf_zoo_checkpoint("mistral"), str(tmp_path / "art")
    assert main(["compile", path, "-o", art, "--dtype", "float32", "-tp", "2", "--model-impl", "transformers"]) == 0
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    with LLM(artifact=art, device="cpu", max_model_len=256, max_num_batched_tokens=32, block_size=8) as llm:
        assert_engine_matches_hf(llm, path, expected)
        model, config = llm.llm_engine.worker.model, llm.llm_engine.hf_config
        assert isinstance(model.model.embed_tokens, VocabParallelEmbedding) and isinstance(model.lm_head,
                                                                                            ParallelLMHead)
        assert model.lm_head.weight.shape[0] == config.vocab_size // 2
        assert model.model.layers[0].self_attn.graphinfer_attn.num_kv_heads == config.num_key_value_heads // 2


def test_tp2_refusals_name_the_reason(hf_zoo_checkpoint):
    """No plan in the config (GraniteMoE): refused before any rank starts. A checkpoint transformers converts at load
    (Qwen2-MoE's per-expert tensors, stacked in the model): refused by the ranks' loader."""
    from graphinfer.distributed import parallel_state as ps
    from graphinfer.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match=r"declares no tensor-parallel plan \(base_model_tp_plan\)"):
        LLM(hf_zoo_checkpoint("granitemoe"), dtype="float32", tensor_parallel_size=2, max_model_len=256)
    assert not ps.is_initialized()
    with pytest.raises(InvalidConfigError, match=r"experts\.0\.down_proj\.weight.*transformers converts them at load"):
        LLM(hf_zoo_checkpoint("qwen2_moe"), dtype="float32", tensor_parallel_size=2, max_model_len=256)


def test_in_place_calls_survive_passes_and_an_artifact(hf_zoo_checkpoint, tmp_path):
    """gpt-oss's experts add their biases in place (`out.add_(bias)`, result unused) and restore the token order with
    `inv_perm[perm] = arange`: the capture spells both as compiler.inplace calls, which dead-code elimination keeps and an
    artifact's graph.py traces again; compiled to an artifact, the tokens are HF's."""
    import os
    import re

    from graphinfer.cli import main

    path, art = hf_zoo_checkpoint("gpt_oss"), str(tmp_path / "art")
    assert main(["compile", path, "-o", art, "--dtype", "float32"]) == 0
    calls = re.findall(r"_inplace\('(\w+)'", open(os.path.join(art, "graph.py")).read())
    assert sorted(set(calls)) == ["__setitem__", "add_", "clamp_", "masked_fill_"] and calls.count("add_") == 4  # 2 layers x (gate_up, down) biases
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    with LLM(artifact=art, device="cpu", max_model_len=256, max_num_batched_tokens=32, block_size=8) as llm:
        assert_engine_matches_hf(llm, path, expected, runs=("cold",))  # graph.py traced again, its mutations kept


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_capturing_graph_modes_give_hf_greedy_tokens(hf_zoo_checkpoint, monkeypatch, name):
    """FULL_AND_PIECEWISE on the recorded-op stand-in for device graphs (tests/capture_standin.py): decode steps
    replay full graphs, mixed steps the pieces split at graphinfer::paged_attention, on graphs captured from
    transformers' code: Gemma 2's soft-capping and windows, gpt-oss's sinks and in-place expert biases."""
    from capture_standin import OpTapePlatform

    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    path = hf_zoo_checkpoint(name)
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=8,
              graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 32])
    dispatcher, replays = llm.llm_engine.worker.model_runner.dispatcher, []
    for graphs, method in ((dispatcher.decode_graphs, "replay"), (dispatcher.piecewise_graphs, "run")):
        original = getattr(graphs, method)
        monkeypatch.setattr(graphs, method, lambda *a, _o=original, _m=method, **k: replays.append(_m) or _o(*a, **k))
    assert_engine_matches_hf(llm, path, expected, runs=("cold",))
    assert {"replay", "run"} <= set(replays)
