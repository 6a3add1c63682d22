"""Start-up (issue 18): what a serve-path start imports, the phase breakdown and `bench startup`, engines that
give their memory back, and the start-up error for a KV cache too small for one request."""
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.errors import GraphinferError, KVCacheTooSmallError

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

# Modules a serve-path start must not import (prefixes). A platform whose serving needs one of them (e.g. a cpu
# lowering through TorchInductor) removes it here for that platform, with the reason.
NOT_ON_SERVE_PATH = {
    "torch._dynamo": "TorchDynamo (seconds to import); pulled in by torch._refs on meta tensors, nn.init included",
    "torch._inductor": "TorchInductor: the reference ops compile nothing",
    "torch.onnx": "ONNX export is a compile-time view",
    "onnx": "ONNX export is a compile-time view",
    "matplotlib": "plots are for benchmarks",
    "sympy": "symbolic shapes: tracing and torch._refs, not serving",
    "gguf": "an artifact holds the weights dequantised, and the tokenizer in HF form",
    "transformers.modeling_utils": "transformers' model classes: graphinfer has its own models",
    "transformers.models.auto.modeling_auto": "transformers' model classes",
}


@pytest.fixture(scope="module")
def smollm2_artifact(smollm2_llm, tmp_path_factory):
    art = str(tmp_path_factory.mktemp("startup") / "smollm2")
    smollm2_llm.llm_engine.save_artifact(art)
    return art


def test_serve_path_start_imports_nothing_serving_does_not_need(smollm2_artifact):
    """Server modules imported, the engine built from the artifact (reference kernels) and one request run, in
    a fresh process: then the heavy modules above are absent, and no transformers model class was loaded."""
    code = (f"import sys, json, logging\nlogging.basicConfig(level='INFO')\n"
            f"import graphinfer.server.api_server, graphinfer.server.serve\n"
            f"from graphinfer import LLM, SamplingParams\n"
            f"llm = LLM(artifact={smollm2_artifact!r}, kernels='reference', max_model_len=1024)\n"
            f"out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4))\n"
            f"print(json.dumps([out[0].outputs[0].text, sorted(sys.modules)]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    text, modules = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Paris" in text
    loaded = {prefix: [m for m in modules if m == prefix or m.startswith(prefix + ".")] for prefix in NOT_ON_SERVE_PATH}
    assert {p: ms[:3] for p, ms in loaded.items() if ms} == {}
    assert not [m for m in modules if m.startswith("transformers.models.") and ".modeling_" in m]
    assert "start-up: weights" in res.stderr and "start-up: engine ready" in res.stderr  # the breakdown, on INFO


def test_transformers_configs_leave_sklearn_to_its_first_use():
    """graphinfer.lazy_imports: building a transformers config (which imports transformers' generation package) in a
    fresh process imports no scikit-learn; in this process (graphinfer imported first, by conftest), assisted
    generation's roc_curve still works, importing sklearn then, and is_sklearn_available is transformers' own."""
    from transformers.generation import candidate_generator as cg
    from transformers.utils import import_utils

    from graphinfer.lazy_imports import _DeferSklearnLoader

    code = ("import sys\nimport graphinfer, transformers\n"
            "transformers.LlamaConfig(hidden_size=64, num_attention_heads=4)\n"
            "from transformers.generation import candidate_generator\n"
            "print('sklearn' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "False"
    assert isinstance(cg.__loader__, _DeferSklearnLoader)  # loaded here through the finder too
    assert cg.is_sklearn_available is import_utils.is_sklearn_available and cg.is_sklearn_available()
    fpr, tpr, thresholds = cg.roc_curve([0, 1, 1, 0], [0.1, 0.9, 0.8, 0.3])
    assert list(tpr) == [0.0, 0.5, 1.0, 1.0] and "sklearn.metrics" in sys.modules


def test_startup_phases_are_recorded(smollm2_artifact):
    engine = LLM(artifact=smollm2_artifact, max_model_len=1024).llm_engine
    phases = engine.startup.seconds
    for phase in ("weights", "graph", "tokenizer (in a thread)", "KV cache", "engine ready"):
        assert phase in phases and phases[phase] >= 0
    assert phases["engine ready"] >= phases["weights"] + phases["graph"]


def _weakrefs(llm: LLM) -> dict:
    engine = llm.llm_engine
    model = engine.worker.model
    return {"engine": weakref.ref(engine), "kv cache": weakref.ref(engine.worker.model_runner.kv_cache),
            "embedding": weakref.ref(model.model.embed_tokens.weight),
            "fused qkv": weakref.ref(engine.worker.graph.get_submodule("model.layers.0.self_attn.qkv_proj").weight),
            "graph": weakref.ref(engine.worker.graph)}


def test_engines_give_their_memory_back():
    """Three engines one after another in one process, each with the full-size KV cache (by the engine's own
    accounting), released by shutdown(), by `with`, and by dropping the last reference."""
    kw = dict(kv_cache_memory_bytes=64 << 20, device="cpu", dtype="float32", block_size=16)
    tokens, blocks = [], []

    llm = LLM("tiny-qwen3", **kw)  # 1: shutdown(), while `llm` itself is still referenced
    refs = _weakrefs(llm)
    tokens.append(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    blocks.append(llm.llm_engine.worker.model_runner.num_blocks)
    llm.shutdown()
    assert [k for k, r in refs.items() if k != "engine" and r() is not None] == []
    with pytest.raises(GraphinferError, match="shut down"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)

    with LLM("tiny-qwen3", **kw) as llm2:  # 2: the with block
        refs = _weakrefs(llm2)
        tokens.append(llm2.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        blocks.append(llm2.llm_engine.worker.model_runner.num_blocks)
    assert [k for k, r in refs.items() if k != "engine" and r() is not None] == []

    llm3 = LLM("tiny-qwen3", **kw)  # 3: the last reference dropped, with the cycle collector off
    refs = _weakrefs(llm3)
    tokens.append(llm3.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    blocks.append(llm3.llm_engine.worker.model_runner.num_blocks)
    gc.disable()
    try:
        del llm3
        assert [k for k, r in refs.items() if r() is not None] == []
    finally:
        gc.enable()
    assert blocks == [blocks[0]] * 3 and blocks[0] == (64 << 20) // blocks_bytes("tiny-qwen3")
    assert tokens == [tokens[0]] * 3


def blocks_bytes(preset: str, block_size: int = 16) -> int:
    from graphinfer.models.presets import preset_config

    c = preset_config(preset)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * head_dim * 4  # fp32


def test_kv_cache_too_small_for_one_request_fails_at_start_up():
    with pytest.raises(KVCacheTooSmallError, match="(?s)one request of max_model_len=1024 tokens needs 64.*"
                                                   "--max-model-len.*gpu_memory_utilization.*kv_cache_memory_bytes"):
        LLM("tiny-llama", kv_cache_memory_bytes=blocks_bytes("tiny-llama") * 63, dtype="float32", block_size=16)
    llm = LLM("tiny-llama", kv_cache_memory_bytes=blocks_bytes("tiny-llama") * 63, max_model_len=1008,
              dtype="float32", block_size=16)  # 63 blocks
    assert llm.llm_engine.worker.model_runner.num_blocks == 63


def test_compile_cli_prints_no_kv_cache_size(tmp_path):
    res = subprocess.run([BIN, "compile", "tiny-llama", "-o", str(tmp_path / "art")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "KV cache:" not in res.stderr + res.stdout and "blocks" not in res.stderr + res.stdout
    assert not os.path.exists(tmp_path / "art" / "kernel_cache")  # cpu: the reference ops compile nothing


def test_bench_startup_runs(tmp_path):
    art = str(tmp_path / "art")
    LLM("tiny-llama").llm_engine.save_artifact(art)
    out = tmp_path / "startup.json"
    res = subprocess.run([BIN, "bench", "startup", art, "--runs", "1", "--caches", "cold,warm", "--output-json",
                          str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["cache"] for r in result["runs"]] == ["cold", "warm"]
    for r in result["runs"]:
        assert r["healthy_s"] > 0
        assert {"weights", "graph", "KV cache", "engine ready", "server ready"} <= set(r["phases_s"])
    assert "| cold | 1 |" in res.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engines_give_their_memory_back():
    """On a GPU: three engines one after another, each sized by gpu_memory_utilization of the device's total
    memory, each getting the same full-size KV cache; memory_allocated is back to where it was after each."""
    base = torch.cuda.memory_allocated()
    blocks = []
    for _ in range(3):
        with LLM("tiny-qwen3", device="cuda", gpu_memory_utilization=0.4, max_capture_size=8) as llm:
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
            blocks.append(llm.llm_engine.worker.model_runner.num_blocks)
        assert torch.cuda.memory_allocated() - base < 1 << 20  # weights, KV cache and graphs gone (MiBs to GiBs)
    assert blocks == [blocks[0]] * 3 and blocks[0] > 1000
    total = torch.cuda.mem_get_info()[1]
    assert blocks[0] * blocks_bytes("tiny-qwen3") // 2 <= 0.4 * total  # bf16 blocks within the fraction


def test_kernel_cache_is_used_only_where_it_was_made(tmp_path, monkeypatch, caplog):
    """The artifact's kernel_cache/ is handed to the compilers when kernel_cache.json matches this machine, and
    refused with a warning naming the difference (the kernels then compile into the default caches) when not."""
    from graphinfer.compiler import kernel_cache

    for var in kernel_cache.CACHE_ENV.values():
        monkeypatch.delenv(var, raising=False)
    art, cpu = str(tmp_path), torch.device("cpu")
    assert kernel_cache.use(art, cpu) is False  # none
    root = kernel_cache.collect(art, cpu)  # what compile does on the target device
    assert os.environ["TRITON_CACHE_DIR"] == os.path.join(root, "triton")
    for var in kernel_cache.CACHE_ENV.values():
        monkeypatch.delenv(var)
    assert kernel_cache.use(art, cpu) is True
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(root, "inductor")
    for var in kernel_cache.CACHE_ENV.values():
        monkeypatch.delenv(var)
    info = os.path.join(root, kernel_cache.INFO)
    with open(info) as f:
        recorded = json.load(f)
    with open(info, "w") as f:
        json.dump(dict(recorded, triton_version="0.0.1", device_name="NVIDIA H100 80GB HBM3"), f)
    with caplog.at_level("WARNING"):
        assert kernel_cache.use(art, cpu) is False
    assert "TRITON_CACHE_DIR" not in os.environ
    assert "triton_version: '0.0.1' there" in caplog.text and "compiling them again" in caplog.text
