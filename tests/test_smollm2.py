"""Real weights: the bundled SmolLM2-135M-Instruct (GGUF, fp32, CPU) against HF transformers' generate."""
import torch

from graphinfer import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hi",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "List three prime numbers:",
    "<|im_start|>user\nWhat is the boiling point of water in Celsius?<|im_end|>\n<|im_start|>assistant\n",
    "Translate to French: 'The weather is nice today, and I would like to take a walk along the river "
    "before dinner, if you would care to join me.'",
]


def _hf_greedy(hf_smollm2, prompt_ids, n):
    model, _ = hf_smollm2
    ids = torch.tensor([prompt_ids])
    # eos_token_id=None: keep going past EOS like ignore_eos. The explicit mask matters: without it HF infers
    # one from pad_token_id and would mask the <|im_end|> tokens inside chat prompts.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.stack(out.logits)[:, 0]


def _hf_argmax(hf_smollm2, prompt_ids, token_ids) -> list[int]:
    """HF's greedy choice after prompt_ids + each prefix of token_ids, from one forward over the whole sequence
    (teacher forcing). It equals token_ids exactly when HF's greedy decoding of prompt_ids gives token_ids (by
    induction over the steps), at a tenth of generate's cost; _hf_greedy where the logits are compared too."""
    model, _ = hf_smollm2
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(token_ids)].argmax(-1).tolist()


def test_batched_greedy_matches_hf(smollm2_greedy, hf_smollm2):
    outs = smollm2_greedy  # PROMPTS, 32 tokens each, generated together (conftest)
    lengths = {len(o.prompt_token_ids) for o in outs}
    assert len(lengths) >= 6  # prompts of different lengths, generated together
    for o in outs:
        tokens = o.outputs[0].token_ids
        assert len(tokens) == 32 and o.outputs[0].finish_reason == "length"
        assert tokens == _hf_argmax(hf_smollm2, o.prompt_token_ids, tokens), o.prompt
        assert o.outputs[0].text == hf_smollm2[1].decode(tokens, skip_special_tokens=True)


def test_logprobs_equal_log_softmax_of_model_logits(smollm2_llm, hf_smollm2):
    out = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    ref_ids, ref_logits = _hf_greedy(hf_smollm2, smollm2_llm.get_tokenizer()(PROMPTS[0]).input_ids, 8)
    assert out.token_ids == ref_ids
    ref_lp = torch.log_softmax(ref_logits.float(), -1)
    assert len(out.logprobs) == 8
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert abs(entry[tok].logprob - ref_lp[step, tok].item()) < 1e-4
        top = torch.topk(ref_lp[step], 5)
        assert set(entry) == set(top.indices.tolist())
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-5


def test_stop_strings_and_stop_token_ids(smollm2_llm):
    greedy = SamplingParams(temperature=0, max_tokens=32)
    full = smollm2_llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    assert "answer" in full.text
    cut = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop=["answer", "zzz"]),
                               use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[: full.text.index("answer")]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "answer")
    kept = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop="answer",
                                                           include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index("answer") + len("answer")]
    third = full.token_ids[2]
    by_id = smollm2_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[third]),
                                 use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == full.token_ids[:3]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", third)
    eos = smollm2_llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == 2 and eos.stop_reason is None


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(smollm2_llm):
    def run(prompts, **kw):
        return [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, SamplingParams(max_tokens=12, **kw), use_tqdm=False)]

    a = run([PROMPTS[3]], temperature=0.9, seed=1234)[0]
    b = run([PROMPTS[0], PROMPTS[3], PROMPTS[1]], temperature=0.9, seed=1234)[1]  # other requests in the batch
    assert a == b
    assert run([PROMPTS[3]], temperature=0.9, seed=4321)[0] != a
    greedy = run(PROMPTS[:3], temperature=0)
    assert run(PROMPTS[:3], temperature=0.8, top_k=1) == greedy


def test_chat_template(smollm2_llm, hf_smollm2):
    chat = [{"role": "user", "content": "What is 2+2?"}]
    out = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt_token_ids[:1] == [1]  # <|im_start|>, from the template
    assert out.prompt_token_ids == hf_smollm2[1].apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=True)["input_ids"]
    assert (c.finish_reason, c.token_ids[-1]) == ("stop", 2) and len(c.token_ids) < 30  # ended by <|im_end|>
    assert c.token_ids == _hf_argmax(hf_smollm2, out.prompt_token_ids, c.token_ids)
    assert c.text == hf_smollm2[1].decode(c.token_ids, skip_special_tokens=True)
    assert "4" in c.text.replace("2+2", "")


def test_prefix_cache_hits_on_real_weights(smollm2_llm, hf_smollm2):
    engine = smollm2_llm.llm_engine
    shared = "You are a careful assistant. " * 12
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = smollm2_llm.generate(shared + "Name a colour.", greedy, use_tqdm=False)[0]
    second = smollm2_llm.generate(shared + "Name a fruit.", greedy, use_tqdm=False)[0]
    common = 0
    for x, y in zip(first.prompt_token_ids, second.prompt_token_ids):
        if x != y:
            break
        common += 1
    assert common > 64 and second.num_cached_tokens == (common // 16) * 16
    tokens = second.outputs[0].token_ids
    assert len(tokens) == 12 and tokens == _hf_argmax(hf_smollm2, second.prompt_token_ids, tokens)
    assert engine.local_core.scheduler.block_manager.num_free_blocks == engine.worker.model_runner.num_blocks
