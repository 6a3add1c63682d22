"""`bench throughput` with LoRA adapters (issue 52 item 5) and tools/make_lora_adapter.py: the tool's random adapters
load in peft (onto the HF model of a tiny checkpoint, every targeted module adapted with the file's weights) and in
graphinfer's loader (PEFT's scaling folded in); the bench's smallest form with --num-adapters 0,2 writes the rows."""
import copy
import importlib.util
import json
import os

import pytest
import torch

from graphinfer.bench.throughput import _lora_plan, lora_requests
from graphinfer.errors import InvalidConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tool():
    spec = importlib.util.spec_from_file_location("make_lora_adapter",
                                                  os.path.join(ROOT, "tools", "make_lora_adapter.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, HF model, [adapter dirs]): two rank-4 adapters (alpha 8) for the tiny Llama, by the tool."""
    path, hf = tiny_checkpoint("llama")
    out = str(tmp_path_factory.mktemp("made-loras"))
    assert _tool().main([path, out, "--rank", "4", "--alpha", "8", "--seed", "3", "--count", "2"]) == 0
    return path, hf, [os.path.join(out, f"lora-{i}") for i in (1, 2)]


def test_the_tools_adapter_loads_in_peft_and_in_graphinfer(adapters):
    from peft import PeftModel
    from safetensors.torch import load_file

    from graphinfer.lora import load_adapter

    path, hf, (first, second) = adapters
    tensors = load_file(os.path.join(first, "adapter_model.safetensors"))
    linears = {n: (m.in_features, m.out_features) for n, m in hf.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in TARGETS}
    assert len(linears) == 7 * hf.config.num_hidden_layers
    assert set(tensors) == {f"base_model.model.{n}.lora_{x}.weight" for n in linears for x in "AB"}

    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), first).eval()
    adapted = {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert set(adapted) == set(linears)
    for name, module in adapted.items():  # peft put the file's weights in, at scaling alpha / r
        assert torch.equal(module.lora_A["default"].weight, tensors[f"base_model.model.{name}.lora_A.weight"])
        assert torch.equal(module.lora_B["default"].weight, tensors[f"base_model.model.{name}.lora_B.weight"])
        assert module.scaling["default"] == 2.0
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():  # random B (not PEFT's zeros): the adapter changes the model's outputs
        assert not torch.allclose(peft_model(ids).logits, hf(ids).logits)

    adapter = load_adapter(first, linears, max_lora_rank=4, dtype=torch.float32)
    assert adapter.rank == 4 and set(adapter.modules) == set(linears)
    for name, w in adapter.modules.items():
        assert torch.equal(w.a, tensors[f"base_model.model.{name}.lora_A.weight"])
        torch.testing.assert_close(w.b, 2.0 * tensors[f"base_model.model.{name}.lora_B.weight"])
    other = load_file(os.path.join(second, "adapter_model.safetensors"))  # --count: the next seed
    assert not torch.equal(next(iter(other.values())), tensors[next(iter(other))])


def test_adapters_over_the_paths_and_the_plan():
    reqs = lora_requests({"a": "/x", "b": "/y"}, 4)  # fewer paths than N: reused under distinct ids and names
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in reqs] == [
        ("a", 1, "/x"), ("b", 2, "/y"), ("a-3", 3, "/x"), ("b-4", 4, "/y")]
    assert lora_requests({"a": "/x"}, 0) == []
    assert _lora_plan(None, None, None, None, None) is None
    plan = _lora_plan({"a": "/nowhere"}, [0, 1, 8], None, None, None)
    assert plan["rows"] == [None, 0, 1, 8] and plan["max_loras"] == 8 and plan["max_lora_rank"] == 16
    assert _lora_plan({"a": "/x", "b": "/y"}, None, None, 8, None)["rows"] == [None, 0, 2]
    with pytest.raises(InvalidConfigError, match="max-loras 2 < 4"):
        _lora_plan({"a": "/x"}, [0, 4], 2, None, None)
    with pytest.raises(InvalidConfigError, match="needs adapters"):
        _lora_plan(None, [0, 1], None, None, None)


def test_bench_throughput_over_adapters(adapters, tmp_path, capsys, monkeypatch):
    """The smallest form of the bench: 4 prompts, the engine without LoRA, then N = 0 and 2 adapters."""
    from graphinfer.cli import main

    path, _, (first, second) = adapters
    out = str(tmp_path / "lora.json")
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        rc = main(["bench", "throughput", "--model", path, "--device", "cpu", "--dtype", "float32",
                   "--num-prompts", "4", "--min-len", "8", "--max-len", "16", "--fixed-output-len", "4",
                   "--lora-modules", f"a={first}", f"b={second}", "--num-adapters", "0,2", "--output-json", out])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-2000:] + printed.err[-3000:]
    result = json.load(open(out))
    rows = [(r["enable_lora"], r.get("num_adapters"), r.get("max_loras"), r.get("max_lora_rank"), r["output_tokens"])
            for r in result["runs"]]
    assert rows == [(False, None, None, None, 16), (True, 0, 2, 4, 16), (True, 2, 2, 4, 16)]
    assert [a["id"] for a in result["runs"][2]["adapters"]] == [1, 2] and result["runs"][1]["adapters"] == []
    assert result["runs"][0]["vs_base"] == 1.0 and all(r["vs_base"] > 0 for r in result["runs"])
    for r in result["runs"]:
        assert r["total_tok_s"] == pytest.approx((result["workload"]["prompt_tokens"] + 16) / r["total_s"])
    assert result["command"].startswith("graphinfer bench throughput --model")
    assert "--num-adapters 0,2" in result["command"]
    assert result["lora"]["max_loras"] == 2 and "cpu_model" in result["machine"]
    assert "| engine | adapters |" in printed.out
    assert "| enable_lora (max_loras 2, max_lora_rank 4) | 2 |" in printed.out
