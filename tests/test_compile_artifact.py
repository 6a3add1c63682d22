"""Compile artifacts: the round trip gives the in-memory tokens; tampered or mismatched ones are refused."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from cli_output import expected_blocks, parse_generate

from graphinfer import LLM, SamplingParams
from graphinfer.errors import ArtifactMismatchError

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def qwen2_artifact(tiny_checkpoint, tmp_path_factory):
    path = tiny_checkpoint("qwen2")[0]
    art = str(tmp_path_factory.mktemp("art") / "qwen2")
    llm = LLM(path, dtype="float32")  # auto is bfloat16 on CPUs with native bf16
    manifest = llm.llm_engine.save_artifact(art)
    return path, art, manifest, llm


PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 80)), [3]]


def test_artifact_contents(qwen2_artifact):
    path, art, manifest, _ = qwen2_artifact
    assert sorted(os.listdir(art)) == ["config.json", "graph.py", "manifest.json", "model.safetensors", "report.txt"]
    assert sorted(manifest["files"]) == ["config.json", "graph.py", "model.safetensors"]  # a tiny checkpoint: no tokenizer
    assert manifest["model"]["path"] == os.path.abspath(path)
    assert manifest["platform"] == "cpu" and manifest["dtype"] == "float32" and manifest["graph_mode"] == "NONE"
    assert manifest["capture_sizes"] == [1, 2, 4, 8]  # the cpu platform's (decode graphs of its eager kernels)
    assert [(p["name"], p["matches"]) for p in manifest["passes"]] == [
        ("canon_rms_norm", 0), ("canon_rotary", 0), ("canon_transpose", 0), ("fuse_qkv", 3), ("fuse_qknorm_rope", 0), ("fuse_gate_up", 3), ("fuse_add_rmsnorm", 6),
        ("fuse_allreduce_add_rmsnorm", 0), ("fuse_moe", 0), ("absorb_mla", 0), ("lower_quant_linears", 0), ("fuse_rmsnorm_quant", 0),
        ("fuse_silu_mul_quant", 0), ("cleanup", manifest["passes"][-1]["matches"])]
    assert all(p["max_abs_error"] <= 1e-5 for p in manifest["passes"])
    assert manifest["fused_linears"]["model.layers.0.self_attn.qkv_proj"] == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    graph = open(os.path.join(art, "graph.py")).read()
    assert "qkv_proj" in graph and "torch.ops.graphinfer.add_rms_norm.default" in graph
    assert "| fuse_qkv | 3 |" in open(os.path.join(art, "report.txt")).read()


def test_round_trip_gives_in_memory_tokens_without_tracing(qwen2_artifact, monkeypatch):
    path, art, _, in_memory = qwen2_artifact
    import graphinfer.compiler.pipeline as pipeline

    def no_compile(*a, **k):
        raise AssertionError("an artifact must not be traced or passed again")

    monkeypatch.setattr(pipeline, "compile_model", no_compile)
    loaded = LLM(artifact=art)  # model and dtype come from the manifest
    assert loaded.llm_engine.config.model_config.model == os.path.abspath(path)
    assert _tokens(loaded, PROMPTS) == _tokens(in_memory, PROMPTS)
    assert [r.name for r in loaded.llm_engine.worker.compiled.pass_reports][:4] == [
        "canon_rms_norm", "canon_rotary", "canon_transpose", "fuse_qkv"]
    assert not hasattr(loaded.llm_engine.worker.model.model.layers[0].self_attn, "q_proj")  # never built


def test_artifact_weights_are_final_and_load_without_the_checkpoint(qwen2_artifact, tmp_path, monkeypatch):
    """The weights as the graph reads them (fused, tied once): the artifact serves with its checkpoint gone."""
    path, art, _, in_memory = qwen2_artifact
    from safetensors import safe_open

    with safe_open(os.path.join(art, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight")) for n in names)
    moved = _copy(art, tmp_path)  # movable: another directory, and the checkpoint it came from unreadable
    import graphinfer.model_loader as model_loader
    import graphinfer.models.loader as loader

    def no_checkpoint(*a, **k):
        raise AssertionError("an artifact must not read its checkpoint")

    monkeypatch.setattr(model_loader, "load_model", no_checkpoint)
    for name in ("load_config", "load_hf_config", "load_tokenizer"):
        monkeypatch.setattr(loader, name, no_checkpoint)
    import graphinfer.compiler.pipeline as pipeline
    import graphinfer.runtime.engine.core as core_mod

    for name in ("load_model", "load_config"):
        monkeypatch.setattr(pipeline, name, no_checkpoint)
    monkeypatch.setattr(core_mod, "load_tokenizer", no_checkpoint)
    assert _tokens(LLM(artifact=moved), PROMPTS) == _tokens(in_memory, PROMPTS)


def test_edited_weights_or_config_are_refused(qwen2_artifact, tmp_path):
    for name in ("model.safetensors", "config.json"):
        art = _copy(qwen2_artifact[1], tmp_path / name)
        with open(os.path.join(art, name), "ab") as f:
            f.write(b" ")
        with pytest.raises(ArtifactMismatchError, match=f"{name}: artifact has '[0-9a-f]+', here '[0-9a-f]+'"):
            LLM(artifact=art)
    art = _copy(qwen2_artifact[1], tmp_path / "gone")
    os.remove(os.path.join(art, "model.safetensors"))
    with pytest.raises(ArtifactMismatchError, match="model.safetensors: artifact has '[0-9a-f]+', here 'missing'"):
        LLM(artifact=art)


def test_old_format_artifact_says_to_recompile(qwen2_artifact, tmp_path):
    art = _copy(qwen2_artifact[1], tmp_path)
    _edit_manifest(art, format=1)
    with pytest.raises(ArtifactMismatchError, match="(?s)older graphinfer \\(format 1.*Re-run `graphinfer compile"):
        LLM(artifact=art)


def test_artifact_graph_mode_and_capture_sizes_are_the_defaults(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen2")[0]
    LLM(path, capture_sizes=[1, 2]).llm_engine.save_artifact(str(tmp_path / "art"))
    engine = LLM(artifact=str(tmp_path / "art")).llm_engine
    assert engine.worker.dispatcher.capture_sizes == [1, 2] and engine.config.compile_config.graph_mode == "NONE"


def _copy(art, tmp_path):
    dst = str(tmp_path / "copy")
    os.makedirs(tmp_path, exist_ok=True)
    shutil.copytree(art, dst)
    return dst


def _edit_manifest(art, **changes):
    p = os.path.join(art, "manifest.json")
    m = json.load(open(p))
    m.update(changes)
    json.dump(m, open(p, "w"))


def test_tampered_graph_is_refused(qwen2_artifact, tmp_path):
    art = _copy(qwen2_artifact[1], tmp_path)
    with open(os.path.join(art, "graph.py"), "a") as f:
        f.write("\n# edited\n")
    with pytest.raises(ArtifactMismatchError, match="graph.py: artifact has"):
        LLM(artifact=art)


@pytest.mark.parametrize("field,value,match", [
    ("torch_version", "1.0.0", "torch_version: artifact has '1.0.0'"),
    ("graphinfer_version", "0.0.1", "graphinfer_version"),
    ("platform", "npu", "platform: artifact has 'npu', here 'cpu'"),
    ("format", 99, "another format"),
])
def test_mismatched_manifest_is_refused(qwen2_artifact, tmp_path, field, value, match):
    art = _copy(qwen2_artifact[1], tmp_path)
    _edit_manifest(art, **{field: value})
    with pytest.raises(ArtifactMismatchError, match=match):
        LLM(artifact=art)


def test_other_weights_or_dtype_are_refused(qwen2_artifact, tiny_checkpoint, tmp_path):
    path, art, _, _ = qwen2_artifact
    other = str(tmp_path / "other")
    shutil.copytree(path, other)
    from safetensors.torch import load_file, save_file

    [st] = [f for f in os.listdir(other) if f.endswith(".safetensors")]
    weights = load_file(os.path.join(other, st))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, os.path.join(other, st), metadata={"format": "pt"})
    with pytest.raises(ArtifactMismatchError, match="(?s)model weights: artifact has .*Recompile it here: graphinfer compile"):
        LLM(other, artifact=art)
    with pytest.raises(ArtifactMismatchError, match="model config"):
        LLM(tiny_checkpoint("qwen3")[0], artifact=art)
    with pytest.raises(ArtifactMismatchError, match="dtype: artifact has 'float32', here 'bfloat16'"):
        LLM(artifact=art, dtype="bfloat16")
    with pytest.raises(ArtifactMismatchError, match=r"compiled with quantization=None, but quantization='int8_wo' was "
                                                    r"asked.*Leave quantization unset"):
        LLM(artifact=art, quantization="int8_wo")  # an unquantized artifact: -q used to be ignored


def test_damaged_or_missing_manifest(qwen2_artifact, tmp_path):
    with pytest.raises(ArtifactMismatchError, match="not a graphinfer artifact"):
        LLM(artifact=str(tmp_path))
    art = _copy(qwen2_artifact[1], tmp_path)
    with open(os.path.join(art, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ArtifactMismatchError, match="not valid JSON"):
        LLM(artifact=art)
    art2 = str(tmp_path / "c2")
    shutil.copytree(qwen2_artifact[1], art2)
    m = json.load(open(os.path.join(art2, "manifest.json")))
    del m["model"]
    json.dump(m, open(os.path.join(art2, "manifest.json"), "w"))
    with pytest.raises(ArtifactMismatchError, match="missing \\['model'\\]"):
        LLM(artifact=art2)


def test_smollm2_compile_then_generate_cli(smollm2_llm, tmp_path):
    art = str(tmp_path / "smollm2")
    res = subprocess.run([BIN, "compile", "-o", art, "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "| fuse_qkv | 30 |" in res.stdout and "| fuse_gate_up | 30 |" in res.stdout
    assert sorted(os.listdir(os.path.join(art, "tokenizer"))) == ["chat_template.jinja", "tokenizer.json",
                                                                   "tokenizer_config.json"]
    loaded = LLM(artifact=art, max_model_len=1024)
    prompts = ["The capital of France is", "Hello, my name is"]
    assert _tokens(loaded, prompts) == _tokens(smollm2_llm, prompts)
    ours, gguf = loaded.get_tokenizer(), smollm2_llm.get_tokenizer()  # the tokenizer in HF form: same ids and template
    chat = [{"role": "user", "content": "Héllo <|im_end|> wörld"}]
    assert ours(prompts[0] + " ünïcode").input_ids == gguf(prompts[0] + " ünïcode").input_ids
    assert ours.apply_chat_template(chat, tokenize=False) == gguf.apply_chat_template(chat, tokenize=False)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (gguf.eos_token_id, gguf.bos_token_id,
                                                                          gguf.pad_token_id)
    res = subprocess.run([BIN, "generate", "--artifact", art, "--prompt", prompts[0], "--temperature", "0",
                          "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    expected = smollm2_llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert parse_generate(res.stdout) == expected_blocks(prompts[:1], expected)
    assert expected[0].outputs[0].text.startswith(" Paris")


def test_a_memo_caught_half_written_is_not_trusted(tmp_path, monkeypatch):
    """Two tensor-parallel ranks hash the same graph.py at once: a memo that one of them reads empty or cut short
    (the other still writing it) must not stand for the file's hash."""
    import hashlib

    from graphinfer.compiler.fingerprint import file_sha256

    monkeypatch.setenv("GRAPHINFER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "graph.py"
    path.write_bytes(b"x = 1\n")
    true = hashlib.sha256(b"x = 1\n").hexdigest()
    assert file_sha256(str(path)) == true
    (memo,) = (tmp_path / "cache" / "hashes").iterdir()
    assert memo.read_text() == true and not [p for p in memo.parent.iterdir() if p.suffix == ".tmp"]
    for cut in ("", true[:10]):
        memo.write_text(cut)
        assert file_sha256(str(path)) == true and memo.read_text() == true
