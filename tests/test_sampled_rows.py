"""The sampled-rows forward (compiler/sampled_rows.py): the layers after the last attention run on the rows whose
logits are sampled, giving what the whole forward gives on those rows; tails that are not row-wise keep the whole
forward."""
import pytest
import torch

from graphinfer import LLM, SamplingParams
from graphinfer.compiler.sampled_rows import sampled_rows_graph

KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=64, max_num_seqs=8, seed=0)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * n) % 250 + 1 for i in range(n)]} for n in (5, 9, 17, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)


def _logprobs(outputs):
    return [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs]


def _assert_same(a, b):
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for sa, sb in zip(_logprobs(a), _logprobs(b)):
        for da, db in zip(sa, sb):
            assert da.keys() == db.keys()
            assert max(abs(da[t] - db[t]) for t in da) < 1e-5


@pytest.mark.parametrize("arch,extra", [("llama", {"max_num_batched_tokens": 6}), ("qwen2", {}), ("qwen3", {})])
def test_sampled_rows_give_the_whole_forwards_logprobs(tiny_checkpoint, arch, extra):
    """Batched prompts of different lengths (llama: in chunks of 6 tokens, so that some steps' rows are all mid-prompt,
    sample nothing and run the tail on no rows): the same tokens and logprobs as the whole forward."""
    path, _ = tiny_checkpoint(arch)
    with LLM(path, **KW, **extra) as llm:
        runner = llm.llm_engine.worker.model_runner
        assert runner.graph_rows is not None
        rows = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runner.graph_rows = None
        whole = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _assert_same(rows, whole)


def test_the_last_layer_runs_on_the_sampled_rows_only(tiny_checkpoint):
    """In a prefill the first layer's MLP sees every prompt token, the last one's a row per prompt; the engine's own
    graph (what artifacts save) is left as it was."""
    path, _ = tiny_checkpoint("llama")
    with LLM(path, **KW) as llm:
        layers = llm.llm_engine.worker.model_runner.model.model.layers
        seen = {0: [], len(layers) - 1: []}
        for i, rows in seen.items():
            layers[i].mlp.down_proj.register_forward_hook(lambda m, args, out, rows=rows: rows.append(len(args[0])))
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        graph = llm.llm_engine.worker.compiled.graph
        code = graph.code
        copy, why = sampled_rows_graph(graph)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in PROMPTS)
    assert seen == {0: [prompt_tokens], len(layers) - 1: [len(PROMPTS)]}
    assert graph.code == code and "logits_indices" not in code
    assert "logits_indices" in copy.code and "run on the sampled rows only" in why
    assert sum(n.target is torch.index_select for n in copy.graph.nodes) == 2  # the attention's output, the residual


def test_a_tail_that_is_not_row_wise_keeps_the_whole_forward(tiny_checkpoint, caplog):
    """An MoE last layer (its router's softmax is not among the known row-wise ops; its expert-load counts see every
    row) is not cut, and the engine says why."""
    path, _ = tiny_checkpoint("qwen3_moe")
    with caplog.at_level("INFO", logger="graphinfer.compiler.pipeline"), LLM(path, **KW) as llm:
        assert llm.llm_engine.worker.model_runner.graph_rows is None
        copy, why = sampled_rows_graph(llm.llm_engine.worker.compiled.graph)
    assert copy is None and "(softmax) after the last attention is not known to be row-wise" in why
    assert f"sampled-rows forward: {why}" in caplog.text


def test_lora_keeps_the_whole_forward(tiny_checkpoint):
    """The lora pass's ops read each token's adapter slot from a buffer of every row's: not cut."""
    path, _ = tiny_checkpoint("llama")
    with LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, **KW) as llm:
        assert llm.llm_engine.worker.model_runner.graph_rows is None
        copy, why = sampled_rows_graph(llm.llm_engine.worker.compiled.graph)
    assert copy is None and "lora" in why
