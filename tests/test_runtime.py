"""Runtime behaviour on a tiny random Llama: prefix caching, preemption, chunked prefill, no leaked blocks."""
import pytest
import torch

from graphinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm):
    engine = llm.llm_engine
    assert engine.local_core.scheduler.block_manager.num_free_blocks == engine.worker.model_runner.num_blocks
    assert not engine.local_core.scheduler.running and not engine.local_core.scheduler.waiting and not engine.output_processor.requests


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoint):
    return tiny_checkpoint("llama")[0]


def test_prefix_cache_reuses_blocks_and_keeps_tokens(llama_path):
    shared = _prompts([100])[0]
    a, b = shared + _prompts([7], 1)[0], shared + _prompts([13], 2)[0]
    cached = LLM(llama_path, block_size=16)
    first = cached.generate([a], GREEDY, use_tqdm=False)[0]
    second = cached.generate([b], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # the 6 full blocks of the shared 100-token prefix
    plain = LLM(llama_path, block_size=16, enable_prefix_caching=False)
    assert _tokens(plain.generate([a, b], GREEDY, use_tqdm=False)) == _tokens([first, second])
    # a whole prompt seen before: every block but the one holding its last token is a hit
    again = cached.generate([b], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == ((len(b) - 1) // 16) * 16
    assert _tokens([again]) == _tokens([second])
    _assert_no_leak(cached)


def test_preemption_with_tiny_pool_gives_same_tokens(llama_path):
    prompts = _prompts([30, 45, 12, 60, 25, 38])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(llama_path, block_size=4).generate(prompts, params, use_tqdm=False)
    tiny = LLM(llama_path, block_size=4, num_gpu_blocks_override=30)  # 120 token slots for ~400 tokens of work
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert tiny.llm_engine.local_core.scheduler.num_preemptions > 0
    assert _tokens(outs) == _tokens(reference)
    _assert_no_leak(tiny)


def test_chunked_prefill_and_small_budgets_give_same_tokens(llama_path):
    prompts = _prompts([70, 5, 33, 120])
    reference = _tokens(LLM(llama_path).generate(prompts, GREEDY, use_tqdm=False))
    for kw in (dict(max_num_batched_tokens=8), dict(max_num_seqs=1), dict(max_num_batched_tokens=17, max_num_seqs=2)):
        llm = LLM(llama_path, **kw)
        assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference, kw
        _assert_no_leak(llm)


def test_request_that_can_never_fit_is_rejected_and_others_run(llama_path):
    from graphinfer.errors import KVCacheTooSmallError

    llm = LLM(llama_path, block_size=4, num_gpu_blocks_override=8)  # 32 token slots
    with pytest.raises(KVCacheTooSmallError, match="KV-cache blocks"):
        llm.generate([_prompts([10])[0], _prompts([40])[0]], GREEDY, use_tqdm=False)
    _assert_no_leak(llm)  # validated before queueing: nothing half-submitted
    out = llm.generate(_prompts([10]), SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 20
    _assert_no_leak(llm)


def test_abort_and_errors_mid_run_free_blocks(llama_path):
    llm = LLM(llama_path)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, GREEDY) for p in _prompts([50, 60])]
    engine.step()
    assert engine.local_core.scheduler.block_manager.num_free_blocks < engine.worker.model_runner.num_blocks
    for i in ids:
        engine.abort_request(i)
    _assert_no_leak(llm)

    def boom(*args, **kw):
        raise KeyboardInterrupt

    llm.llm_engine.worker.model_runner.execute, original = boom, llm.llm_engine.worker.model_runner.execute
    with pytest.raises(KeyboardInterrupt):
        llm.generate(_prompts([20, 30]), GREEDY, use_tqdm=False)
    _assert_no_leak(llm)
    llm.llm_engine.worker.model_runner.execute = original
    assert len(llm.generate(_prompts([20]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 20


def test_max_model_len_ends_generation_with_length(llama_path):
    llm = LLM(llama_path, max_model_len=40)
    out = llm.generate(_prompts([30]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_output_kind_final_only_reports_once_and_generate_leaves_params_alone(llama_path):
    from graphinfer.sampling_params import RequestOutputKind

    llm = LLM(llama_path, dtype="float32")
    engine = llm.llm_engine
    final = SamplingParams(temperature=0, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", [1, 2, 3], final)
    engine.add_request("every", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    seen = {"final": [], "every": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.finished)
    assert seen == {"final": [True], "every": [False, False, False, True]}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([[1, 2]], params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
