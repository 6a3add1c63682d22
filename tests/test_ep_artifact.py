"""Expert-parallel artifacts: `compile -tp 2 --enable-expert-parallel` of a transformers-5 Qwen3-MoE checkpoint
(its config.json names the expert count num_local_experts), loaded back at tp 2: the manifest records EP, the
tokens are tp 1's, and running it with expert parallel off is refused before any rank starts."""
import json
import os

import pytest

from graphinfer import LLM, SamplingParams
from graphinfer.cli import main
from graphinfer.compiler.artifact import load_config, read_manifest
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import ArtifactMismatchError

KW = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=4)
PROMPTS = [[3, 4, 5, 6, 7], [9] * 11, [20, 21]]


def _tokens(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")[0]
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert "num_local_experts" in saved and "num_experts" not in saved  # transformers 5's name
    return path


@pytest.fixture(scope="module")
def ep_artifact(moe_checkpoint, tmp_path_factory):
    art = str(tmp_path_factory.mktemp("ep-art") / "art")
    assert main(["compile", moe_checkpoint, "-o", art, "--device", "cpu", "--dtype", "float32", "-tp", "2",
                 "--enable-expert-parallel"]) == 0
    return art


def test_num_local_experts_config_reads_back_from_the_artifact(ep_artifact):
    config = load_config(ep_artifact)
    assert config.num_experts == 8 and "num_experts" not in config.to_dict()  # read through, saved as it was


def test_ep_artifact_runs_with_tp1_tokens_and_refuses_ep_off(ep_artifact, moe_checkpoint):
    manifest = read_manifest(ep_artifact)
    assert manifest["enable_expert_parallel"] is True and manifest["tensor_parallel_size"] == 2
    with LLM(moe_checkpoint, **KW) as llm:
        ref = _tokens(llm)
    with LLM(artifact=ep_artifact, **KW) as llm:  # tp 2 and expert parallel from the manifest
        assert llm.llm_engine.config.parallel_config.enable_expert_parallel
        assert _tokens(llm) == ref
    with pytest.raises(ArtifactMismatchError, match=r"compiled with expert parallel on, but this engine runs it off.*"
                                                    r"Run it with --enable-expert-parallel"):
        LLM(artifact=ep_artifact, enable_expert_parallel=False, **KW)
    assert not ps.is_initialized()
