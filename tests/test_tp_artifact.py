"""Tensor-parallel artifacts: `compile -tp 2` writes one graph and a weight shard per rank; each rank loads its own,
the tokens are tp 1's; an artifact runs only at the tensor-parallel size it was compiled for, and an edited shard
is refused."""
import contextlib
import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import graphinfer.runtime.executor.factory as executor_factory
import graphinfer.compiler.pipeline as pipeline
from graphinfer import LLM, SamplingParams
from graphinfer.cli import _parallel_config, build_parser, main
from graphinfer.compiler.artifact import final_weights, graph_source
from graphinfer.compiler.compile import compile_model
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import ArtifactMismatchError
from graphinfer.model_loader import load_model
from graphinfer.passes import resolve_passes

KW = dict(device="cpu", dtype="float32", num_gpu_blocks_override=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 80)), [3]]
SHARDS = ["model-rank0-of-2.safetensors", "model-rank1-of-2.safetensors"]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tp1():
    """tiny-llama at tp 1, compiled in memory: the reference tokens and final weights; and its tp-1 artifact."""
    llm = LLM("tiny-llama", **KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2_artifact(tmp_path_factory):
    """(artifact dir, compile's stdout): `graphinfer compile tiny-llama -tp 2`, in this process (rank 0)."""
    art = str(tmp_path_factory.mktemp("tp2") / "art")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compile", "tiny-llama", "-o", art, "--device", "cpu", "--dtype", "float32", "-tp", "2"]) == 0
    return art, out.getvalue()


@pytest.fixture(scope="module")
def tp1_artifact(tp1, tmp_path_factory):
    art = str(tmp_path_factory.mktemp("tp1") / "art")
    tp1.llm_engine.save_artifact(art)
    return art


def test_compile_writes_one_graph_and_a_shard_per_rank(tp2_artifact, tp1):
    art, stdout = tp2_artifact
    assert sorted(os.listdir(art)) == ["config.json", "graph.py", "manifest.json", *SHARDS, "report.txt"]
    manifest = json.load(open(os.path.join(art, "manifest.json")))
    assert manifest["tensor_parallel_size"] == 2 and sorted(manifest["files"]) == ["config.json", "graph.py", *SHARDS]
    for rank, shard in enumerate(SHARDS):
        assert f"rank {rank} weights: {os.path.join(art, shard)}" in stdout
    # each file is its rank's slice of the final (fused) weights: o_proj / down_proj split by input columns,
    # gate_up_proj by output rows within each of its halves
    whole = final_weights(tp1.llm_engine.worker.graph, tp1.llm_engine.worker.model)
    shards = [load_file(os.path.join(art, s)) for s in SHARDS]
    assert shards[0].keys() == whole.keys() == shards[1].keys()
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), whole[name])
    name = "model.layers.0.mlp.gate_up_proj.weight"
    halves = [s[name].chunk(2) for s in shards]  # gate rows, up rows of each rank
    assert torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves]), whole[name])


def test_every_rank_compiles_the_graph_code_the_artifact_holds(tp2_artifact):
    """graph.py is written once for all ranks: rank 1's graph (its shard, built here as that layout) is the same code
    (the vocab-parallel embedding keeps its rank's offset in a buffer, not in the code)."""
    art, _ = tp2_artifact
    with ps.layout(1, 2):
        model, _ = load_model("tiny-llama", torch.float32, "cpu", 0)
        gm, _ = compile_model(model, resolve_passes("default"), check=False)
    code = graph_source(gm)
    assert "graphinfer.all_reduce" in code and code == open(os.path.join(art, "graph.py")).read()


def test_artifact_runs_at_its_tp_with_tp1_tokens(tp2_artifact, tp1, monkeypatch):
    art, _ = tp2_artifact
    with LLM("tiny-llama", tensor_parallel_size=2, **KW) as in_memory:
        compiled_here = _tokens(in_memory)

    def no_compile(*a, **k):
        raise AssertionError("an artifact must not be traced or passed again")

    monkeypatch.setattr(pipeline, "compile_model", no_compile)
    with LLM(artifact=art, device="cpu", num_gpu_blocks_override=64) as llm:  # tp and dtype: the artifact's
        engine = llm.llm_engine
        assert engine.config.parallel_config.tensor_parallel_size == 2
        assert engine.worker.model.model.layers[0].self_attn.o_proj.weight.shape[1] == 32  # rank 0's half
        assert _tokens(llm) == compiled_here == _tokens(tp1)


def test_other_tp_is_refused_before_any_rank_starts(tp2_artifact, tp1_artifact, monkeypatch, tmp_path):
    def no_ranks(*a, **k):
        raise AssertionError("ranks started for an artifact of another tensor-parallel size")

    monkeypatch.setattr(executor_factory, "MultiprocExecutor", no_ranks)
    art, _ = tp2_artifact
    with pytest.raises(ArtifactMismatchError, match=r"compiled for tensor_parallel_size=2, but this engine runs "
                                                    r"tensor_parallel_size=1\. Run it with --tensor-parallel-size 2 .*"
                                                    r"graphinfer compile tiny-llama -o .* --tensor-parallel-size 1"):
        LLM(artifact=art, tensor_parallel_size=1, **KW)
    with pytest.raises(ArtifactMismatchError, match="compiled for tensor_parallel_size=1, but this engine runs "
                                                    "tensor_parallel_size=2"):
        LLM(artifact=tp1_artifact, tensor_parallel_size=2, **KW)
    # an artifact from before tensor parallelism (no tensor_parallel_size in its manifest) holds tp 1's weights
    old = str(tmp_path / "old")
    shutil.copytree(tp1_artifact, old)
    path = os.path.join(old, "manifest.json")
    manifest = json.load(open(path))
    del manifest["tensor_parallel_size"]
    json.dump(manifest, open(path, "w"))
    with pytest.raises(ArtifactMismatchError, match="compiled for tensor_parallel_size=1, but this engine runs "
                                                    "tensor_parallel_size=2"):
        LLM(artifact=old, tensor_parallel_size=2, **KW)
    assert LLM(artifact=old, **KW).llm_engine.config.parallel_config.tensor_parallel_size == 1


def test_cli_takes_tp_from_the_artifact(tp2_artifact, tp1_artifact):
    """generate / serve pass no tp to LLM (which takes the artifact's); other nodes' workers (_parallel_config) read
    it there too."""
    art, _ = tp2_artifact
    parse = build_parser().parse_args
    assert parse(["serve", art]).tensor_parallel_size is None
    for argv, tp in ([["serve", art], 2], [["generate", "--artifact", art, "--prompt", "x"], 2],
                     [["serve", tp1_artifact], 1], [["serve", "tiny-llama"], 1], [["serve", art, "-tp", "4"], 4]):
        assert _parallel_config(parse(argv)).tensor_parallel_size == tp


def test_edited_shard_is_refused(tp2_artifact, tmp_path):
    """Each rank checks the files it reads; rank 0 raises what rank 1 found in its shard."""
    art = str(tmp_path / "art")
    shutil.copytree(tp2_artifact[0], art)
    with open(os.path.join(art, SHARDS[1]), "ab") as f:
        f.write(b" ")
    with pytest.raises(ArtifactMismatchError, match=r"(?s)found by rank 1.*model-rank1-of-2\.safetensors: artifact "
                                                    r"has '[0-9a-f]+', here '[0-9a-f]+'.*--tensor-parallel-size 2"):
        LLM(artifact=art, **KW)
