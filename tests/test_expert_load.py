"""Expert load statistics (runtime/expert_load.py): per MoE layer, tokens routed to each expert, counted in the
graph on the device. Exact in NONE and under captured graphs with padded buckets (the recorded-op stand-in,
FULL_AND_PIECEWISE): a layer's counts sum to (real tokens computed) x top_k. The tp-2 case is in
tests/test_tensor_parallel.py, /metrics in tests/test_server.py."""
import json

import pytest
import torch
from capture_standin import OpTapePlatform

from graphinfer import LLM, SamplingParams, ops
from graphinfer.bench import moe_balance
from graphinfer.cli import main
from graphinfer.errors import InvalidConfigError
from graphinfer.runtime.worker.expert_load import imbalance, summarize, tokens_per_rank

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=64, max_num_seqs=8,
          max_num_batched_tokens=32)
PROMPTS = [[1, 5, 9, 3], [7] * 11, list(range(2, 40)), [4, 4, 8], [9, 8, 7, 6, 5]]
TOP_K = 2


def count_tokens(runner, monkeypatch) -> list[int]:
    """A list that collects each step's real token count, as the runner builds the step's inputs."""
    seen = []
    host_inputs = runner.host_inputs
    monkeypatch.setattr(runner, "host_inputs", lambda out: (h := host_inputs(out), seen.append(len(h.input_ids)))[0])
    return seen


def _generate(llm):
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_count_op_skips_padded_rows():
    ids = torch.tensor([[0, 3], [3, 1], [2, 0], [3, 3]])
    counts = torch.zeros(4, dtype=torch.int64)
    ops.moe_count_experts(ids, counts, torch.tensor([3]))  # row 3 is padding
    assert counts.tolist() == [2, 1, 1, 2]
    ops.moe_count_experts(ids, counts, torch.tensor([0]))
    assert counts.tolist() == [2, 1, 1, 2]


def test_none_counts_every_real_token_top_k_times(monkeypatch):
    llm = LLM("tiny-qwen3-moe", **KW)
    engine = llm.llm_engine
    assert [r.matches for r in engine.worker.compiled.pass_reports if r.name == "fuse_moe"] == [2]  # the count does not stop it
    load = engine.expert_load()
    assert sorted(load) == [0, 1] and all(c == [0] * 8 for c in load.values())  # warm-up and checks: reset
    seen = count_tokens(engine.worker.model_runner, monkeypatch)
    _generate(llm)
    load = engine.expert_load()
    assert all(sum(c) == sum(seen) * TOP_K for c in load.values()) and sum(seen) > 0
    assert all(min(c) >= 0 for c in load.values())
    engine.reset_expert_load()
    assert all(c == [0] * 8 for c in engine.expert_load().values())


def test_captured_graphs_with_padding_count_only_real_tokens(monkeypatch):
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    expected = LLM("tiny-qwen3-moe", **KW)
    expected_tokens = _generate(expected)
    expected_load = expected.llm_engine.expert_load()
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    llm = LLM("tiny-qwen3-moe", graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 16, 32], **KW)
    runner = llm.llm_engine.worker.model_runner
    padded = []  # (kind, real rows, bucket) of each replay
    for graphs, method in ((runner.dispatcher.decode_graphs, "replay"), (runner.dispatcher.piecewise_graphs, "run")):
        original = getattr(graphs, method)
        monkeypatch.setattr(graphs, method, lambda *a, _o=original, _g=graphs, _m=method, **k: padded.append(
            (_m, len(a[0]), _g.bucket(len(a[0])))) or _o(*a, **k))
    seen = count_tokens(runner, monkeypatch)
    assert _generate(llm) == expected_tokens
    assert any(m == "replay" and n < b for m, n, b in padded) and any(m == "run" and n < b for m, n, b in padded)
    load = llm.llm_engine.expert_load()
    assert all(sum(c) == sum(seen) * TOP_K for c in load.values())
    assert load == expected_load  # the same routing as NONE, token for token


def test_summary_partitions_experts_contiguously():
    assert tokens_per_rank([1, 2, 3, 4, 5, 6, 7, 8], 4) == [3, 7, 11, 15]
    assert imbalance([3, 7, 11, 15]) == 15 / 9 and imbalance([0, 0]) == 1.0
    s = summarize({3: [4, 0, 2, 2]}, ep_size=2)
    assert s["layers"]["3"]["tokens_per_rank"] == [4, 4] and s["layers"]["3"]["rank_imbalance"] == 1.0
    assert s["layers"]["3"]["expert_imbalance"] == 2.0 and s["max_rank_imbalance"] == 1.0
    with pytest.raises(InvalidConfigError, match=r"ep_size=3 does not split the 8 experts evenly; use one of \[1, 2, 4, 8\]"):
        tokens_per_rank([0] * 8, 3)


def test_bench_moe_balance(tmp_path, capsys):
    out = tmp_path / "balance.json"
    result = moe_balance.run("tiny-qwen3-moe", ep_size=4, device="cpu", dtype="float32", num_prompts=3, min_len=4,
                             max_len=12, output_json=str(out))
    assert json.loads(out.read_text())["expert_load"] == result["expert_load"]
    load = result["expert_load"]
    assert load["ep_size"] == 4 and sorted(load["layers"]) == ["0", "1"]
    prompt, output = result["workload"]["prompt_tokens"], result["workload"]["output_tokens"]
    for layer in load["layers"].values():
        assert len(layer["tokens_per_rank"]) == 4 and sum(layer["tokens_per_rank"]) == sum(layer["tokens_per_expert"])
        # every prompt token and every output token but the last of each request ran once (no preemption here)
        assert layer["tokens"] == (prompt + output - 3) * TOP_K
        assert layer["rank_imbalance"] == max(layer["tokens_per_rank"]) * 4 / layer["tokens"]
    assert "tokens per EP rank (ep_size 4)" in capsys.readouterr().out


def test_bench_moe_balance_cli(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "moe-balance", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--ep-size" in text and "without starting N ranks" in text
    assert main(["bench", "moe-balance", "--model", "tiny-llama", "--device", "cpu", "--num-prompts", "1",
                 "--min-len", "4", "--max-len", "4"]) == 2
    assert "has no MoE layers" in capsys.readouterr().err
