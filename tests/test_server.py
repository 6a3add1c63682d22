"""The OpenAI-compatible server as a real `graphinfer serve` process on loopback.

One SmolLM2 server (fp32, --max-model-len 1024, --async-scheduling, so that the answers are also checked
against the synchronous offline engine; --max-num-batched-tokens 64, so that a long prompt is prefilled in
many chunks; --shutdown-timeout 2) answers the official `openai` client and the bad inputs, and is stopped
with SIGTERM while requests are in flight at the end. A tiny-qwen3-moe server with --api-key checks
authentication and the MoE expert-load metrics, and is stopped with SIGINT while idle at the end. Both start together
at the beginning of the module, so their start-up overlaps.
Shutdown with requests that finish while draining, SIGTERM while idle and a busy port: test_server_shutdown.py.
"""
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

import graphinfer
from server_utils import Server, assert_openai_error, metric, metric_samples, running_servers, sse_events

MODEL = "smol"
KEYED = "tiny-qwen3-moe"  # no tokenizer; MoE layers: the expert-load metrics
MAX_MODEL_LEN, BUDGET = 1024, 64
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with running_servers({
        "smol": ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL,
                 "--async-scheduling", "--max-num-batched-tokens", str(BUDGET), "--shutdown-timeout", "2"],
        "keyed": [KEYED, "--api-key", "secret", "--max-model-len", "256"],
    }, tmp_path_factory.mktemp("servers")) as launched:
        yield launched


@pytest.fixture(scope="module")
def smol(servers):
    return servers["smol"].wait_ready(300)  # SmolLM2 starts in ~30 s; far longer on a loaded machine


@pytest.fixture(scope="module")
def keyed(servers):
    return servers["keyed"].wait_ready(180)


@pytest.fixture(scope="module")
def client(smol):
    with openai.OpenAI(base_url=f"{smol.url}/v1", api_key="EMPTY", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(smol):
    with httpx.Client(base_url=smol.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_ref(client):
    """The greedy 16-token completion of PROMPT, which several tests compare against."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert len(r.choices[0].text.split()) >= 3, r.choices[0].text
    return r


# ----- the official openai client -----

def test_models_and_version(smol, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra.get("max_model_len") == MAX_MODEL_LEN
    assert httpx.get(f"{smol.url}/version").json() == {"version": graphinfer.__version__}


def test_completion_greedy_stream_equals_non_stream(client, greedy_ref):
    ref = greedy_ref.choices[0]
    assert greedy_ref.object == "text_completion" and greedy_ref.model == MODEL
    assert greedy_ref.usage.prompt_tokens > 0
    assert greedy_ref.usage.total_tokens == greedy_ref.usage.prompt_tokens + 16
    assert ref.index == 0 and ref.text.strip()

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump() == greedy_ref.usage.model_dump()
    assert all(c.usage is None for c in text_chunks)


def test_chat_greedy_stream_equals_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > len(CHAT[0]["content"].split())  # the chat template added tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *deltas, usage_chunk = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == msg.content
    assert deltas[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == r.usage.model_dump()


def test_stop_string(client, greedy_ref):
    ref = greedy_ref.choices[0].text
    word = ref.split()[2]  # a stop string that the greedy text reaches after a few tokens
    expected = ref[:ref.index(word)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=["never-in-the-output-zq", word])
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (expected, "stop")
    assert c.model_extra.get("stop_reason") == word
    assert word not in c.text and r.usage.completion_tokens < 16

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=word,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected  # held-back text never leaks the stop string
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_stop_string(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    if len(words) < 2:
        pytest.skip(f"greedy chat reply too short for a stop string: {text!r}")
    word = words[1]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[word])
    assert r.choices[0].message.content == text[:text.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_gives_length(client, greedy_ref):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert greedy_ref.choices[0].text.startswith(r.choices[0].text)

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_logprobs(client, greedy_ref):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    n = r.usage.completion_tokens
    assert n == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text and greedy_ref.choices[0].text.startswith(c.text)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3, top
        assert tlp <= 0 and all(v <= 0 and math.isfinite(v) for v in top.values())
        # greedy: the chosen token is the most likely one
        assert top[tok] == pytest.approx(tlp) and tlp == pytest.approx(max(top.values()))

    # streamed, the per-chunk logprobs add up to the same
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            stream=True))
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    lps = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert lps == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert isinstance(e.token, str) and e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)

    # without logprobs=True there are none
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_batch_prompts(client):
    prompts = [PROMPT, "1, 2, 3, 4,", "Hello, my name is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.text for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, finish = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        (c,) = ch.choices
        assert finish[c.index] is None, "a chunk after its finish_reason"
        texts[c.index] += c.text
        finish[c.index] = c.finish_reason
    assert texts == [c.text for c in r.choices]
    assert finish == [c.finish_reason for c in r.choices]
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_tokenize_and_detokenize_round_trip(http, smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    text = "The capital of France is Paris. ÄÖÜ \u4e2d\u6587 🙂"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok(text).input_ids and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": text}
    # messages: the chat template's text, whose special tokens are not added twice
    chat = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat == tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False).input_ids
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 400)
    assert "[0, 49152)" in assert_openai_error(http.post("/detokenize", json={"tokens": [10**6]}), 400)["message"]
    assert_openai_error(http.post("/detokenize", json={"model": "other", "tokens": [1]}), 404)


def test_token_id_prompt_equals_text_prompt(client, greedy_ref, smollm2_llm):
    ids = smollm2_llm.llm_engine.tokenize(PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == greedy_ref.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == greedy_ref.choices[0].text


def test_greedy_equals_offline_llm(smollm2_llm, greedy_ref):
    """The server's greedy text is what graphinfer.LLM generates offline for the same prompt."""
    out = smollm2_llm.generate([PROMPT], graphinfer.SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text == greedy_ref.choices[0].text


# ----- bad inputs -----

LONG_TEXT = "hello " * 1100  # ~1100 tokens, over --max-model-len 1024
USER_HI = '{"role": "user", "content": "hi"}'

BAD = [  # (id, path, raw body, expected status)
    ("malformed-json-cmpl", "/v1/completions", '{"model": "smol", "prompt": "hi",', 400),
    ("malformed-json-chat", "/v1/chat/completions", '{"messages": [{"role": "user"', 400),
    ("not-an-object", "/v1/completions", '["prompt"]', 400),
    ("missing-prompt", "/v1/completions", '{"max_tokens": 2}', 400),
    ("max_tokens-str", "/v1/completions", '{"prompt": "hi", "max_tokens": "abc"}', 400),
    ("temperature-list", "/v1/completions", '{"prompt": "hi", "temperature": []}', 400),
    ("messages-not-list", "/v1/chat/completions", '{"messages": "hello"}', 400),
    ("messages-empty", "/v1/chat/completions", '{"messages": []}', 400),
    ("max_tokens-negative", "/v1/completions", '{"prompt": "hi", "max_tokens": -1}', 400),
    ("max_tokens-zero-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400),
    ("temperature-negative", "/v1/completions", '{"prompt": "hi", "temperature": -0.5}', 400),
    ("top_p-zero", "/v1/completions", '{"prompt": "hi", "top_p": 0}', 400),
    ("prompt-too-long-text", "/v1/completions", f'{{"prompt": "{LONG_TEXT}", "max_tokens": 2}}', 400),
    ("prompt-too-long-ids", "/v1/completions", f'{{"prompt": {[1] * 1100}, "max_tokens": 2}}', 400),
    ("prompt-too-long-chat", "/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONG_TEXT}"}}]}}', 400),
    ("prompt-empty", "/v1/completions", '{"prompt": []}', 400),
    ("prompt-id-out-of-vocab", "/v1/completions", '{"prompt": [1, 1000000000]}', 400),
    ("unknown-model-cmpl", "/v1/completions", '{"model": "nope", "prompt": "hi"}', 404),
    ("unknown-model-chat", "/v1/chat/completions", '{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404),
    ("n-0", "/v1/completions", '{"prompt": "hi", "n": 0}', 400),
    ("n-129-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "n": 129}', 400),
    ("best_of-under-n", "/v1/completions", '{"prompt": "hi", "n": 3, "best_of": 2}', 400),
    ("prompt_logprobs-stream", "/v1/completions", '{"prompt": "hi", "prompt_logprobs": 1, "stream": true}', 400),
    ("prompt_logprobs-whole-vocab", "/v1/completions", '{"prompt": "hi", "prompt_logprobs": -1}', 400),
    ("max_tokens-zero-no-echo", "/v1/completions", '{"prompt": "hi", "max_tokens": 0}', 400),
    ("logprobs-21", "/v1/completions", '{"prompt": "hi", "logprobs": 21}', 400),
    ("top_logprobs-21", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}', 400),
    ("stop-empty-string", "/v1/completions", '{"prompt": "hi", "stop": [""]}', 400),
    ("min_tokens-over-max", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "min_tokens": 3}', 400),
    # regressions: each of these used to answer 500, the first three by killing the engine loop for good
    ("stop_token_id-out-of-vocab", "/v1/completions", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [1000000]}', 400),
    ("stop_token_id-over-int64", "/v1/completions", '{"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [100000000000000000000]}', 400),
    ("temperature-nan", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400),
    ("repetition_penalty-inf", "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', 400),
    ("lone-surrogate-prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400),
    ("lone-surrogate-chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("lone-surrogate-model", "/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', 400),
    # vLLM's validation (issue 16)
    ("body-not-utf8", "/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}', 400),
    ("role-unknown", "/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("role-missing", "/v1/chat/completions", '{"messages": [{"content": "hi"}]}', 400),
    ("role-function", "/v1/chat/completions", '{"messages": [{"role": "function", "name": "f", "content": "hi"}]}', 400),
    ("content-missing-user", "/v1/chat/completions", '{"messages": [{"role": "user"}]}', 400),
    ("content-null-user", "/v1/chat/completions", '{"messages": [{"role": "user", "content": null}]}', 400),
    ("content-missing-system", "/v1/chat/completions", f'{{"messages": [{{"role": "system"}}, {USER_HI}]}}', 400),
    ("content-null-developer", "/v1/chat/completions", f'{{"messages": [{{"role": "developer", "content": null}}, {USER_HI}]}}', 400),
    ("content-missing-tool", "/v1/chat/completions", f'{{"messages": [{USER_HI}, {{"role": "tool", "tool_call_id": "c1"}}]}}', 400),
    ("content-missing-assistant", "/v1/chat/completions", f'{{"messages": [{USER_HI}, {{"role": "assistant"}}]}}', 400),
    ("content-part-image", "/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400),
    ("max_tokens-over-context-text", "/v1/completions", f'{{"prompt": "hi", "max_tokens": {MAX_MODEL_LEN}}}', 400),
    ("max_tokens-over-context-ids", "/v1/completions", f'{{"prompt": [1, 2, 3], "max_tokens": {MAX_MODEL_LEN - 2}}}', 400),
    ("max_tokens-over-context-batch", "/v1/completions", f'{{"prompt": [[1], [1, 2, 3]], "max_tokens": {MAX_MODEL_LEN - 2}}}', 400),
    ("max_tokens-over-context-chat", "/v1/chat/completions", f'{{"messages": [{USER_HI}], "max_tokens": {MAX_MODEL_LEN}}}', 400),
    ("max_completion_tokens-over-context", "/v1/chat/completions", f'{{"messages": [{USER_HI}], "max_completion_tokens": {MAX_MODEL_LEN}}}', 400),
    ("top_logprobs-without-logprobs", "/v1/chat/completions", f'{{"messages": [{USER_HI}], "top_logprobs": 2}}', 400),
    ("top_logprobs-logprobs-false", "/v1/chat/completions", f'{{"messages": [{USER_HI}], "logprobs": false, "top_logprobs": 2}}', 400),
    ("stream_options-without-stream", "/v1/completions", '{"prompt": "hi", "stream_options": {"include_usage": true}}', 400),
    ("stream_options-stream-false-chat", "/v1/chat/completions", f'{{"messages": [{USER_HI}], "stream": false, "stream_options": {{"include_usage": true}}}}', 400),
]


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(http, path, body, status):
    resp = http.post(path, content=body if isinstance(body, bytes) else body.encode(),
                     headers={"content-type": "application/json"})
    err = assert_openai_error(resp, status)
    if status == 404:
        assert err["type"] == "NotFoundError" and "nope" in err["message"]
    else:
        assert err["type"] == "BadRequestError", err


def test_top_k_beyond_the_vocabulary_means_no_top_k(http):
    # used to overflow int64 in the sampler and kill the engine loop; now clamped there, as vLLM does
    resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 10**20})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def test_prompt_too_long_says_why(http):
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": [1] * 1100}), 400)
    assert "1024" in err["message"] and "1100" in err["message"]


def test_max_tokens_beyond_the_context_says_why(http):
    """vLLM answers 400 (graphinfer used to clamp max_tokens silently), with the numbers."""
    err = assert_openai_error(http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1100}), 400)
    assert err["type"] == "BadRequestError"
    for number in ("1024", "1100", "3", "1021"):  # context, asked, prompt, the most that fits
        assert re.search(rf"\b{number}\b", err["message"]), err["message"]
    body = {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN - 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as ok:  # exactly at the limit is fine
        assert ok.status_code == 200
        assert next(line for line in ok.iter_lines() if line).startswith("data: {")
    # leaving the block disconnects: the request is aborted


def _client_error(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    body = info.value.body
    err = body.get("error", body) if isinstance(body, dict) else {}
    assert err.get("type") == "BadRequestError" and err.get("code") == 400, body
    return err


HI = [{"role": "user", "content": "hi"}]
CLIENT_BAD = [  # (id, call(client), a word the message must contain)
    ("role-unknown", lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}],
                                                         max_tokens=2), "role"),
    ("content-missing", lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2),
     "content"),
    ("content-null", lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": None}],
                                                         max_tokens=2), "content"),
    ("assistant-without-content", lambda c: c.chat.completions.create(
        model=MODEL, messages=HI + [{"role": "assistant"}], max_tokens=2), "content"),
    ("max_tokens-over-context", lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN),
     str(MAX_MODEL_LEN)),
    ("max_completion_tokens-over-context", lambda c: c.chat.completions.create(
        model=MODEL, messages=HI, max_completion_tokens=MAX_MODEL_LEN), str(MAX_MODEL_LEN)),
    ("top_logprobs-without-logprobs", lambda c: c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                                          top_logprobs=2), "logprobs"),
    ("stream_options-without-stream", lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}), "stream"),
    ("stream_options-without-stream-chat", lambda c: c.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, stream_options={"include_usage": True}), "stream"),
    ("tools-auto-without-tool-call-parser", lambda c: c.chat.completions.create(  # vLLM's message
        model=MODEL, messages=HI, max_tokens=2, tools=[{"type": "function", "function": {"name": "f"}}]),
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
]


@pytest.mark.parametrize("call,word", [c[1:] for c in CLIENT_BAD], ids=[c[0] for c in CLIENT_BAD])
def test_validation_with_the_openai_client(client, call, word):
    assert word in _client_error(lambda: call(client))["message"]


def test_what_vllm_accepts_is_accepted(client):
    """Every OpenAI role; an assistant turn with tool_calls and no content; top_logprobs=0 without logprobs and a
    null stream_options without stream (vLLM lets both through)."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "4"},
                {"role": "user", "content": [{"type": "text", "text": "So?"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, top_logprobs=0)
    assert r.usage.completion_tokens >= 1 and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"stream_options": None})
    assert r.usage.completion_tokens == 2


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert http.get("/v1/completions").status_code == 405


def test_still_healthy_after_bad_inputs(smol, http, client, greedy_ref):
    assert http.get("/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == greedy_ref.choices[0].text
    assert "graphinfer:http_requests_total" in http.get("/metrics").text


# ----- a non-streaming client that goes away -----

def _samples(http):
    return metric_samples(http.get("/metrics").text)


def test_non_stream_client_disconnect_aborts(smol, http):
    """A client that gives up on a non-streaming request (here after 1 s of a ~15 s one) has its requests
    aborted: their KV blocks are freed and they are counted as finished_reason="abort", not run to the end."""
    before = _samples(http)

    def give_up(body):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{smol.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))

    give_up({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})
    give_up({"prompt": ["Once upon a time", "In a galaxy far away"], "max_tokens": 200, "ignore_eos": True})

    deadline, m = time.monotonic() + 20, before
    while time.monotonic() < deadline:
        m = _samples(http)
        if (metric(m, "graphinfer:request_success_total", finished_reason="abort")
                == metric(before, "graphinfer:request_success_total", finished_reason="abort") + 3
                and metric(m, "graphinfer:num_requests_running") == 0
                and metric(m, "graphinfer:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    for reason in ("abort", "length", "stop"):
        delta = (metric(m, "graphinfer:request_success_total", finished_reason=reason)
                 - metric(before, "graphinfer:request_success_total", finished_reason=reason))
        assert delta == (3 if reason == "abort" else 0), (reason, delta)
    assert metric(m, "graphinfer:num_requests_running") == 0 and metric(m, "graphinfer:kv_cache_usage_perc") == 0
    assert metric(m, "graphinfer:generation_tokens_total") == metric(before, "graphinfer:generation_tokens_total")


# ----- API key -----

def test_api_key(keyed):
    url = keyed.url
    body = {"model": KEYED, "prompt": [1, 2, 3], "max_tokens": 2}
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 401)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "secret"}), 401)
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401)
    ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer secret"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer secret"}).json()["data"][0]["id"] == KEYED
    # the unauthenticated endpoints
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and 'status="401"' in metrics.text
    assert httpx.get(f"{url}/version").status_code == 200

    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=KEYED, prompt=[1, 2, 3], max_tokens=2)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0) as good:
        assert good.completions.create(model=KEYED, prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2
        # the tiny presets have no tokenizer, so no chat template: a 400, not a crash
        with pytest.raises(openai.BadRequestError):
            good.chat.completions.create(model=KEYED, messages=CHAT, max_tokens=2)


def test_moe_expert_load_metrics(keyed):
    """Per layer and expert: the tokens routed there (a request of 3 prompt tokens and 2 output tokens runs 4
    tokens through every layer: the prompt, then one decode step; each counts top_k = 2 times), and the
    imbalances."""
    def scrape():
        return metric_samples(httpx.get(f"{keyed.url}/metrics").text)

    def routed(samples, layer):
        return sum(metric(samples, "graphinfer:moe_expert_tokens_total", layer=str(layer), expert=str(e))
                   for e in range(8))

    before = scrape()
    body = {"model": KEYED, "prompt": [1, 2, 3], "max_tokens": 2}
    ok = httpx.post(f"{keyed.url}/v1/completions", json=body, headers={"Authorization": "Bearer secret"}, timeout=60)
    assert ok.status_code == 200
    after = scrape()
    for layer in (0, 1):
        assert routed(after, layer) - routed(before, layer) == 4 * 2
        assert metric(after, "graphinfer:moe_expert_imbalance", layer=str(layer)) >= 1.0
        assert metric(after, "graphinfer:moe_ep_rank_imbalance", layer=str(layer), ep_size="1") == 1.0


# ----- large requests never stall the others -----

class HealthProbe:
    """Polls /health from a thread while a test runs; keeps each answer's status and latency."""

    def __init__(self, url: str, period: float = 0.02):
        self.url, self.period, self.samples = url, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                status = c.get(f"{self.url}/health").status_code
                self.samples.append((status, time.perf_counter() - t0))
                time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def check(self, what: str) -> str:
        latencies = sorted(t for _, t in self.samples)
        assert len(latencies) >= 5 and all(s == 200 for s, _ in self.samples), (what, self.samples[:20])
        p50, p90, worst = statistics.median(latencies), latencies[int(0.9 * (len(latencies) - 1))], latencies[-1]
        # Under 100 ms, bar the odd answer: on a 2-core machine shared with the test client (and other jobs) the OS
        # can delay any single one. The worst is still bounded far below the 12-16 s stall this used to be.
        assert p50 < 0.1 and p90 < 0.1 and worst < 2.0, (what, p50, p90, worst)
        return f"/health during {what}: {len(latencies)} answers, p50 {1000 * p50:.0f} ms, p90 {1000 * p90:.0f} ms, " \
               f"max {1000 * worst:.0f} ms"


def test_huge_bodies_are_refused_while_health_answers(smol, http):
    """A 10 MB prompt: 413 (over the default 4 MiB limit) from the Content-Length alone, and from the bytes counted
    as they arrive when the body is chunked. A 3 MB prompt (under the limit): its length alone proves it longer than
    max_model_len, so it is refused without being tokenized. /health answers throughout."""
    huge = {"model": MODEL, "prompt": "hello " * (10 * 2**20 // 6), "max_tokens": 2}
    large = {"model": MODEL, "prompt": "hello " * (3 * 2**20 // 6), "max_tokens": 2}
    with HealthProbe(smol.url) as probe:
        t0 = time.perf_counter()
        err = assert_openai_error(http.post("/v1/completions", json=huge), 413)
        assert err["type"] == "RequestTooLargeError" and str(4 * 2**20) in err["message"]
        chunks = (b"x" * 2**16 for _ in range(160))  # a generator body goes out chunked: no Content-Length
        err = assert_openai_error(http.post("/v1/completions", content=chunks,
                                            headers={"content-type": "application/json"}), 413)
        err = assert_openai_error(http.post("/v1/completions", json=large), 400)
        assert err["type"] == "BadRequestError" and "characters, so at least" in err["message"], err
        took = time.perf_counter() - t0
        # urllib sends the whole body before it reads: it sees a reset unless the server reads the body first
        req = urllib.request.Request(f"{smol.url}/v1/completions", data=json.dumps(huge).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 413 and json.loads(refused.value.read())["error"]["type"] == "RequestTooLargeError"
        with openai.OpenAI(base_url=f"{smol.url}/v1", api_key="EMPTY", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as refused:
                c.completions.create(model=MODEL, prompt=huge["prompt"], max_tokens=2)
        assert refused.value.status_code == 413 and "--max-request-body-bytes" in refused.value.message
        time.sleep(0.2)
    print(f"\n{probe.check('a 10 MB, a chunked 10 MB and a 3 MB prompt')}; the three refused in {took:.2f} s")


def test_tokenizing_runs_off_the_event_loop(smol, http):
    """Prompts short enough (in characters) to need tokenizing, and too long once tokenized: 8 at once, each
    ~80k characters. They are tokenized on worker threads and refused with the token count; meanwhile /health,
    and a stream already running, keep going."""
    text = "hello " * 13000  # 78,000 characters, ~13,000 tokens (the character bound is ~83,000 at 1024 tokens)

    def post(_):
        return httpx.post(f"{smol.url}/v1/completions", json={"prompt": text, "max_tokens": 2}, timeout=120)

    from concurrent.futures import ThreadPoolExecutor

    with HealthProbe(smol.url) as probe, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
        time.sleep(0.2)
    for r in responses:
        err = assert_openai_error(r, 400)
        assert "tokens" in err["message"] and "1024" in err["message"] and "characters" not in err["message"], err
    print(f"\n{probe.check('8 prompts of 78k characters tokenized at once')}")


# ----- fair scheduling -----

def test_long_prompt_mid_stream_keeps_the_stream_flowing(smol):
    """A 600-token prompt arrives while a stream runs. The server (--max-num-batched-tokens 64) prefills it in ~10
    chunks, one per engine step, and the stream gets a token in each step. Bound: the stream's largest gap while
    the prompt is prefilled is under a third of that prompt's time to first token (ideally ~1/10; without chunking,
    the stream would wait for all of it). Both times come from the same run, so the ratio holds on a loaded
    machine; the exact per-step bound is checked in test_server_fairness.py."""
    times, errors = [], []
    stop = threading.Event()

    def read():
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{smol.url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
                    if stop.is_set():
                        return  # disconnect: the stream is aborted
        except httpx.HTTPError as e:
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while len(times) < 4 and time.monotonic() < deadline and reader.is_alive():
        time.sleep(0.01)
    assert len(times) >= 4, errors
    prompt = [(37 * i) % 40000 + 100 for i in range(600)]
    t_send = time.monotonic()
    r = httpx.post(f"{smol.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=300)
    t_done = time.monotonic()
    stop.set()
    reader.join(60)
    assert r.status_code == 200, r.text
    ttft = t_done - t_send
    window = [t for t in times if t_send <= t <= t_done]
    before = [t for t in times if t < t_send]
    gaps = [b - a for a, b in zip([before[-1]] + window, window + [t_done])]
    assert len(window) >= 5, (len(window), ttft)  # the stream kept receiving tokens during the prefill
    print(f"\nlong prompt TTFT {ttft:.2f} s; the stream got {len(window)} tokens meanwhile, largest gap "
          f"{max(gaps):.2f} s ({max(gaps) / ttft:.2f} of the TTFT)")
    assert max(gaps) < ttft / 3, (max(gaps), ttft, gaps)


# ----- the banner's examples, pasted into a fresh shell -----

def banner_commands(log: str) -> list[str]:
    """The banner's example commands, each as printed (with its backslash-newline continuations, for bash)."""
    text = log[log.index("graphinfer is serving"):]
    commands, current = [], ""
    for line in text.splitlines()[1:]:
        if not line.strip():
            break
        current += line + "\n"
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def test_banner_examples_work_in_a_fresh_shell(smol):
    """The printed examples name this interpreter and graphinfer by absolute path, so they work pasted into a shell
    where the venv is not active (here: `env -i`, PATH=/usr/bin:/bin)."""
    commands = banner_commands(smol.log())
    python = next(c for c in commands if "from openai import OpenAI" in c)
    curl = next(c for c in commands if c.split()[0] == "curl")
    bench = next(c for c in commands if " bench serve " in c)
    for command in (python, bench):
        exe = command.split()[0]
        assert os.path.isabs(exe) and os.access(exe, os.X_OK), command
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    out = subprocess.run(["bash", "-c", python], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), (python, out.stderr[-2000:])
    if shutil.which("curl"):
        out = subprocess.run(["bash", "-c", curl], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and '"chat.completion"' in out.stdout, (curl, out.stdout, out.stderr)
    out = subprocess.run(["bash", "-c", bench.split(" bench ")[0] + " bench serve --help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--concurrency" in out.stdout, out.stderr[-2000:]


# ----- SIGTERM -----

def _wait_exit(server: Server, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        rc = server.proc.wait(timeout)
    except Exception:
        rc = None
    return rc, time.monotonic() - t0


def test_sigterm_past_the_shutdown_timeout(smol):
    """Last test of the SmolLM2 server: it stops it (--shutdown-timeout 2) with a 300-token stream (~20 s
    on CPU) and a non-streaming request of the same length in flight. New requests get 503 at once; after 2 s the
    stream ends with an error event and [DONE], the non-streaming request gets a 503; the exit status is 0 and no
    KV-cache block is left in use."""
    lines, results, errors = [], {}, []

    def read():
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{smol.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:
            errors.append(e)

    def wait_whole():
        body = {"prompt": "In a galaxy far away", "max_tokens": 300, "ignore_eos": True}
        try:
            results["whole"] = httpx.post(f"{smol.url}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            errors.append(e)

    threads = [threading.Thread(target=f, daemon=True) for f in (read, wait_whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len([x for x in lines if x]) < 2 and time.monotonic() < deadline and threads[0].is_alive():
        time.sleep(0.02)
    assert len([x for x in lines if x]) >= 2, (lines, errors)
    smol.proc.send_signal(signal.SIGTERM)
    t_signal = time.monotonic()
    while httpx.get(f"{smol.url}/health", timeout=10).status_code == 200:
        time.sleep(0.02)
    assert_openai_error(httpx.get(f"{smol.url}/health", timeout=10), 503)
    err = assert_openai_error(httpx.post(f"{smol.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                         timeout=10), 503)
    assert err["type"] == "ServiceUnavailableError" and "shutting down" in err["message"]
    rc, _ = _wait_exit(smol, 40)
    took = time.monotonic() - t_signal
    assert rc == 0, (rc, smol.log()[-3000:])
    assert 2 <= took < 32, took  # the drain's 2 s, then the stop (a step in progress finishes first)
    for t in threads:
        t.join(10)
    events, done = sse_events(lines)
    assert done and "error" in events[-1], (events[-2:], done, errors)
    assert events[-1]["error"]["code"] == 503 and events[-1]["error"]["type"] == "ServiceUnavailableError"
    assert all("choices" in e for e in events[:-1]) and len(events) > 2
    err = assert_openai_error(results["whole"], 503)
    assert "shutdown timeout" in err["message"]
    log = smol.log()
    assert re.search(r"0 request\(s\) finished while draining, 2 ended at the shutdown timeout; "
                     r"KV-cache blocks in use: 0", log), log[-2000:]
    assert "Traceback" not in log, log[-3000:]


def test_sigint_with_nothing_in_flight(keyed):
    """Last test of the keyed server (after the API-key and expert-load tests): SIGINT with nothing in flight ends it
    promptly with status 0 (a busy host: 12 s), without a traceback."""
    keyed.proc.send_signal(signal.SIGINT)
    rc, took = _wait_exit(keyed, 20)
    assert rc == 0 and took < 20, (rc, took, keyed.log()[-2000:])
    assert "Traceback" not in keyed.log()
