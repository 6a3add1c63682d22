"""`graphinfer bench throughput` / `bench latency` on CPU: the standard workload, the roofline model, the CLI."""
import json
import os

import pytest
import torch

from graphinfer.bench.roofline import ModelShape, ideal_roofline, step_bytes
from graphinfer.bench.throughput import standard_workload

TINY_RUN = ["--model", "tiny-llama", "--num-prompts", "4", "--min-len", "8", "--max-len", "16"]


@pytest.fixture
def bench_cli(capsys, monkeypatch):
    """`graphinfer bench ARGS` as the console script runs it (graphinfer.cli:main), in this process: a subprocess
    would spend most of its time importing. One thread, as the environment the engine reads says (cpu platform):
    tiny models on the shared 2-core VM run faster and steadier without OpenMP barriers."""
    from graphinfer.cli import main

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    def run(*args):
        rc = main(["bench", *args])
        out = capsys.readouterr()
        assert rc == 0, out.out[-2000:] + out.err[-3000:]
        return out

    yield run
    torch.set_num_threads(threads)


def test_standard_workload_reproduces_bench_py():
    w = standard_workload()
    assert (len(w.prompts), w.prompt_tokens, w.output_tokens) == (256, 142_827, 133_966)
    assert min(map(len, w.prompts)) == 107 and max(map(len, w.prompts)) == 1024
    assert all(0 <= t <= 10_000 for p in w.prompts for t in p)
    fixed = standard_workload(fixed_output_len=512)  # the fixed-512 variant keeps the same prompts
    assert fixed.prompts == w.prompts and fixed.output_tokens == 131_072
    small_vocab = standard_workload(vocab_size=512)  # ids folded into the vocabulary, lengths unchanged
    assert list(map(len, small_vocab.prompts)) == list(map(len, w.prompts))
    assert max(max(p) for p in small_vocab.prompts) < 512


def _meta_model(config):
    from graphinfer.models import get_model_class

    with torch.device("meta"):
        return get_model_class(config.architectures)(config)


def test_roofline_model_by_hand():
    from graphinfer.models.presets import preset_config

    shape = ModelShape.from_model(_meta_model(preset_config("tiny-llama")))  # fp32, tied embeddings
    # vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16
    embed = 512 * 64
    layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o, gate/up/down, 2 norms
    params = embed + 2 * layer + 64
    assert shape.num_params == params and shape.param_bytes == 4 * params
    assert shape.weight_bytes_per_step == 4 * params  # tied: the table is read whole as the LM head
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 16)
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head_dim, fp32

    # Prompts 3 and 5, outputs 2 and 4, 4 tokens per step: 2 prefill steps + 3 decode steps read W.
    # KV tokens: prefill reads + writes each prompt (2 * 8); decodes read p + j and write 1:
    # request 1: (3 + 1) + 1; request 2: (5 + 1) + (5 + 2) + (5 + 3) + 3.
    r = ideal_roofline(shape, [3, 5], [2, 4], max_num_batched_tokens=4, bandwidth=1e9)
    kv = 16 + 5 + 24
    assert (r["prefill_steps"], r["decode_steps"], r["kv_tokens"]) == (2, 3, kv)
    assert r["bytes"] == 5 * 4 * params + kv * shape.kv_bytes_per_token
    assert r["seconds"] == pytest.approx(r["bytes"] / 1e9)
    assert step_bytes(shape, 10) == 4 * params + 10 * shape.kv_bytes_per_token


def test_roofline_untied_embedding_is_not_streamed():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    shape = ModelShape.from_model(_meta_model(config))
    assert shape.param_bytes - shape.weight_bytes_per_step == 4 * 512 * 64


def test_roofline_matches_the_h100_reference_figure():
    """docs: fixed-512 Qwen3-0.6B bf16 at 3.02 TB/s -> about 4.25 s, ~30,800 tok/s."""
    from graphinfer.models.presets import preset_config

    shape = ModelShape.from_model(_meta_model(preset_config("qwen3-0.6b")).to(torch.bfloat16))
    assert shape.num_params == 596_049_920 and shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    w = standard_workload(fixed_output_len=512)
    r = ideal_roofline(shape, list(map(len, w.prompts)), w.max_tokens, 8192, 3.02e12)
    assert 4.2 < r["seconds"] < 4.3 and 30_000 < r["output_tok_s"] < 31_500


def test_shape_from_engine_counts_fused_weights_once():
    from graphinfer import LLM

    engine = LLM("tiny-llama", dtype="float32", max_model_len=256, num_gpu_blocks_override=8).llm_engine
    assert ModelShape.from_engine(engine).param_bytes == ModelShape.from_model(
        _meta_model(engine.hf_config)).param_bytes


def _check_run(run: dict, workload: dict) -> None:
    assert run["output_tokens"] == workload["output_tokens"] and run["output_tok_s"] > 0
    assert run["prefill_s"] > 0 and run["decode_s"] > 0
    assert run["prefill_s"] + run["decode_s"] <= run["total_s"]
    assert run["num_steps"] == run["num_prefill_steps"] + run["num_decode_steps"]
    assert 0 < run["roofline"]["fraction"] <= 1 and 0 < run["roofline"]["decode_fraction"] <= 1


def test_cli_throughput_writes_sane_json(bench_cli, tmp_path):
    out = tmp_path / "t.json"
    res = bench_cli("throughput", *TINY_RUN, "--output-json", str(out))
    result = json.loads(out.read_text())
    w = result["workload"]
    assert (w["num_prompts"], w["prompt_tokens"], w["max_model_len"]) == (4, 55, 1024)  # clamped to tiny's context
    [run] = result["runs"]
    assert run["graph_mode"] == "NONE" and run["max_num_seqs"] == 256
    _check_run(run, w)
    assert result["bandwidth"]["bytes_per_s"] > 0 and run["model_shape"]["num_layers"] == 2
    assert "| NONE | 256 |" in res.out and "tok/s" in res.out


def test_cli_throughput_sweep_grid_and_plot(bench_cli, tmp_path):
    import matplotlib.image

    out, png = tmp_path / "s.json", tmp_path / "s.png"
    res = bench_cli("throughput", *TINY_RUN, "--sweep", "max-num-seqs=2,4", "--sweep", "graph-mode=NONE,FULL_DECODE_ONLY",
               "--output-json", str(out), "--plot", str(png))
    runs = json.loads(out.read_text())["runs"]
    assert [(r["graph_mode"], r["max_num_seqs"]) for r in runs] == [
        ("NONE", 2), ("NONE", 4), ("FULL_DECODE_ONLY", 2), ("FULL_DECODE_ONLY", 4)]
    for r in runs[:2]:
        _check_run(r, json.loads(out.read_text())["workload"])
    assert runs[0]["mean_decode_batch"] <= 2 < runs[1]["mean_decode_batch"]  # max_num_seqs caps the batch
    assert all("runs NONE with" in r["unavailable"] for r in runs[2:])  # cpu, the suite's reference kernels
    assert "| NONE | 2 |" in res.out and "| FULL_DECODE_ONLY | 4 | unavailable |" in res.out
    assert matplotlib.image.imread(str(png)).shape[0] > 100


def test_cli_throughput_sweep_async_scheduling(bench_cli, tmp_path):
    out = tmp_path / "a.json"
    res = bench_cli("throughput", *TINY_RUN, "--sweep", "async-scheduling=off,on", "--output-json", str(out))
    result = json.loads(out.read_text())
    assert [r["async_scheduling"] for r in result["runs"]] == [False, True]
    for r in result["runs"]:
        _check_run(r, result["workload"])
    assert "| NONE | 256 |" in res.out and "| NONE + async | 256 |" in res.out


def test_cli_throughput_compare_hf(bench_cli, tmp_path):
    out = tmp_path / "hf.json"
    res = bench_cli("throughput", *TINY_RUN, "--compare", "hf", "--fixed-output-len", "8", "--output-json", str(out))
    result = json.loads(out.read_text())
    assert result["workload"]["output_tokens"] == 32
    assert result["hf"]["output_tokens"] == 32 and result["hf"]["output_tok_s"] > 0  # EOS disabled on HF too
    run = result["runs"][0]
    assert run["vs_hf"] == pytest.approx(run["output_tok_s"] / result["hf"]["output_tok_s"])
    assert "HF generate_batch" in res.out


def test_cli_latency_cpu_reports_full_decode_only_unavailable(bench_cli, tmp_path):
    out, png = tmp_path / "l.json", tmp_path / "l.png"
    res = bench_cli("latency", "--model", "tiny-llama", "--batch-sizes", "1,4", "--num-steps", "5", "--warmup-steps", "2",
               "--output-json", str(out), "--plot", str(png))
    result = json.loads(out.read_text())
    assert "unavailable" in result["modes"]["FULL_DECODE_ONLY"]
    none = result["modes"]["NONE"]["batches"]
    assert [b["batch"] for b in none] == [1, 4] and all(b["median_ms"] > 0 and b["steps"] == 5 for b in none)
    assert [r["batch"] for r in result["rows"]] == [1, 4] and "ratio_none_over_full" not in result["rows"][0]
    assert "| 1 |" in res.out and "unavailable" in res.out and png.exists()


def test_cli_bad_sweep_is_a_clear_error(capsys):
    from graphinfer.cli import main

    assert main(["bench", "throughput", "--sweep", "block-size=16"]) == 2
    assert "--sweep 'block-size=16'" in capsys.readouterr().err
    assert main(["bench", "throughput", "--sweep", "async-scheduling=maybe"]) == 2
    assert "'maybe': use on or off" in capsys.readouterr().err


def _child_pids() -> set[int]:
    """This process's live children (a tensor-parallel engine's worker ranks), from /proc."""
    kids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            kids.add(int(pid))
    return kids


@pytest.mark.slow  # ~13 s on 2 cores (budget); the dp / EP sweep below stays
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads this process's children from /proc")
def test_throughput_tensor_parallel_sweep_records_collectives(capsys):
    """tp 1 and tp 2 in one run (gloo, 2 ranks): both rows, the collective time of rank 0 per step, and the
    tp-2 engine's worker process gone once the run returns (each configuration's engine is shut down)."""
    from graphinfer.bench.throughput import run

    before = _child_pids()
    result = run("tiny-llama", dtype="float32", device="cpu", tensor_parallel_size=(1, 2), num_prompts=4, min_len=8,
                 max_len=16)
    assert _child_pids() == before
    tp1, tp2 = result["runs"]
    assert (tp1["tensor_parallel_size"], tp2["tensor_parallel_size"]) == (1, 2)
    for r in (tp1, tp2):
        _check_run(r, result["workload"])
    assert tp1["collective_s"] == tp1["collective_calls"] == 0 and tp1["collective_fraction"] == 0
    assert tp2["collective_decode_s"] > 0 and tp2["collective_prefill_s"] > 0
    assert tp2["collective_s"] == pytest.approx(tp2["collective_prefill_s"] + tp2["collective_decode_s"])
    assert tp2["collective_calls"] >= 2 * tp2["num_steps"]  # at least the step message and the logits' all-gather
    assert 0 < tp2["collective_fraction"] < 1 and "gloo" in tp2["collective_measure"]
    assert tp2["threads_per_rank"] <= tp1["threads_per_rank"]
    assert "| NONE | 256 | 2 |" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads this process's children from /proc")
def test_throughput_data_parallel_sweep_moe_expert_parallel(capsys):
    """dp 1 and dp 2 (MoE + expert parallel, two replicas in lockstep over gloo) in one run: the same output
    tokens, requests routed to both replicas, the expert load summed over the replicas (every token counted
    once per top-k slot in both runs; which experts they go to differs, as the sampled tokens do), and the dp-2
    replica process gone once the run returns."""
    from graphinfer.bench.throughput import run

    before = _child_pids()
    result = run("tiny-qwen3-moe", dtype="float32", device="cpu", data_parallel_size=(1, 2),
                 parallel={"enable_expert_parallel": True}, num_prompts=4, min_len=8, max_len=16)
    assert _child_pids() == before
    w = result["workload"]
    dp1, dp2 = result["runs"]
    assert [(r["data_parallel_size"], r["enable_expert_parallel"], r["expert_parallel_size"]) for r in (dp1, dp2)] \
        == [(1, True, 1), (2, True, 2)]  # tp 1 x dp 1: EP on, but nothing to split over
    for r in (dp1, dp2):
        _check_run(r, w)
    assert "requests_routed" not in dp1
    assert dp2["requests_routed"] == [2, 2] and [e["dp_rank"] for e in dp2["replicas"]] == [0, 1]
    assert sum(e["output_tokens"] for e in dp2["replicas"]) == dp2["output_tokens"] == w["output_tokens"]
    assert sum(e["prompt_tokens"] for e in dp2["replicas"]) == w["prompt_tokens"]
    # Every computed token (prompts, then each output token but the last) routed to top_k = 2 experts per layer.
    tokens = 2 * (w["prompt_tokens"] + w["output_tokens"] - w["num_prompts"])
    for r in (dp1, dp2):
        layers = r["expert_load"]["layers"]
        assert len(layers) == 2 and all(v["tokens"] == tokens for v in layers.values())
    assert all(len(v["tokens_per_rank"]) == 2 for v in dp2["expert_load"]["layers"].values())
    assert dp1["collective_calls"] == 0 and dp2["collective_calls"] >= dp2["num_steps"]  # lockstep all-reduce
    assert "lockstep" in dp2["collective_measure"] and "replica" in dp2["roofline"]["scope"]
    out = capsys.readouterr().out
    assert "| NONE | 256 | 1 | on (1) |" in out and "| NONE | 256 | 2 | on (2) |" in out and "| 2 / 2 |" in out


NGRAM2 = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_cli_throughput_speculative_decoding_on_the_copy_workload(bench_cli, tmp_path):
    """--dataset copy (passages repeated in the prompt: lookup finds drafts) with --sweep spec=off,ngram: the JSON
    carries the drafts' counters and tokens per step; the same tokens come out either way, in fewer steps."""
    out = tmp_path / "spec.json"
    res = bench_cli("throughput", "--model", "tiny-llama", "--device", "cpu", "--dataset", "copy", "--num-prompts", "3",
                    "--min-len", "24", "--temperature", "0", "--sweep", "spec=off,ngram", "--output-json", str(out))
    result = json.loads(out.read_text())
    assert result["workload"]["dataset"] == "copy" and result["workload"]["output_tokens"] == 3 * 24
    off, on = result["runs"]
    assert off["speculative_config"] is None and "spec_decode" not in off and off["tokens_per_step"] <= 3  # 3 rows
    assert on["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 4}  # the default of a sweep without --speculative-config
    assert on["output_tokens"] == off["output_tokens"] and on["num_decode_steps"] < off["num_decode_steps"]
    assert on["tokens_per_step"] > off["tokens_per_step"] and on["async_scheduling"] is False
    sd = on["spec_decode"]
    assert 0 < sd["num_accepted_tokens"] <= sd["num_draft_tokens"] and sd["mean_acceptance_length"] > 1
    assert sd["acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"]
    assert "+ ngram k=3 (accept" in res.out and "tokens/step" in res.out


def test_cli_latency_speculative_decoding_on_the_copy_workload(bench_cli, tmp_path):
    """bench latency --dataset copy --speculative-config: per batch tokens per step, tok/s, TPOT and acceptance, with
    and without (the tiny random model falls into loops that lookup then drafts: acceptance > 0, deterministic)."""
    lat = tmp_path / "lat.json"
    res = bench_cli("latency", "--model", "tiny-llama", "--device", "cpu", "--dataset", "copy", "--batch-sizes", "4",
                    "--graph-modes", "NONE", "--num-steps", "10", "--warmup-steps", "2", "--prompt-len", "24",
                    "--temperature", "0", "--speculative-config", NGRAM2, "--output-json", str(lat))
    result = json.loads(lat.read_text())
    modes = result["modes"]
    [base], [spec] = modes["NONE"]["batches"], modes["NONE + ngram k=2"]["batches"]
    assert result["dataset"] == "copy" and modes["NONE + ngram k=2"]["speculative_config"] == json.loads(NGRAM2)
    # the same prompts both ways: passages long enough for every step to copy ((2 + 10 + 2) x 3 tokens)
    assert base["prompt_tokens"] == spec["prompt_tokens"] == 4 * (2 * 42 + 8)
    assert base["tokens_per_step"] == 4 and base["acceptance_rate"] is None and base["mean_acceptance_length"] == 1
    assert "spec_decode" not in base and base["tpot_ms"] == pytest.approx(base["median_ms"])
    assert 4 < spec["tokens_per_step"] <= 4 * 3
    assert spec["tok_s"] == pytest.approx(spec["tokens_per_step"] / spec["median_ms"] * 1e3)
    assert spec["tpot_ms"] == pytest.approx(spec["median_ms"] / (spec["tokens_per_step"] / 4))
    sd = spec["spec_decode"]  # the timed steps' drafts
    assert 0 < sd["num_accepted_tokens"] <= sd["num_draft_tokens"] and sd["num_drafts"] <= 4 * 10
    assert spec["acceptance_rate"] == sd["acceptance_rate"] > 0 and spec["mean_acceptance_length"] > 1
    assert sd["num_accepted_tokens"] == pytest.approx(spec["tokens_per_step"] * 10 - 4 * 10)  # 1 + accepted a row
    assert "acceptance" in res.out and "tokens/step, TPOT ms" in res.out


def test_cli_spec_sweep_values(monkeypatch):
    """--sweep spec=off,ngram / off,on and num-speculative-tokens=0,3,5 (throughput), --num-speculative-tokens
    (latency): the engine configs each run gets; a method the config does not have is a clear error."""
    from graphinfer import cli
    from graphinfer.bench import latency, throughput

    seen = {}
    monkeypatch.setattr(throughput, "run", lambda model, **kw: seen.update(kw))
    monkeypatch.setattr(latency, "run", lambda model, **kw: seen.update(kw))
    assert cli.main(["bench", "throughput", "--sweep", "spec=off,ngram"]) == 0
    assert seen["speculative_config"] == [None, cli.DEFAULT_NGRAM]
    draft = '{"model": "tiny-llama", "num_speculative_tokens": 2}'
    assert cli.main(["bench", "throughput", "--speculative-config", draft, "--sweep", "spec=off,on"]) == 0
    assert seen["speculative_config"] == [None, json.loads(draft)]
    assert cli.main(["bench", "throughput", "--speculative-config", NGRAM2,
                     "--sweep", "num-speculative-tokens=0,3,5"]) == 0
    assert [c and c["num_speculative_tokens"] for c in seen["speculative_config"]] == [None, 3, 5]
    assert all(c["prompt_lookup_max"] == 3 for c in seen["speculative_config"][1:])
    assert cli.main(["bench", "throughput", "--speculative-config", NGRAM2]) == 0  # no sweep: that config alone
    assert seen["speculative_config"] == [json.loads(NGRAM2)]
    assert cli.main(["bench", "latency", "--num-speculative-tokens", "3,5"]) == 0
    assert [c and c["num_speculative_tokens"] for c in seen["speculative_config"]] == [None, 3, 5]
    assert cli.main(["bench", "throughput", "--speculative-config", draft, "--sweep", "spec=off,ngram"]) == 2
    assert cli.main(["bench", "throughput", "--sweep", "spec=off,maybe"]) == 2


def test_copy_workload_prompts():
    """The copy workload as its docstring says: SmolLM2's chat prompt asking to repeat a passage of the fixed text
    (whole sentences, in order), max_tokens its length + 16; without a tokenizer a literally repeated id passage."""
    from graphinfer.bench import throughput
    from graphinfer.bench.accuracy_text import PERPLEXITY_TEXT
    from graphinfer.bench.copy_workload import INSTRUCTION, copy_prompts, load_copy_tokenizer

    prompts, max_tokens = copy_prompts(None, 2, 24, 0, 512)
    assert max_tokens == [24, 24] and prompts != copy_prompts(None, 2, 24, 1, 512)[0]
    for p in prompts:
        assert len(p) == 56 and p[:24] == p[24:48] and p[48:] == p[:8] and max(p) < 512
    tok = load_copy_tokenizer("")  # "": the bundled SmolLM2
    prompts, max_tokens = copy_prompts(tok, 3, 64, 0, 0)
    assert (prompts, max_tokens) == copy_prompts(tok, 3, 64, 0, 0)  # deterministic by seed
    text = " ".join(PERPLEXITY_TEXT.split())
    for p, m in zip(prompts, max_tokens):
        decoded = tok.decode(p)
        assert decoded.startswith("<|im_start|>system") and decoded.endswith("<|im_start|>assistant\n")
        passage = decoded.split(INSTRUCTION)[1].split("<|im_end|>")[0]
        assert passage in text and passage[-1] in ".!?"  # whole sentences, no wrap-around
        assert m == len(tok(passage, add_special_tokens=False).input_ids) + 16 >= 64 + 16
    # bench throughput: a real model's answer ends at its EOS (max_tokens a cap), random weights run to max_tokens
    assert not throughput.copy_workload("", 1, 64, 0, None).ignore_eos
    assert throughput.copy_workload("tiny-llama", 1, 24, 0, 512).ignore_eos


def test_latency_batch_whose_prompts_take_several_prefill_steps():
    """64 prompts of 160 tokens are more than one step's 8,192 tokens: the requests prefilled first decode while the
    rest prefill, and still have tokens left for every timed step (they ran out, and the bench raised KeyError)."""
    from graphinfer.bench.latency import run

    res = run("tiny-llama", device="cpu", batch_sizes=(64,), graph_modes=("NONE",), prompt_len=160, warmup_steps=1,
              num_steps=2, max_model_len=256)
    [b] = res["modes"]["NONE"]["batches"]
    assert b["batch"] == 64 and b["tokens_per_step"] == 64
