"""MTP speculative decoding (speculative_config method "mtp": runtime/spec_decode/mtp_proposer.py, models/
deepseek_mtp.py) on the tiny DeepSeek-V3 with one MTP layer appended (hf_zoo.make_mtp_checkpoint). transformers 5.17's
own MtpModel (hf_zoo.hf_mtp_logits) is the oracle for the draft step: graphinfer's draft logits at every position
equal it, also after a prefix-cache hit that ends at a block boundary; the drafts at k = 1, and so the acceptance
counters, are the ones HF's argmax predicts; greedy output equals plain decoding at k = 1 and 2 through chunked
prefill and prefix hits. The MTP layer's weights are random, so its drafts are mostly wrong: at k = 1 one draft is
accepted along these prompts (which HF's drafts predict exactly)."""
import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.config import SpeculativeConfig
from graphinfer.errors import InvalidConfigError
from hf_zoo import ZOO_PROMPTS, hf_mtp_logits

# prompts of 5-67 tokens: the 41- and 67-token ones prefill in 32-token chunks
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, block_size=8)
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def mtp(k, method="mtp"):
    return {"method": method, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def path(deepseek_mtp_checkpoint):
    return deepseek_mtp_checkpoint()


@pytest.fixture(scope="module")
def plain(path):
    """Greedy tokens of plain decoding (no speculation), and HF's MTP draft at every position of each sequence."""
    with LLM(path, **ENGINE) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    drafts = [hf_mtp_logits(path, p + o).argmax(dim=-1).tolist() for p, o in zip(ZOO_PROMPTS, outs)]
    return outs, drafts


def _prompts(prompts=ZOO_PROMPTS):
    return [{"prompt_token_ids": p} for p in prompts]


def _expected_counters(prompt, output, drafts):
    """(drafts, accepted) of one request at k = 1 when every draft is HF's: the draft after a sequence of n tokens
    is row n - 2's argmax (token n - 1's embedding on the hidden state at n - 2); accepted, the step emits 2 tokens."""
    full, n, proposed, accepted = prompt + output, len(prompt) + 1, 0, 0
    while n - len(prompt) < NEW - 1:  # draft_budget: a step emits at most max_tokens - outputs tokens
        proposed += 1
        hit = drafts[n - 2] == full[n]
        accepted += hit
        n += 1 + hit
    return proposed, accepted


def test_draft_logits_equal_transformers_mtp(path):
    """k = 1, one request of 67 tokens (three chunks) and 8 greedy tokens: the MTP layer's logits at each of its
    positions (its catch-up rows, recorded) equal HF's MtpModel on the whole sequence; then a prompt sharing the
    first 32 tokens (four full blocks) and diverging right after: its hit keeps three blocks (the fourth's last
    row was computed with the first request's token 32), and its rows, computed over the cached ones, equal HF's."""
    with LLM(path, speculative_config=mtp(1), **ENGINE) as llm:
        drafter = llm.llm_engine.worker.model_runner.drafter
        rows = {}
        forward = drafter.model.forward

        def record(input_ids, positions, previous, md):
            out = forward(input_ids, positions, previous, md)
            rows.update(zip(positions.tolist(), drafter.compute_logits(out)))
            return out

        drafter.model.forward = record
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        first = ZOO_PROMPTS[3]
        second = first[:32] + ZOO_PROMPTS[2][:20]
        errors = []
        for prompt, cached in ((first, 0), (second, 24)):
            rows.clear()
            out = llm.generate(_prompts([prompt]), params, use_tqdm=False)[0]
            assert out.num_cached_tokens == cached
            full = prompt + out.outputs[0].token_ids
            assert sorted(rows) == list(range(cached, len(full) - 1))  # each computed position once
            ref = hf_mtp_logits(path, full)[cached:]
            ours = torch.stack([rows[p] for p in range(cached, len(full) - 1)]).float()
            errors.append((ours - ref).abs().max().item())
            assert torch.equal(ours.argmax(dim=-1), ref.argmax(dim=-1))
        assert max(errors) < 1e-4, errors  # measured 2.7e-6 (logits up to ~4)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_equals_plain_decoding(path, plain, k):
    """Four prompts (two chunked), then the same again from the prefix cache: the tokens of plain decoding; the
    counters add up (per request, per position, in /metrics). At k = 1 each request's drafts and accepted drafts are
    those HF's MTP argmax predicts, cold and after the hits alike; k = 2 runs in 16 blocks of 8 tokens, where
    requests are preempted and recomputed (a recomputed request samples once without drafts, so its counters
    differ from an unpreempted run's)."""
    from graphinfer.server.metrics import Metrics

    expected, hf_drafts = plain
    tight = dict(num_gpu_blocks_override=16) if k == 2 else {}
    with LLM(path, speculative_config=mtp(k, "deepseek_mtp" if k == 2 else "mtp"), **tight, **ENGINE) as llm:
        engine = llm.llm_engine
        runs = []
        for run in ("cold", "prefix hits"):
            outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == expected, run
            runs.append([(o.metrics["spec_decode_num_draft_tokens"], o.metrics["spec_decode_num_accepted_tokens"])
                         for o in outs])
        assert sum(o.num_cached_tokens for o in outs) > 0
        assert (engine.local_core.scheduler.num_preemptions > 0) == (k == 2)
        stats = engine.spec_decode_stats()
        assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] <= k * stats["num_drafts"]
        assert stats["num_draft_tokens"] == sum(d for run in runs for d, _ in run)
        assert stats["num_accepted_tokens"] == sum(a for run in runs for _, a in run)
        assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
        if k == 1:
            want = [_expected_counters(p, o, d) for p, o, d in zip(ZOO_PROMPTS, expected, hf_drafts)]
            assert runs == [want, want]
            assert stats["num_accepted_tokens"] > 0  # 1 per run: the fourth prompt's draft at position 80
        metrics = Metrics("mtp")
        metrics.watch_spec_decode(engine)
        text = metrics.render().decode()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert f'graphinfer:spec_decode_{name}_total{{model_name="mtp"}} {float(stats[name])}' in text
        # the MTP layer's cache: a row per block of the target's (counted in the budget), plus scratch for drafts
        runner = engine.worker.model_runner
        drafter = runner.drafter
        assert drafter.kv_cache.shape[2] == runner.num_blocks + drafter.num_scratch_blocks
        assert runner._block_bytes() == runner.kv_cache[:, :, 0].nbytes + drafter.kv_cache[:, :, 0].nbytes
        assert engine.local_core.scheduler.block_manager.num_free_blocks == runner.num_blocks


def test_verify_graphs_feed_the_drafter(monkeypatch, path, plain):
    """FULL_DECODE_ONLY (the capture stand-in): with a drafter the graphs end before the LM head, and the hidden
    states their replays leave are what the MTP layer reads: the tokens of plain decoding, and at k = 1 the drafts
    HF's argmax predicts."""
    from capture_standin import OpTapePlatform

    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    expected, hf_drafts = plain
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: OpTapePlatform())
    with LLM(path, graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4], speculative_config=mtp(1),
             **ENGINE) as llm:
        dispatcher = llm.llm_engine.worker.model_runner.dispatcher
        assert not dispatcher.lm_head_in_graph
        graphs = dispatcher.verify_graphs
        replays, replay = [], graphs.replay
        monkeypatch.setattr(graphs, "replay", lambda *a, **k: replays.append(len(a[0])) or replay(*a, **k))
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [(o.metrics["spec_decode_num_draft_tokens"], o.metrics["spec_decode_num_accepted_tokens"])
                for o in outs] == [_expected_counters(p, o, d) for p, o, d in zip(ZOO_PROMPTS, expected, hf_drafts)]
        assert replays and set(replays) <= {2, 4, 6, 8}


def test_embedding_and_head_shared_unless_the_copies_differ(path, tmp_path):
    """DeepSeek ships copies of the embedding and LM head in the MTP layer: equal ones share the target's modules
    (no memory), different ones are the MTP layer's own."""
    import shutil

    from safetensors.torch import load_file, save_file

    from graphinfer.model_loader import load_model
    from graphinfer.models.deepseek_mtp import load_deepseek_mtp

    target, config = load_model(path, torch.float32)
    mtp_model = load_deepseek_mtp(path, config, target, torch.float32, "cpu")
    assert mtp_model.embed_tokens is target.model.embed_tokens and mtp_model.layer.shared_head.head is target.lm_head
    other = shutil.copytree(path, tmp_path / "other")
    tensors = load_file(other / "model.safetensors")
    L = config.num_hidden_layers
    tensors[f"model.layers.{L}.embed_tokens.weight"] *= 2
    tensors[f"model.layers.{L}.shared_head.head.weight"] *= 3
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    mtp_model = load_deepseek_mtp(str(other), config, target, torch.float32, "cpu")
    assert torch.equal(mtp_model.embed_tokens.weight, 2 * target.model.embed_tokens.weight)
    assert torch.equal(mtp_model.layer.shared_head.head.weight, 3 * target.lm_head.weight)


def test_method_mtp_needs_mtp_layers(deepseek_checkpoint):
    """A clear error, before anything loads, for a model without MTP layers; "deepseek_mtp" is vLLM's other name."""
    assert SpeculativeConfig.from_dict(mtp(2, "deepseek_mtp")).method == "mtp"
    with pytest.raises(InvalidConfigError, match="no MTP layers"):
        LLM(deepseek_checkpoint("deepseek_v3"), speculative_config=mtp(1), **ENGINE)
    with pytest.raises(InvalidConfigError, match="DeepSeek-V3 checkpoint's own MTP layers"):
        LLM("tiny-llama", speculative_config=mtp(1), **ENGINE)
