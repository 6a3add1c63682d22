"""LoRA adapters in the engine (issue 52): PEFT adapters made by peft itself on tiny random Llama and Qwen3 checkpoints
(fused q/k/v and gate/up in graphinfer's graph), and as the reference HF's greedy tokens of the base model with each
adapter merged by peft (merge_and_unload: W + scaling B A). One mixed batch (adapter 1, adapter 2, none, adapter 1) gives
each request its own adapter's tokens: in NONE, under the capture stand-in (full decode graphs and pieces replayed with
the index buffer changing between steps), at tp 2, through preemption, with more adapters queued than max_loras, and
with prefix-cache hits that never cross adapters."""
import os
import functools

import pytest
from capture_standin import OpTapePlatform
from hf_zoo import greedy_of
from lora_utils import make_peft_adapter

import graphinfer.runtime.entrypoints.llm_engine as llm_engine
from graphinfer import LLM, SamplingParams
from graphinfer.errors import ArtifactMismatchError, InvalidRequestError, LoRAAdapterError
from graphinfer.lora import LoRARequest

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=96, max_num_seqs=8,
          max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=16)
PROMPTS = [list(range(5, 5 + n)) for n in (9, 14, 6, 21)]
NEW = 6
ADAPTERS = {  # name -> (peft LoraConfig kwargs, seed): two ranks, rslora, a subset of the projections
    "a1": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]), 1),
    "a2": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]), 2),
}
MIX = ["a1", "a2", None, "a1"]


def _params():
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_case(tiny_checkpoint, tmp_path_factory):
    """arch -> (checkpoint dir, {name: LoRARequest}, {name or None: HF's greedy tokens of PROMPTS with it merged})."""
    @functools.cache
    def make(arch: str):
        path, hf = tiny_checkpoint(arch)
        requests, expected = {}, {None: greedy_of(hf, PROMPTS, NEW)}
        for i, (name, (kwargs, seed)) in enumerate(ADAPTERS.items()):
            out = str(tmp_path_factory.mktemp(f"lora-{arch}-{name}"))
            expected[name] = greedy_of(make_peft_adapter(hf, out, seed, **kwargs), PROMPTS, NEW)
            requests[name] = LoRARequest(name, i + 1, out)
        assert expected["a1"] != expected[None] and expected["a2"] != expected[None] != expected["a1"]
        return path, requests, expected

    return make


def _mixed(llm: LLM, requests: dict, batch=tuple(enumerate(MIX))) -> list[list[int]]:
    """Greedy tokens of batch: (prompt index, adapter name or None) pairs, one request each, all in one generate."""
    loras = [requests[n] if n else None for _, n in batch]
    outs = llm.generate([PROMPTS[i] for i, _ in batch], _params(), use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def _expected(expected: dict, batch=tuple(enumerate(MIX))) -> list[list[int]]:
    return [expected[n][i] for i, n in batch]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_gives_each_request_its_adapter(arch, lora_case):
    """One batch mixing two adapters of other ranks and the base model: each request HF's tokens with its adapter
    merged; the fused q/k/v and gate/up carry the adapters' stacked slices (the pass's report says where)."""
    path, requests, expected = lora_case(arch)
    with LLM(path, **KW) as llm:
        assert _mixed(llm, requests) == _expected(expected)
        # other pairings in another order: slots are reused, nothing stale
        batch = [(3, None), (0, "a2"), (2, "a1"), (1, "a2")]
        assert _mixed(llm, requests, batch) == _expected(expected, batch)
        report = next(r for r in llm.llm_engine.worker.compiled.pass_reports if r.name == "lora")
        layers = llm.llm_engine.hf_config.num_hidden_layers
        assert report.matches == 4 * layers  # qkv_proj, o_proj, gate_up_proj, down_proj per layer
        assert llm.llm_engine.list_loras() == {1, 2}


def test_captured_graphs_serve_any_mix_of_adapters(lora_case, monkeypatch):
    """FULL_AND_PIECEWISE on the capture stand-in: decode steps replay full graphs, prompt steps the pieces, all
    captured before any adapter was loaded; the adapters and the per-token slots reach them through buffers."""
    path, requests, expected = lora_case("qwen3")
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    replays = []
    with LLM(path, graph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8, 64], **KW) as llm:
        dispatcher = llm.llm_engine.worker.model_runner.dispatcher
        for graphs, method in ((dispatcher.decode_graphs, "replay"), (dispatcher.piecewise_graphs, "run")):
            original = getattr(graphs, method)
            monkeypatch.setattr(graphs, method, lambda *a, _o=original, _m=method, **k: replays.append(_m) or _o(*a, **k))
        assert _mixed(llm, requests) == _expected(expected)
    assert {"replay", "run"} <= set(replays)


def test_more_adapters_than_slots_wait_their_turn(lora_case):
    """max_loras=1: a step holds one adapter (and the base model), so the other adapter's requests wait; all finish,
    each with its own tokens."""
    path, requests, expected = lora_case("llama")
    batch = [(0, "a1"), (1, "a2"), (2, "a1"), (3, "a2"), (1, None), (0, "a2")]
    with LLM(path, **{**KW, "max_loras": 1}) as llm:
        steps = []
        lora = llm.llm_engine.worker.model_runner.lora
        plan = lora.plan
        lora.plan = lambda reqs: steps.append(set(reqs)) or plan(reqs)
        assert _mixed(llm, requests, batch) == _expected(expected, batch)
    assert all(len(s) <= 1 for s in steps) and {1} in steps and {2} in steps


def test_preempted_requests_recompute_with_their_adapter(lora_case):
    """A KV pool too small for the batch preempts requests; their recompute uses their adapter again; with async
    scheduling too (the next step's slots planned while one is in flight)."""
    path, requests, expected = lora_case("llama")
    batch = [(0, "a1"), (1, "a2"), (2, None), (3, "a1"), (0, "a2"), (1, "a1")]
    with LLM(path, **{**KW, "num_gpu_blocks_override": 11}) as llm:
        assert _mixed(llm, requests, batch) == _expected(expected, batch)
        core = llm.llm_engine.local_core
        assert core.scheduler.num_preemptions > 0
        core.async_scheduling = True
        assert _mixed(llm, requests, batch) == _expected(expected, batch)


def test_speculative_decoding_verifies_with_the_adapter(lora_case):
    """ngram drafts are verified by the adapted model: the tokens are the adapter's, and drafts are accepted."""
    path, requests, expected = lora_case("qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    with LLM(path, speculative_config=spec, **KW) as llm:
        assert _mixed(llm, requests) == _expected(expected)
        assert llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] > 0


def test_prefix_cache_hits_stay_within_an_adapter(lora_case):
    """A prompt cached under adapter 1 is a hit for adapter 1 again, never for adapter 2 or the base model."""
    path, requests, expected = lora_case("llama")
    with LLM(path, **KW) as llm:
        def run(name):
            out = llm.generate([PROMPTS[3]], _params(), use_tqdm=False, lora_request=requests[name] if name else None)[0]
            return out.outputs[0].token_ids, out.num_cached_tokens

        assert run("a1") == (expected["a1"][3], 0)
        assert run("a2") == (expected["a2"][3], 0)
        assert run(None) == (expected[None][3], 0)
        tokens, cached = run("a1")
        assert tokens == expected["a1"][3] and cached > 0


def test_tp2_gives_each_request_its_adapter(lora_case):
    """tp 2 (gloo, a real worker process): A and B shard like their base layers (column-parallel: B's rows; row-
    parallel: A's columns, the delta summed by the layer's all-reduce), the step's slot plan travels to rank 1."""
    path, requests, expected = lora_case("qwen3")
    with LLM(path, tensor_parallel_size=2, **KW) as llm:
        assert _mixed(llm, requests) == _expected(expected)


def test_bad_adapters_and_requests_are_refused(lora_case, tmp_path, tiny_checkpoint):
    """A missing adapter directory, or an adapter above max_lora_rank, is a LoRAAdapterError naming it, and the engine
    serves on; a LoRA request to an engine without enable_lora is an InvalidRequestError with the fix."""
    path, requests, expected = lora_case("llama")
    with LLM(path, **{**KW, "max_lora_rank": 4}) as llm:
        with pytest.raises(LoRAAdapterError, match="does not exist"):
            llm.generate([PROMPTS[0]], _params(), use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path / "no")))
        with pytest.raises(LoRAAdapterError, match="max_lora_rank"):
            llm.generate([PROMPTS[0]], _params(), use_tqdm=False, lora_request=requests["a1"])  # rank 8
        assert _mixed(llm, requests, [(0, "a2"), (1, None)]) == _expected(expected, [(0, "a2"), (1, None)])
        assert llm.llm_engine.local_core.scheduler.block_manager.num_free_blocks == KW["num_gpu_blocks_override"]
    with LLM(path, **{k: v for k, v in KW.items() if "lora" not in k}) as llm:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            llm.generate([PROMPTS[0]], _params(), use_tqdm=False, lora_request=requests["a1"])


def test_artifact_keeps_the_lora_graph_and_sizes_slots_at_load(lora_case, tmp_path):
    """An artifact compiled with enable_lora holds the lora nodes and empty slots (none of their zeros on disk); served
    with another max_loras it gives each request its adapter's tokens. enable_lora on an artifact compiled without it
    is refused naming the recompile command."""
    path, requests, expected = lora_case("llama")
    art, plain = str(tmp_path / "art"), str(tmp_path / "plain")
    with LLM(path, **{**KW, "max_loras": 4, "max_lora_rank": 64}) as llm:
        manifest = llm.llm_engine.save_artifact(art)
    assert manifest["enable_lora"] and os.path.getsize(os.path.join(art, "added_modules.pt")) < 200_000
    with LLM(artifact=art, **{k: v for k, v in KW.items() if k != "enable_lora"}) as llm:  # enable_lora from the artifact
        assert llm.llm_engine.worker.model_runner.lora.modules[0].lora_a.shape[0] == KW["max_loras"]
        assert _mixed(llm, requests) == _expected(expected)
    with LLM(path, **{k: v for k, v in KW.items() if "lora" not in k}) as llm:
        llm.llm_engine.save_artifact(plain)
    with pytest.raises(ArtifactMismatchError, match="--enable-lora"):
        LLM(artifact=plain, **KW)
