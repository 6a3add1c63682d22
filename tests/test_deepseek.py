"""DeepSeek-V2 / V3 natively (graphinfer/models/deepseek_v2.py): MLA over the paged latent cache, the absorb_mla pass,
DeepSeekMoE routing; judged against HF's own greedy tokens on tiny checkpoints saved by transformers (tests/hf_zoo.py:
DEEPSEEK, with q LoRA or not, YaRN, grouped routing with a perturbed correction bias, V2's group-limited softmax)."""
import pytest

from graphinfer import LLM, SamplingParams
from hf_zoo import DEEPSEEK, ZOO_PROMPTS, assert_engine_matches_hf, hf_greedy

NEW = 8
KW = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=8)


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_gives_hf_greedy_tokens_through_chunks_and_prefix_hits(deepseek_checkpoint, name):
    """Prompts of 5-67 tokens chunked into 32-token steps beside decodes, then again from the prefix cache; the graph
    in the absorbed form (every layer), the cache one latent row of kv_lora_rank + qk_rope_head_dim per token."""
    path = deepseek_checkpoint(name)
    llm = LLM(path, **KW)
    engine = llm.llm_engine
    assert type(engine.worker.model).__name__ == DEEPSEEK[name].model_cls
    assert_engine_matches_hf(llm, path, hf_greedy(path, ZOO_PROMPTS, NEW))
    config, runner = engine.hf_config, engine.worker.model_runner
    assert {r.name: r.matches for r in engine.pass_reports}["absorb_mla"] == config.num_hidden_layers
    row = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.kv_cache.shape[1:2] == (1,) and runner.kv_cache.shape[-2:] == (1, row)  # one plane, one "head"
    assert engine.stats()["kv_usage"] == 0


def test_mla_attention_auto_gives_the_expanded_op_in_both_forms():
    """The per-step op absorb_mla writes, on a mixed batch (a chunk over a cached prefix, a whole prompt, decodes, a
    padded row) in fp32: with the expanded form allowed (threshold 1) and not (threshold and workspace bounds), both
    equal the model's expanded op, which reads kv_b_proj's weight directly."""
    import torch

    from graphinfer import ops

    torch.manual_seed(0)
    H, N, R, V, L, bs = 3, 16, 8, 12, 32, 4
    lens, q_lens = [9, 5, 13, 1, 0], [4, 5, 1, 1, 1]  # chunk over 5 cached, prompt, decode, decode, padding
    tables = torch.arange(5 * 4, dtype=torch.int32).view(5, 4)
    cache = torch.randn(20, bs, 1, L + R)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), H, N + R)
    kv_b = torch.randn(H * (N + V), L) / L ** 0.5
    args = (tables, qsl, torch.tensor(lens, dtype=torch.int32), 0.3)
    expected = ops.mla_attention(q, cache, kv_b, *args, N, V)
    w = kv_b.view(H, N + V, L)
    w_uk, w_uv = w[:, :N].contiguous(), w[:, N:].transpose(1, 2).contiguous()
    for min_query_len, max_tokens in ((1, 1 << 20), (1, 4), (100, 1 << 20)):  # expanded, then absorbed twice
        got = ops.mla_attention_auto(q[..., :N], q[..., N:], cache, w_uk, w_uv, *args, min_query_len, max_tokens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_expanded_form_for_prefill_chunks_gives_hf_greedy_tokens(deepseek_checkpoint, monkeypatch):
    """GRAPHINFER_MLA_EXPAND_MIN_QUERY_LEN=4: the prompt chunks (32-token steps over cached prefixes) run expanded,
    the decodes absorbed, in the same engine; HF's greedy tokens either way."""
    import graphinfer.ops.mla as mla

    forms = {"expanded": 0, "absorbed": 0}

    def counted(form, fn):
        def call(*args):
            forms[form] += form == "absorbed" or args[1] is not args[2]  # the latent attention's K and V are one cache
            return fn(*args)
        return call

    monkeypatch.setenv("GRAPHINFER_MLA_EXPAND_MIN_QUERY_LEN", "4")
    monkeypatch.setattr(mla, "paged_attention", counted("expanded", mla.paged_attention))
    monkeypatch.setattr(mla, "mla_latent_attention", counted("absorbed", mla.mla_latent_attention))
    path = deepseek_checkpoint("deepseek_v3")
    llm = LLM(path, **KW)
    nodes = [n for n in llm.llm_engine.worker.compiled.graph.graph.nodes if "mla_attention_auto" in str(n.target)]
    assert len(nodes) == 3 and all(n.args[9] == 4 for n in nodes)
    assert_engine_matches_hf(llm, path, hf_greedy(path, ZOO_PROMPTS, NEW))
    assert forms["expanded"] > 0 and forms["absorbed"] > 0, forms


def test_absorbed_form_equals_the_expanded_one(deepseek_checkpoint):
    """absorb_mla's numeric check (the graph before it, on a prefill + a mixed decode step) in fp32."""
    from graphinfer.compiler.pass_tools import verify

    _, reports = verify(deepseek_checkpoint("deepseek_v3"), dtype="float32")
    absorb = next(r for r in reports if r.name == "absorb_mla")
    assert reports.passed and absorb.matches == 3 and absorb.max_rel_error < 1e-5, absorb


LAYOUTS = {"tp2": (dict(tensor_parallel_size=2), 2, 1), "tp2-ep2": (dict(tensor_parallel_size=2,
                                                                          enable_expert_parallel=True), 2, 2),
           "dp2-ep2": (dict(data_parallel_size=2, enable_expert_parallel=True), 1, 2)}  # kwargs, heads /, experts /


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_give_hf_greedy_tokens(deepseek_checkpoint, layout):
    """On gloo with worker processes: tp 2 splits the heads (each rank's latent cache serves its heads; kv_b_proj is
    split by heads before absorb_mla splits it again); expert parallel gives each rank half the routed experts whole;
    dp 2 + ep 2 is vLLM's DP-attention deployment (each replica attends to its own requests, the experts shared)."""
    from graphinfer.models.parallel_layers import MoEExperts

    kwargs, heads_div, experts_div = LAYOUTS[layout]
    path = deepseek_checkpoint("deepseek_v3")
    expected = hf_greedy(path, ZOO_PROMPTS, NEW)
    with LLM(path, **kwargs, **KW) as llm:
        assert_engine_matches_hf(llm, path, expected)
        engine = llm.llm_engine
        config, model = engine.hf_config, engine.worker.model
        assert model.model.layers[0].self_attn.num_heads == config.num_attention_heads // heads_div
        experts = {m.num_experts for m in model.modules() if isinstance(m, MoEExperts)}
        assert experts == {config.n_routed_experts // experts_div}
        assert engine.worker.compiled.pass_reports.passed


@pytest.mark.slow  # ~18 s on 2 cores (budget); compile -> serve -> openai: test_compile_artifact.py, test_transformers_backend.py
def test_compile_then_serve_the_artifact_to_the_openai_client(deepseek_checkpoint, smollm2_path, tmp_path):
    """`graphinfer compile` (absorb_mla's W_UK / W_UV saved with the artifact), then `graphinfer serve ART`: HF's
    greedy tokens, decoded by SmolLM2's tokenizer put beside the tiny DeepSeek-V3."""
    import shutil

    from server_utils import served_artifact_completion

    from graphinfer.models.gguf_loader import load_gguf_tokenizer

    path = str(tmp_path / "deepseek")
    shutil.copytree(deepseek_checkpoint("deepseek_v3"), path)
    tokenizer = load_gguf_tokenizer(smollm2_path)
    tokenizer.save_pretrained(path)
    prompt = ZOO_PROMPTS[3]
    expected = tokenizer.decode(hf_greedy(path, [prompt], NEW)[0], skip_special_tokens=True)
    assert served_artifact_completion(path, ["--dtype", "float32"], prompt, NEW, tmp_path) == (expected, NEW)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_capturing_graph_modes_give_hf_greedy_tokens_on_the_gpu(deepseek_checkpoint, mode):
    """CUDA graphs of the absorbed MLA (paged attention at head size L + R over the latent cache) and the fused
    experts, fp32, against HF's tokens on the CPU (tie-aware)."""
    path = deepseek_checkpoint("deepseek_v3")
    llm = LLM(path, graph_mode=mode, capture_sizes=[1, 2, 4, 8, 32], **KW)
    assert_engine_matches_hf(llm, path, hf_greedy(path, ZOO_PROMPTS, NEW))


def test_online_quantization_keeps_kv_b_proj_for_absorb_mla(deepseek_checkpoint):
    """int8_wo quantizes the projections but kv_b_proj, whose weight mla_attention reads and absorb_mla splits (an
    int8 weight there would lose its scales); the absorbed graph still matches every layer."""
    from graphinfer.quantization.linear import QuantizedLinear

    llm = LLM(deepseek_checkpoint("deepseek_v3"), quantization="int8_wo", **KW)
    attn = llm.llm_engine.worker.model.model.layers[0].self_attn
    assert isinstance(attn.q_b_proj, QuantizedLinear) and not isinstance(attn.kv_b_proj, QuantizedLinear)
    assert {r.name: r.matches for r in llm.llm_engine.pass_reports}["absorb_mla"] == 3
    out = llm.generate(ZOO_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
